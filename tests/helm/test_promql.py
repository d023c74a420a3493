"""Every PromQL expression the chart ships names only series a live store exports.

A real `prefixstore serve` process is started and given traffic (saves,
hits, misses, capacity evictions), then /metrics is scraped. Expressions come
from the Grafana dashboard (panel targets and variable queries) and the
PrometheusRule rendered by Helm; each is parsed by a PromQL parser and every
vector selector in it must be a series of the exposition: a gauge by its
name, a counter as NAME_total, a histogram as NAME_bucket / _sum / _count.
The one series that is not the store's is `up`, which Prometheus itself
writes for every scrape target (the node-down alert needs it).

Label matchers and `by (...)` labels are checked too: each must be a label
of the series it is applied to (or a target label Prometheus adds).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixstore.client import ClientConfig, SyncPrefixClient

from ..factories import kv_payload, make_namespace, state_payload
from ..serve_process import http_get, serving
from .chart import CHART, render

DASHBOARD = CHART / "dashboards" / "prefixstore.json"
# Labels Prometheus attaches to every scraped series (target labels), not the store.
TARGET_LABELS = {"job", "namespace", "instance", "pod", "service", "endpoint_name"}
PROMETHEUS_SERIES: dict[str, set[str]] = {"up": set()}  # series Prometheus writes itself, with their own labels
# Series of the cluster, not of the store: the kubelet's volume stats (scraped by kube-prometheus-stack),
# with the labels the kubelet gives them. The dashboard's disk-fill panel reads the LMDB volume's use there.
CLUSTER_SERIES: dict[str, set[str]] = {
    "kubelet_volume_stats_used_bytes": {"namespace", "persistentvolumeclaim"},
    "kubelet_volume_stats_capacity_bytes": {"namespace", "persistentvolumeclaim"},
}
# Grafana's built-in variables, replaced by what Grafana would put there.
GRAFANA_DURATIONS = re.compile(r"\$__(rate_interval|interval|range)\b")


@dataclass
class Exposition:
    series: dict[str, set[str]] = field(default_factory=dict)  # series name -> labels seen or declared
    with_samples: set[str] = field(default_factory=set)


SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}


def parse_exposition(text: str) -> Exposition:
    out = Exposition()
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            out.series.setdefault(family.name + suffix, set())
        for sample in family.samples:
            out.series.setdefault(sample.name, set()).update(sample.labels)
            out.with_samples.add(sample.name)
    return out


@pytest.fixture(scope="module")
def exposition() -> Iterator[Exposition]:
    """/metrics of a real store after real traffic."""
    with serving() as serve:
        # 32 pages of 4 KiB: the saves below overflow it, so capacity evictions happen.
        proc = serve("--port", "0", "--data-dir", "none", "--ram-bytes", "128KiB", "--page-bytes", "4096")
        assert proc.url is not None
        ns = make_namespace()
        with SyncPrefixClient(ns, ClientConfig(url=proc.url)) as client:
            for seq in range(4):
                tokens = [1000 * seq + i for i in range(64)]
                prompt = client.prompt(tokens)
                client.save(prompt, 64, lambda a, b, t=tokens: kv_payload(ns, t, a, b),
                            {32: state_payload(ns, tokens, 32), 64: state_payload(ns, tokens, 64)})
                res = client.lookup(tokens + [7, 7, 7])  # a hit (or a partial one after evictions)
                client.release(res.lease_id)
                client.lookup([999_999 + i for i in range(16)])  # a miss
        status, body = http_get(proc.url + "/metrics")
        assert status == 200
        yield parse_exposition(body.decode())


@dataclass(frozen=True)
class Selector:
    name: str
    labels: frozenset[str]


def selectors_and_groupings(expr: str) -> tuple[list[Selector], list[tuple[frozenset[str], list[Selector]]]]:
    """Vector selectors of ``expr``, and for each by/without clause its labels with the selectors under it."""
    tree = promql_parser.parse(GRAFANA_DURATIONS.sub("5m", expr))
    selectors: list[Selector] = []
    groupings: list[tuple[frozenset[str], list[Selector]]] = []

    def visit(node: Any) -> list[Selector]:
        found: list[Selector] = []
        if isinstance(node, promql_parser.VectorSelector):
            names = [m.value for m in node.matchers.matchers if m.name == "__name__"]
            name = node.name or (names[0] if names else None)
            assert name, f"a selector without a metric name in {expr!r}"
            found.append(Selector(name, frozenset(m.name for m in node.matchers.matchers if m.name != "__name__")))
            selectors.extend(found)
            return found
        for attr in ("lhs", "rhs", "expr", "vector_selector", "param"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                found += visit(child)
        for child in getattr(node, "args", None) or []:
            found += visit(child)
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            groupings.append((frozenset(node.modifier.labels), found))
        return found

    visit(tree)
    return selectors, groupings


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every variable query of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_][A-Za-z0-9_]*)\)", query)
        assert m, f"variable {var['name']}: not a label_values(selector, label) query: {query!r}"
        out.append((f"variable {var['name']}", m.group(1)))
    return out


def rule_expressions() -> list[tuple[str, str]]:
    rendered = render({"metrics": {"prometheusRule": {"enabled": True}}})
    rules = rendered.one("PrometheusRule")["spec"]["groups"][0]["rules"]
    return [(f"alert {r['alert']}", r["expr"]) for r in rules]


def check(where: str, expr: str, exposition: Exposition) -> set[str]:
    """Assert every series and label of ``expr`` exists; returns the series names it uses."""
    outside = {**PROMETHEUS_SERIES, **CLUSTER_SERIES}
    known = {**exposition.series, **outside}
    selectors, groupings = selectors_and_groupings(expr)
    assert selectors, f"{where}: no series in {expr!r}"
    for s in selectors:
        assert s.name in known, f"{where}: {s.name} is not exported by a live store (expr {expr!r})"
        if s.name in exposition.with_samples or s.name in outside:
            unknown = s.labels - known[s.name] - TARGET_LABELS
            assert not unknown, f"{where}: {s.name} has no label(s) {sorted(unknown)}"
    for labels, under in groupings:
        available = set(TARGET_LABELS)
        for s in under:
            available |= known[s.name]
        if all(s.name in exposition.with_samples for s in under):
            assert labels <= available, f"{where}: grouping by {sorted(labels - available)} absent from {expr!r}"
    return {s.name for s in selectors}


def test_the_live_store_had_the_traffic_the_checks_rely_on(exposition: Exposition) -> None:
    """The label checks only bite on series with samples: make sure the main ones have them."""
    for name in ("prefixstore_lookup_tokens_total", "prefixstore_model_lookup_tokens_total", "prefixstore_admission_total", "prefixstore_evictions_total",
                 "prefixstore_request_duration_seconds_bucket", "prefixstore_requests_total",
                 "prefixstore_transfer_bytes_total", "prefixstore_stored_bytes", "prefixstore_entries"):
        assert name in exposition.with_samples, name
    assert {"kind", "result"} <= exposition.series["prefixstore_lookup_tokens_total"]
    assert {"tenant", "model", "kind", "result"} <= exposition.series["prefixstore_model_lookup_tokens_total"]
    assert {"kind", "reason"} <= exposition.series["prefixstore_evictions_total"]


def test_dashboard_queries_name_only_exported_series(exposition: Exposition) -> None:
    used: set[str] = set()
    for where, expr in dashboard_expressions():
        used |= check(where, expr, exposition)
    # The panels the issue asks for are there: hit rates, occupancy, admission, evictions,
    # replication, bandwidth by path, latency percentiles.
    assert {"prefixstore_lookup_tokens_total", "prefixstore_stored_bytes", "prefixstore_entries",
            "prefixstore_admission_total", "prefixstore_evictions_total", "prefixstore_replication_pushes_total",
            "prefixstore_replication_bytes_total", "prefixstore_replicas", "prefixstore_transfer_bytes_total",
            "prefixstore_request_duration_seconds_bucket"} <= used
    # Node resources: RSS (the process collector) against the arena, descriptors, the LMDB volume's fill.
    assert {"process_resident_memory_bytes", "prefixstore_arena_capacity_bytes", "process_open_fds",
            "process_max_fds", "kubelet_volume_stats_used_bytes", "kubelet_volume_stats_capacity_bytes"} <= used
    # What the compute saved, and each tenant's usage against its quota (which holds per node).
    assert {"prefixstore_prefill_flops_saved_total", "prefixstore_tenant_stored_bytes",
            "prefixstore_tenant_quota_bytes"} <= used
    # Which model's hit rates collapsed, not only the global ones.
    assert "prefixstore_model_lookup_tokens_total" in used


def test_alert_rules_name_only_exported_series(exposition: Exposition) -> None:
    used: dict[str, set[str]] = {}
    for where, expr in rule_expressions():
        used[where] = check(where, expr, exposition)
    # Per model: a plain transformer's KV hits must not make a hybrid model's state collapse look healthy.
    assert used["alert PrefixstoreStateHitRateCollapsed"] == {"prefixstore_model_lookup_tokens_total"}
    assert "prefixstore_evictions_total" in used["alert PrefixstoreEvictionStorm"]
    assert used["alert PrefixstoreNodeDown"] == {"up"}
    assert used["alert PrefixstoreMembershipIncomplete"] == {"prefixstore_members"}


def test_the_check_catches_a_misspelt_series_and_label(exposition: Exposition) -> None:
    with pytest.raises(AssertionError, match="not exported"):
        check("test", "rate(prefixstore_lookup_token_total[5m])", exposition)
    with pytest.raises(AssertionError, match="not exported"):
        check("test", "prefixstore_lookups", exposition)  # a counter without _total
    with pytest.raises(AssertionError, match="no label"):
        check("test", 'prefixstore_lookup_tokens_total{kind="kv", outcome="hit"}', exposition)
    with pytest.raises(AssertionError, match="grouping"):
        check("test", "sum by (tier) (rate(prefixstore_lookup_tokens_total[5m]))", exposition)


def test_dashboard_json_is_the_output_of_its_builder() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("dashboard_build", CHART / "dashboards" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), "run: python helm/prefixstore/dashboards/build.py"
