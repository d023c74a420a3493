"""Writes prefixstore.json, the chart's Grafana dashboard, next to this file.

    python helm/prefixstore/dashboards/build.py

The JSON is what ships (the chart's dashboard ConfigMap reads it, Grafana
imports it); this script is its source, so panels stay uniform and every
query uses the same selector. tests/helm checks that the JSON is this
script's output and that every query names only series a live store exports.
Not packaged with the chart (.helmignore).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("prefixstore.json")

# Every query is scoped by the dashboard's variables (one release, chosen nodes), with regex
# matchers so that one dashboard serves two scrapes: on Kubernetes (the ServiceMonitor) series carry
# `namespace` and `job`; a plain Prometheus scraping the nodes itself (docs/operations.md, "Without
# Kubernetes") gives them only its `job`. There the namespace variable finds no value and stays at
# All, whose ".*" also matches a series without the label.
SEL = 'namespace=~"$namespace", job=~"$job", instance=~"$instance"'
RATE = "$__rate_interval"
# The kubelet's volume series carry the PVC's namespace and name, not the store's job: the
# StatefulSet's claims are data-<statefulset>-<ordinal>, and the StatefulSet is named as the job.
# Kubernetes only: without a kubelet the panel is empty.
PVC = 'namespace=~"$namespace", persistentvolumeclaim=~"data-$job-[0-9]+"'

Panel = dict[str, Any]


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": expr,
            "legendFormat": legend, "refId": ref, "range": True}


def timeseries(title: str, description: str, targets: list[tuple[str, str]], unit: str, *,
               w: int = 8, stack: bool = False, max_value: float | None = None) -> Panel:
    defaults: dict[str, Any] = {"unit": unit, "min": 0,
                                "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
                                           "stacking": {"mode": "normal" if stack else "none", "group": "A"},
                                           "showPoints": "never", "spanNulls": False}}
    if max_value is not None:
        defaults["max"] = max_value
    return {"type": "timeseries", "title": title, "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"w": w, "h": 8},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(targets)]}


def stat(title: str, description: str, expr: str, unit: str, *, w: int = 4) -> Panel:
    return {"type": "stat", "title": title, "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"w": w, "h": 8},
            "fieldConfig": {"defaults": {"unit": unit, "min": 0, "max": 1, "decimals": 1,
                                         "thresholds": {"mode": "absolute", "steps": [
                                             {"color": "red", "value": None}, {"color": "orange", "value": 0.2},
                                             {"color": "green", "value": 0.5}]}},
                            "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "none", "textMode": "auto"},
            "targets": [target(expr, title, "A")]}


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"w": 24, "h": 1}, "panels": []}


def hit_rate(kind: str, window: str) -> str:
    return (f'sum(rate(prefixstore_lookup_tokens_total{{{SEL}, kind="{kind}", result="hit"}}[{window}]))\n'
            f'/ sum(rate(prefixstore_lookup_tokens_total{{{SEL}, kind="{kind}"}}[{window}]))')


def model_hit_rate(kind: str) -> str:
    """Per (tenant, model) token hit rate (store/model_metrics.py); state only for hybrid models."""
    by = "sum by (tenant, model)"
    return (f'{by} (rate(prefixstore_model_lookup_tokens_total{{{SEL}, kind="{kind}", result="hit"}}[{RATE}]))\n'
            f'/ {by} (rate(prefixstore_model_lookup_tokens_total{{{SEL}, kind="{kind}"}}[{RATE}]))')


def panels() -> list[Panel]:
    out: list[Panel] = [
        row("Hit rates"),
        timeseries(
            "Token hit rate: KV vs state",
            "Share of looked-up prompt tokens whose KV is stored (KV) and that can be reused exactly, KV and "
            "recurrent state (state). A healthy KV rate with a collapsed state rate is the signature of a bad "
            "retention policy: snapshots are not taken, or not kept, where prompts are resumed.",
            [(hit_rate("kv", RATE), "KV"), (hit_rate("state", RATE), "state (exact reuse)")],
            "percentunit", w=12, max_value=1),
        stat("KV hit rate (range)", "KV token hit rate over the dashboard's time range.",
             hit_rate("kv", "$__range"), "percentunit"),
        stat("State hit rate (range)", "State (exact reuse) token hit rate over the dashboard's time range.",
             hit_rate("state", "$__range"), "percentunit"),
        timeseries("Lookups", "Lookups answered per second, all nodes.",
                   [(f"sum(rate(prefixstore_lookups_total{{{SEL}}}[{RATE}]))", "lookups")], "reqps", w=4),
        timeseries("Prefill FLOPs saved", "Prefill FLOPs per second of the prompt tokens lookups found exactly "
                   "reusable (KV and state on hybrid models, KV on plain ones), by the FLOP model of each "
                   "namespace's model (admission/model_shape.py): the compute the cache offered to save. An "
                   "engine that does not load what it found saves less.",
                   [(f"sum(rate(prefixstore_prefill_flops_saved_total{{{SEL}}}[{RATE}]))", "FLOP/s saved")],
                   "short", w=6),
        timeseries("KV hit rate by model", "KV token hit rate of each model (a namespace's model id) of each "
                   "tenant. A tenant's models beyond config.model_metrics_per_tenant count together as (other).",
                   [(model_hit_rate("kv"), "{{tenant}} / {{model}}")], "percentunit", w=12, max_value=1),
        timeseries("State hit rate by model", "State (exact reuse) token hit rate of each hybrid model: the one "
                   "whose state rate collapses while its KV rate (left) stays healthy is the one whose "
                   "snapshots are not taken or not kept where its prompts resume (PrefixstoreStateHitRateCollapsed "
                   "names it).", [(model_hit_rate("state"), "{{tenant}} / {{model}}")], "percentunit", w=12,
                   max_value=1),
        row("Occupancy"),
        timeseries("Stored bytes by kind and tier", "Payload bytes held: KV blocks and tails (kv) and state "
                   "snapshots (state), in the RAM arena and the LMDB tier.",
                   [(f"sum by (kind, tier) (prefixstore_stored_bytes{{{SEL}}})", "{{kind}} {{tier}}")],
                   "bytes", stack=True),
        timeseries("Entries by kind and tier", "Entries held, by kind and tier.",
                   [(f"sum by (kind, tier) (prefixstore_entries{{{SEL}}})", "{{kind}} {{tier}}")],
                   "short", stack=True),
        timeseries("RAM arena used", "Share of each node's RAM arena (ram_bytes) holding payloads or reserved "
                   "for puts.",
                   [(f"1 - prefixstore_arena_free_bytes{{{SEL}}} / prefixstore_arena_capacity_bytes{{{SEL}}}",
                     "{{instance}}")], "percentunit", max_value=1),
        timeseries("Bytes per tenant", "Bytes charged to each tenant (entries, pending puts, namespace "
                   "records), summed over the nodes, and each tenant's quota_bytes on its fullest node: a quota "
                   "holds per node, so a tenant at quota on one node is refused there while others have room.",
                   [(f"sum by (tenant) (prefixstore_tenant_stored_bytes{{{SEL}}})", "{{tenant}} held"),
                    (f"max by (tenant) (prefixstore_tenant_stored_bytes{{{SEL}}})", "{{tenant}} fullest node"),
                    (f"max by (tenant) (prefixstore_tenant_quota_bytes{{{SEL}}})", "{{tenant}} quota per node")],
                   "bytes"),
        row("Node resources"),
        timeseries("Resident memory vs RAM arena", "Each node's resident set (RSS, process collector) and its "
                   "arena (ram_bytes, resident from start). RSS minus the arena is what memoryHeadroom must "
                   "cover; a pod whose RSS nears resources.limits.memory is about to be OOM-killed.",
                   [(f"process_resident_memory_bytes{{{SEL}}}", "RSS {{instance}}"),
                    (f"prefixstore_arena_capacity_bytes{{{SEL}}}", "arena {{instance}}")], "bytes"),
        timeseries("LMDB volume fill", "Share of each node's LMDB volume (PVC data-<pod>) in use, from the "
                   "kubelet's volume stats (needs the kubelet scraped, as kube-prometheus-stack does). The "
                   "store keeps payloads within disk_bytes; the file grows past them by LMDB's own pages.",
                   [(f'kubelet_volume_stats_used_bytes{{{PVC}}}\n/ kubelet_volume_stats_capacity_bytes{{{PVC}}}',
                     "{{persistentvolumeclaim}}")], "percentunit", max_value=1),
        timeseries("LMDB payload bytes per node", "Payload bytes held in the LMDB tier, by node (compare with "
                   "config.disk_bytes, the budget eviction keeps them under).",
                   [(f'sum by (instance) (prefixstore_stored_bytes{{{SEL}, tier="disk"}})', "{{instance}}")],
                   "bytes"),
        timeseries("Open file descriptors", "File descriptors each node holds, as a share of its limit "
                   "(connections, LMDB, the NIXL agent). Near 1, new connections fail.",
                   [(f"process_open_fds{{{SEL}}} / process_max_fds{{{SEL}}}", "{{instance}}")], "percentunit",
                   max_value=1),
        row("Admission and eviction"),
        timeseries("Admission decisions", "Offer and put answers per second, by kind and decision "
                   "(want, have, rejected). Many rejected state offers: state_admission is holding snapshots "
                   "back until their second sighting.",
                   [(f"sum by (kind, decision) (rate(prefixstore_admission_total{{{SEL}}}[{RATE}]))",
                     "{{kind}} {{decision}}")], "ops"),
        timeseries("Evictions", "Entries leaving a tier per second, by kind and reason (demoted: RAM to disk; "
                   "capacity: deleted; corrupt; expired: uncommitted put).",
                   [(f"sum by (kind, reason) (rate(prefixstore_evictions_total{{{SEL}}}[{RATE}]))",
                     "{{kind}} {{reason}}")], "ops"),
        timeseries("Leases, pending puts, quota rejections", "Leases held, entries put but not committed, and "
                   "items refused because their tenant is at quota_bytes.",
                   [(f"sum(prefixstore_leases{{{SEL}}})", "leases"),
                    (f"sum(prefixstore_pending_entries{{{SEL}}})", "pending entries"),
                    (f"sum by (tenant) (rate(prefixstore_quota_rejections_total{{{SEL}}}[{RATE}]))",
                     "quota rejections/s {{tenant}}")], "short"),
        row("Cluster and replication"),
        timeseries("Nodes up and members seen", "Nodes answering their scrape, and the fewest and most "
                   "members any node sees in its DNS membership. They should all equal replicaCount.",
                   [(f"count(up{{{SEL}}} == 1)", "nodes up"),
                    (f"min(prefixstore_members{{{SEL}}})", "members seen (min)"),
                    (f"max(prefixstore_members{{{SEL}}})", "members seen (max)")], "short"),
        timeseries("Replicas held", "Entries held as replicas of another node's hot keys, by kind.",
                   [(f"sum by (kind) (prefixstore_replicas{{{SEL}}})", "{{kind}}")], "short"),
        timeseries("Replication", "Entries pushed to replica nodes per second by result, and the bytes pushed "
                   "(capped per node by replication_bytes_per_s).",
                   [(f"sum by (result) (rate(prefixstore_replication_pushes_total{{{SEL}}}[{RATE}]))",
                     "pushes {{result}}"),
                    (f"sum(rate(prefixstore_replication_bytes_total{{{SEL}}}[{RATE}]))", "bytes/s")], "short"),
        row("Data path"),
        timeseries("Transfer bandwidth by path", "Payload bytes per second, by path (http, nixl) and direction "
                   "(in: puts, out: gets).",
                   [(f"sum by (path, direction) (rate(prefixstore_transfer_bytes_total{{{SEL}}}[{RATE}]))",
                     "{{path}} {{direction}}")], "Bps", stack=True),
        timeseries("Nodes serving each data path", "How many nodes serve each path (nixl needs the gpu image).",
                   [(f"sum by (path) (prefixstore_data_path{{{SEL}}})", "{{path}}")], "short"),
        timeseries("Connections", "Client connections open (control channels among them), and connections "
                   "refused at max_connections.",
                   [(f"sum(prefixstore_connections{{{SEL}}})", "open"),
                    (f"sum(prefixstore_control_channels{{{SEL}}})", "control channels"),
                    (f"sum(rate(prefixstore_connections_refused_total{{{SEL}}}[{RATE}]))", "refused/s")], "short"),
        row("Latency and errors"),
    ]
    latency = [(f"histogram_quantile({q}, sum by (le, endpoint) "
                f"(rate(prefixstore_request_duration_seconds_bucket{{{SEL}}}[{RATE}])))", f"p{label} {{{{endpoint}}}}")
               for q, label in (("0.5", "50"), ("0.9", "90"), ("0.99", "99"))]
    out += [
        timeseries("Request latency by endpoint", "Server-side latency percentiles by endpoint, all nodes.",
                   latency, "s", w=12),
        timeseries("Requests by endpoint and status", "HTTP requests per second by endpoint and status class.",
                   [(f"sum by (endpoint, status) (rate(prefixstore_requests_total{{{SEL}}}[{RATE}]))",
                     "{{endpoint}} {{status}}")], "reqps", w=6),
        timeseries("Checksum and auth failures", "Payloads whose checksum did not verify (served as misses and "
                   "deleted), by where they were read; requests refused for a bad token (401).",
                   [(f"sum by (tier) (rate(prefixstore_checksum_failures_total{{{SEL}}}[{RATE}]))",
                     "checksum {{tier}}"),
                    (f"sum(rate(prefixstore_auth_failures_total{{{SEL}}}[{RATE}]))", "auth 401")], "ops", w=6),
    ]
    return layout(out)


def layout(items: list[Panel]) -> list[Panel]:
    """Ids and grid positions: rows span the width, panels flow left to right and wrap."""
    x = y = height = 0
    for i, p in enumerate(items, start=1):
        p["id"] = i
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if p["type"] == "row" or x + w > 24:  # start a new line
            x, y, height = 0, y + height, 0
        p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        x, height = x + w, max(height, h)
    return items


def variable(name: str, label: str, query: str, *, multi: bool = False, all_option: bool = False) -> dict[str, Any]:
    """A query variable; with an All option (``multi`` or ``all_option``), All is ".*" and the default."""
    with_all = multi or all_option
    return {"name": name, "label": label, "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": f"{name}-query"}, "definition": query,
            "refresh": 2, "sort": 1, "multi": multi, "includeAll": with_all,
            **({"allValue": ".*", "current": {"text": "All", "value": "$__all"}} if with_all else {"current": {}}),
            "options": [], "hide": 0}


def dashboard() -> dict[str, Any]:
    return {
        "title": "prefixstore",
        "uid": "prefixstore",
        "description": "prefixstore cluster: hit rates (KV vs state), occupancy, node memory and disk, admission, "
                       "evictions, replication, data path bandwidth, latency. docs/operations.md explains each panel "
                       "and alert.",
        "tags": ["prefixstore", "llm", "kv-cache"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "options": []},
            # Empty on a plain Prometheus (no namespace label): All, ".*", matches its series.
            variable("namespace", "Namespace", "label_values(prefixstore_members, namespace)", all_option=True),
            variable("job", "Release (scrape job)", 'label_values(prefixstore_members{namespace=~"$namespace"}, job)'),
            variable("instance", "Node", 'label_values(prefixstore_members{namespace=~"$namespace", job=~"$job"}, '
                     "instance)", multi=True),
        ]},
        "annotations": {"list": []},
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
