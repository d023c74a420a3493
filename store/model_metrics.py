"""Token hit rates per model: ``prefixstore_model_lookup_tokens_total{tenant, model, kind, result}``.

The global ``prefixstore_lookup_tokens_total{kind, result}`` (DESIGN §10) cannot say *which*
model's state hit rate collapsed, the failure an operator serving several models must see.
Models are named by tenants (a namespace's ``model`` field), so the label is bounded: each tenant
gets its own series for at most ``model_metrics_per_tenant`` models, the first its lookups name
(on this node, since it started), and the lookups of any further model count under
``model="(other)"``. A tenant registering namespaces with new model names moves only its own
``(other)`` series, never another tenant's, and never adds series past
tenants x (model_metrics_per_tenant + 1) x 4. Rejected: a label per namespace (one tenant could
mint thousands), and first come first served across tenants (one tenant could take every slot).

Without a tenants file every namespace belongs to the open tenant (store/ledger.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

OTHER_MODELS = "(other)"
"""The model label of the lookups of a tenant's models beyond its first model_metrics_per_tenant."""


class ModelHitRates:
    def __init__(self, registry: CollectorRegistry, per_tenant: int) -> None:
        self.per_tenant = per_tenant
        self.tokens = Counter(
            "prefixstore_model_lookup_tokens", "Prompt tokens looked up, by tenant, model (a namespace's model "
            "id; a tenant's models beyond model_metrics_per_tenant count as '(other)'), memory kind and result.",
            ["tenant", "model", "kind", "result"], registry=registry)
        self._models: dict[str, dict[str, None]] = {}  # tenant -> models with their own series, in order met

    def label(self, tenant: str, model: str) -> str:
        """The model label ``model``'s lookups count under for ``tenant``."""
        models = self._models.setdefault(tenant, {})
        if model in models:
            return model
        if len(models) < self.per_tenant:
            models[model] = None
            return model
        return OTHER_MODELS

    def count(self, tenant: str, model: str, kind: str, hit_tokens: int, miss_tokens: int) -> None:
        label = self.label(tenant, model)
        self.tokens.labels(tenant, label, kind, "hit").inc(hit_tokens)
        self.tokens.labels(tenant, label, kind, "miss").inc(miss_tokens)

    def describe(self) -> list[dict[str, object]]:
        """Per (tenant, model) series: hit and miss tokens and the hit rate by kind (``/v1/stats``,
        ``prefixstore stats``); a kind never counted (plain transformers have no state) is absent."""
        rows: dict[tuple[str, str], dict[str, object]] = {}
        for family in self.tokens.collect():
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                row = rows.setdefault((s.labels["tenant"], s.labels["model"]),
                                      {"tenant": s.labels["tenant"], "model": s.labels["model"]})
                kind = row.setdefault(s.labels["kind"], {"hit_tokens": 0, "miss_tokens": 0})
                assert isinstance(kind, dict)
                kind[f"{s.labels['result']}_tokens"] = int(s.value)
        for row in rows.values():
            for kind in ("kv", "state"):
                counts = row.get(kind)
                if isinstance(counts, dict):
                    total = counts["hit_tokens"] + counts["miss_tokens"]
                    counts["rate"] = counts["hit_tokens"] / total if total else None
        return [rows[k] for k in sorted(rows)]


__all__ = ["OTHER_MODELS", "ModelHitRates"]
