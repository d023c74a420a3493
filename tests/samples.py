"""Reading a store's Prometheus series in tests: through its registry, by exported name and labels,
as a scrape would see them (never a client object's private ``_value``)."""

from __future__ import annotations

from prefixstore.store import Store


def sample(store: Store, name: str, **labels: str) -> float:
    """The value of series ``name{labels}``; 0 for a labelled series not yet touched (a counter that
    never counted), but a name the registry does not export fails (a misspelt name must not read 0)."""
    registry = store.metrics.registry
    value = registry.get_sample_value(name, labels)
    if value is not None:
        return value
    exported = {s.name for family in registry.collect() for s in family.samples}
    families = {family.name for family in registry.collect()}
    assert name in exported or name.removesuffix("_total") in families, f"no series named {name}"
    return 0.0


__all__ = ["sample"]
