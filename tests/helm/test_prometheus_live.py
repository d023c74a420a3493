"""The dashboard and the alerts on a real Prometheus that scrapes a plain 3-node cluster
(monitoring/local_prometheus.py: Debian's prometheus, no Kubernetes, so no `namespace` label).

While a workload runs (two tenants, a hybrid and a plain model), every dashboard expression, with
Grafana's variables as it would fill them there (Namespace: All, the job, every node), and every
operand of every alert rule must evaluate to at least one series, and every rule must load and
evaluate without error. A typo'd metric, a label the plain scrape lacks, or a counter with no
series until something goes wrong would each leave an empty panel or an alert that can never
fire: here they fail. tests/helm/test_promql.py checks the same expressions' names against a
store's exposition; this checks what Prometheus makes of them.

Skipped only where prometheus is not installed, and never in CI (.ci/run installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import promql_parser
import pytest

from .chart import ROOT
from .test_promql import dashboard_expressions

if shutil.which("prometheus") is None:
    if os.environ.get("CI"):
        raise RuntimeError("prometheus is not installed, and CI must run this test: .ci/run installs it")
    pytest.skip("prometheus is not installed (apt-get install prometheus; .ci/run installs it)",
                allow_module_level=True)

pytestmark = pytest.mark.slow

# Series only a Kubernetes cluster has (the kubelet's volume stats): their panel is empty on a plain
# Prometheus by design (docs/operations.md, "Without Kubernetes").
KUBERNETES_ONLY = ("kubelet_volume_stats_",)
INTERVAL_S = 1.0
DEADLINE_S = 120.0


def recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("local_prometheus", ROOT / "monitoring" / "local_prometheus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[ModuleType, Any]]:
    local = recipe()
    with local.local_cluster(3, interval_s=INTERVAL_S) as cluster, local.workload(cluster):
        yield local, cluster


def grafana(expr: str, job: str) -> str:
    """``expr`` with the variables as Grafana fills them on a plain scrape."""
    expr = expr.replace("$namespace", ".*").replace("$instance", ".*").replace("$job", job)
    return re.sub(r"\$__(rate_interval|interval)\b", "30s", expr.replace("$__range", "5m"))


COMPARISONS = {"<", ">", "<=", ">=", "==", "!="}
SET_OPERATORS = {"and", "or", "unless"}


def operands(expr: str) -> list[str]:
    """What must have series for ``expr`` to mean anything: an alert's threshold comparison filters,
    so its sides are asked apart (a number side is not asked); both sides of and/or/unless; else
    the expression itself."""
    out: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.ParenExpr):
            visit(node.expr)
            return
        if isinstance(node, promql_parser.BinaryExpr):
            op = str(node.op)
            modifier = node.modifier
            if op in SET_OPERATORS or (op in COMPARISONS and not (modifier is not None and modifier.return_bool)):
                for side in (node.lhs, node.rhs):
                    if not isinstance(side, promql_parser.NumberLiteral):
                        visit(side)
                return
        out.append(str(node))

    visit(promql_parser.parse(expr))
    return out


def rule_expressions(local: ModuleType) -> list[tuple[str, str]]:
    import yaml

    groups = yaml.safe_load(local.render_rules(local.SELECTOR, 3))["groups"]
    return [(f"alert {r['alert']}", r["expr"]) for g in groups for r in g["rules"]]


def wait_for_series(url: str, local: ModuleType, checks: list[tuple[str, str]]) -> dict[str, str]:
    """Poll until every check has series (bounded); what still has none (or fails), by check."""
    end = time.monotonic() + DEADLINE_S
    missing: dict[str, str] = {}
    while True:
        missing = {}
        for where, expr in checks:
            try:
                if not local.query(url, expr):
                    missing[f"{where}: {expr}"] = "no series"
            except ValueError as err:
                missing[f"{where}: {expr}"] = str(err)
        if not missing or time.monotonic() > end:
            return missing
        time.sleep(INTERVAL_S)


def test_every_dashboard_expression_has_series_on_a_plain_prometheus(live: tuple[ModuleType, Any]) -> None:
    local, cluster = live
    checks: list[tuple[str, str]] = []
    skipped = []
    for where, expr in dashboard_expressions():
        if any(name in expr for name in KUBERNETES_ONLY):
            skipped.append(where)
            continue
        checks.append((where, grafana(expr, local.JOB)))
    assert skipped == ["panel 'LMDB volume fill'"], skipped  # the one Kubernetes-only panel
    assert len(checks) >= 35
    missing = wait_for_series(cluster.prometheus_url, local, checks)
    assert not missing, json.dumps(missing, indent=1)
    # The variables as Grafana fills them here: no namespace label, the job, every node.
    assert local.query(cluster.prometheus_url, "count(prefixstore_members{namespace!=\"\"})") == []
    jobs = {s["metric"]["job"] for s in local.query(cluster.prometheus_url, "prefixstore_members")}
    assert jobs == {local.JOB}
    # Per-model hit rates: each model of each tenant its own series, state only for the hybrids.
    state = local.query(cluster.prometheus_url, grafana(
        'sum by (tenant, model) (rate(prefixstore_model_lookup_tokens_total{job=~"$job", kind="state"}[1m]))',
        local.JOB))
    assert {(s["metric"]["tenant"], s["metric"]["model"]) for s in state} == {("alpha", "demo-hybrid"),
                                                                               ("beta", "demo-hybrid")}


def test_every_alert_rule_loads_and_its_operands_have_series(live: tuple[ModuleType, Any]) -> None:
    local, cluster = live
    expected = rule_expressions(local)
    assert {where for where, _ in expected} == {
        "alert PrefixstoreStateHitRateCollapsed", "alert PrefixstoreEvictionStorm", "alert PrefixstoreNodeDown",
        "alert PrefixstoreMembershipIncomplete", "alert PrefixstoreChecksumFailures"}
    checks = [(where, operand) for where, expr in expected for operand in operands(expr)]
    assert len(checks) > len(expected)  # comparisons were split into their sides
    missing = wait_for_series(cluster.prometheus_url, local, checks)
    assert not missing, json.dumps(missing, indent=1)
    end = time.monotonic() + DEADLINE_S
    while True:
        loaded = {r["name"]: r for r in local.rules(cluster.prometheus_url)}
        healthy = {name: r for name, r in loaded.items() if r.get("health") == "ok" and not r.get("lastError")}
        if len(healthy) == len(expected) or time.monotonic() > end:
            break
        time.sleep(INTERVAL_S)
    assert set(loaded) == {where.split(" ", 1)[1] for where, _ in expected}
    assert healthy.keys() == loaded.keys(), {n: (r.get("health"), r.get("lastError")) for n, r in loaded.items()}
    # A healthy 3-node cluster: neither of the cluster alerts fires.
    firing = {r["name"] for r in loaded.values() if r.get("state") == "firing"}
    assert not firing & {"PrefixstoreNodeDown", "PrefixstoreMembershipIncomplete"}, firing


def test_the_check_catches_a_misspelt_metric_and_a_label_the_scrape_lacks(live: tuple[ModuleType, Any]) -> None:
    """What the checks above would report: a typo'd name, and the chart's Kubernetes selector (the
    namespace label a plain scrape lacks: what metrics.selector is for) have no series."""
    local, cluster = live
    assert local.query(cluster.prometheus_url, 'sum(rate(prefixstore_lookups_total{job="prefixstore"}[1m]))')
    for expr in ('sum(rate(prefixstore_lookup_token_total{job="prefixstore"}[1m]))',
                 'min(prefixstore_members{job="local-prefixstore", namespace="default"})'):
        assert local.query(cluster.prometheus_url, expr) == [], expr
