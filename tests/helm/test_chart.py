"""The Helm chart, rendered by real Helm and every manifest checked against the Kubernetes schemas.

kubernetes-validate carries the OpenAPI schemas of each Kubernetes release;
it is run in strict mode (unknown fields are errors) against the oldest
release the chart supports (Chart.yaml kubeVersion) and the newest it knows.
ServiceMonitor and PrometheusRule are prometheus-operator CRDs, which those
schemas do not cover: their structure is checked against CRD_SCHEMAS below
(the fields the chart uses, written from the operator's v1 API), and every
alert expression is parsed as PromQL (here) and checked against a live
store's metrics (test_promql.py).
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import promql_parser
import pytest

from .chart import CHART, FULLNAME, NAMESPACE, Manifest, Rendered, render, store_container

K8S_VERSIONS = ("1.25", kubernetes_validate.utils.latest_version())
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}

HEX_A, HEX_B, HEX_C = "a" * 64, "b" * 64, "c" * 64

# Non-default values: more nodes, TLS (mutual), tenants, monitoring on, larger resources.
FULL: dict[str, Any] = {
    "replicaCount": 5,
    "image": {"repository": "registry.example.com/prefixstore", "tag": "0.1.0-gpu"},
    "tls": {"enabled": True, "secretName": "ps-tls", "mutual": True},
    "auth": {"admin_token_sha256": HEX_A, "clusterToken": "cluster-token-0123456789abcdef",
             "tenants": {"team-a": {"token_sha256": HEX_B, "quota_bytes": "8GiB"}, "team-b": {"token_sha256": HEX_C}}},
    # Mutual TLS: Prometheus scrapes with a client certificate of the CA (the chart adds serverName and the CA).
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"},
                                   "tlsConfig": {"cert": {"secret": {"name": "scrape-tls", "key": "tls.crt"}},
                                                 "keySecret": {"name": "scrape-tls", "key": "tls.key"}}},
                "prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}},
    "resources": {"requests": {"cpu": "8", "memory": "40Gi"}, "limits": {"memory": "48Gi"}},
    "persistence": {"size": "240Gi", "storageClassName": "fast-ssd"},
    "config": {"ram_bytes": "32GiB", "disk_bytes": "160GiB", "eviction": "lru", "state_admission": "second-hit"},
    "podDisruptionBudget": {"maxUnavailable": "20%"},
}

_DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h|d|w|y))+$"}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "required": ["name", "namespace"],
         "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STR_MAP,
                        "annotations": _STR_MAP}}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
            "metadata": _META,
            "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
                     "properties": {
                         "selector": {"type": "object", "additionalProperties": False,
                                      "properties": {"matchLabels": _STR_MAP}},
                         "namespaceSelector": {"type": "object", "additionalProperties": False,
                                               "properties": {"matchNames": {"type": "array",
                                                                             "items": {"type": "string"}}}},
                         "endpoints": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "additionalProperties": False, "required": ["port"],
                             "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                            "scheme": {"enum": ["http", "https"]},
                                            "interval": _DURATION, "scrapeTimeout": _DURATION,
                                            "tlsConfig": {"type": "object"}}}}}}}},
    "PrometheusRule": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
            "metadata": _META,
            "spec": {"type": "object", "required": ["groups"], "additionalProperties": False, "properties": {
                "groups": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                    "properties": {"name": {"type": "string"}, "interval": _DURATION, "rules": {
                        "type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["alert", "expr"], "additionalProperties": False,
                            "properties": {"alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                                           "expr": {"type": "string", "minLength": 1}, "for": _DURATION,
                                           "labels": _STR_MAP, "annotations": _STR_MAP}}}}}}}}}},
}


def validate_all(r: Rendered, namespace: str = NAMESPACE) -> set[str]:
    """Validate every rendered manifest; returns the kinds seen. Fails on any manifest it cannot check."""
    kinds = set()
    for m in r.manifests:
        kinds.add(m["kind"])
        assert m["metadata"]["namespace"] == namespace, m["metadata"]
        if m["kind"] in CRD_KINDS:
            jsonschema.validate(m, CRD_SCHEMAS[m["kind"]])
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(m, version, strict=True)  # raises ValidationError / SchemaNotFoundError
    return kinds


def test_default_values_render_valid_manifests() -> None:
    r = render()
    assert validate_all(r) == {"StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceAccount"}
    assert not r.of_kind("Secret")  # no tenants: an open store, and NOTES says so
    assert "OPEN" in r.notes


def test_non_default_values_render_valid_manifests() -> None:
    r = render(FULL)
    assert validate_all(r) == {"StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceAccount",
                               "Secret", "ServiceMonitor", "PrometheusRule"}
    assert len(r.of_kind("ConfigMap")) == 2  # the store config and the Grafana dashboard
    sts = r.one("StatefulSet")
    assert sts["spec"]["replicas"] == 5
    c = store_container(r)
    assert c["image"] == "registry.example.com/prefixstore:0.1.0-gpu"
    assert c["resources"] == FULL["resources"]
    claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["resources"]["requests"]["storage"] == "240Gi" and claim["storageClassName"] == "fast-ssd"
    assert r.one("PodDisruptionBudget")["spec"]["maxUnavailable"] == "20%"
    sm = r.one("ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["scheme"] == "https"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for rule in r.one("PrometheusRule")["spec"]["groups"][0]["rules"]:
        promql_parser.parse(rule["expr"])  # raises on a syntax error
    assert "Bearer" in r.notes and "https://" in r.notes


def test_the_validator_rejects_a_broken_manifest() -> None:
    """The checks above are live: a field Kubernetes does not know fails strict validation."""
    sts = copy.deepcopy(render().one("StatefulSet"))
    sts["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pathh"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[0], strict=True)
    rule = copy.deepcopy(render(FULL).one("PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["fro"] = "5m"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, CRD_SCHEMAS["PrometheusRule"])


@pytest.mark.parametrize("values", [{}, FULL], ids=["default", "non-default"])
def test_helm_lint_passes(values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version="v1.25.0")
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); nothing at warning (2) or error (3).
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_statefulset_runs_the_store_as_a_cluster_member() -> None:
    r = render()
    sts = r.one("StatefulSet")
    spec = sts["spec"]
    pod = spec["template"]["spec"]
    c = store_container(r)
    headless = r.one("Service", f"{FULLNAME}-headless")
    client = r.one("Service", FULLNAME)
    # Stable pod DNS names: the StatefulSet is governed by the headless Service.
    assert spec["serviceName"] == headless["metadata"]["name"] and headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False
    assert client["spec"]["type"] == "ClusterIP" and client["spec"].get("clusterIP") != "None"
    for svc in (headless, client):
        assert svc["spec"]["selector"] == spec["selector"]["matchLabels"]
        assert svc["spec"]["ports"][0]["port"] == 8077 and svc["spec"]["ports"][0]["targetPort"] == "http"
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert r.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    # Node identity from the downward API.
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["PREFIXSTORE_NODE_URL"]["value"] == (
        f"http://$(POD_NAME).{FULLNAME}-headless.{NAMESPACE}.svc.cluster.local:8077")
    assert c["args"] == ["--config", "/etc/prefixstore/store.toml"]
    assert c["ports"] == [{"name": "http", "containerPort": 8077, "protocol": "TCP"}]
    # Liveness stays cheap; readiness and startup wait for LMDB, the arena and DNS membership.
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTP"}
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/readyz", "port": "http", "scheme": "HTTP"}
    # Non-root, read-only root filesystem, no privileges, no API token.
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    # Every writable path is a volume: the LMDB tier on the PVC, /tmp on an emptyDir.
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/var/lib/prefixstore"]["name"] == "data"
    assert spec["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert spec["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert mounts["/tmp"]["name"] == "tmp"
    assert c["resources"]["limits"]["memory"] == "2Gi"


def test_mutual_tls_probes_the_port_and_plain_tls_probes_https() -> None:
    c = store_container(render(FULL))  # mutual: the kubelet has no client certificate
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "http"} and "httpGet" not in c[probe]
    c = store_container(render({"tls": {"enabled": True, "secretName": "ps-tls"}}))
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTPS"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http", "scheme": "HTTPS"}
    assert {e["name"]: e.get("value") for e in c["env"]}["PREFIXSTORE_NODE_URL"].startswith("https://$(POD_NAME).")


def test_persistence_off_uses_an_empty_dir() -> None:
    r = render({"persistence": {"enabled": False}})
    validate_all(r)
    sts = r.one("StatefulSet")
    assert "volumeClaimTemplates" not in sts["spec"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}


def test_a_config_change_rolls_the_pods_and_nothing_else_does() -> None:
    def checksums(values: dict[str, Any]) -> dict[str, str]:
        annotations = render(values).one("StatefulSet")["spec"]["template"]["metadata"]["annotations"]
        return {k: v for k, v in annotations.items() if k.startswith("checksum/")}

    base = checksums({})
    assert checksums({}) == base  # deterministic
    assert checksums({"replicaCount": 7}) == base  # scaling does not restart nodes
    assert checksums({"config": {"ram_bytes": "1280MiB"}})["checksum/config"] != base["checksum/config"]
    with_tenant = checksums({"auth": {"tenants": {"t": {"token_sha256": HEX_B}}, "clusterToken": "c" * 32}})
    assert with_tenant["checksum/tenants"] != base["checksum/tenants"]


def test_existing_secret_names_its_cluster_token_key() -> None:
    r = render({"replicaCount": 3, "auth": {"existingSecret": "my-tenants", "existingSecretClusterTokenKey": "peer"}})
    volumes = {v["name"]: v for v in r.one("StatefulSet")["spec"]["template"]["spec"]["volumes"]}
    assert {"key": "peer", "path": "peer"} in volumes["tenants"]["secret"]["items"]
    assert 'cluster_token_file = "/etc/prefixstore/tenants/peer"' in r.one("ConfigMap")["data"]["store.toml"]


def test_existing_tenants_secret_is_mounted_and_none_is_made() -> None:
    r = render({"replicaCount": 1, "auth": {"existingSecret": "my-tenants", "existingSecretKey": "tenants.json"}})
    validate_all(r)
    assert not r.of_kind("Secret")
    volumes = {v["name"]: v for v in r.one("StatefulSet")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tenants"]["secret"] == {"secretName": "my-tenants",
                                            "items": [{"key": "tenants.json", "path": "tenants.json"}]}
    assert 'tenants_file = "/etc/prefixstore/tenants/tenants.json"' in r.one("ConfigMap")["data"]["store.toml"]


def test_long_release_names_keep_every_name_a_valid_dns_label() -> None:
    r = render(name="a-very-long-release-name-for-a-cache-cluster-in-production")
    validate_all(r)
    for m in r.manifests:
        assert len(m["metadata"]["name"]) <= 63, m["metadata"]["name"]
    sts = r.one("StatefulSet")["metadata"]["name"]
    assert len(sts) <= 52  # the controller-revision-hash label appends 11 characters to it


# Bad values: every one must stop the render (helm install/upgrade) before anything is applied.
BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"replicaCount": "3"}, "/replicaCount"),
    ({"replicaCount": 0}, "/replicaCount"),
    ({"replicas": 3}, "'replicas' not allowed"),  # a typo of replicaCount
    ({"config": {"ram_bytes": -1}}, "/config/ram_bytes"),
    ({"config": {"ram_bytes": "-4GiB"}}, "/config/ram_bytes"),
    ({"config": {"ram_bytes": "0GiB"}}, "/config/ram_bytes"),
    ({"config": {"disk_bytes": "lots"}}, "/config/disk_bytes"),
    ({"config": {"state_admission": "sometimes"}}, "/config/state_admission"),
    ({"config": {"kv_admission": "second_hit"}}, "/config/kv_admission"),
    ({"config": {"eviction": "random"}}, "/config/eviction"),
    ({"config": {"nixl": True}}, "/config/nixl"),
    ({"config": {"ram_bytez": "1GiB"}}, "'ram_bytez' not allowed"),  # unknown key in config
    ({"config": {"host": "10.0.0.1"}}, "'host' not allowed"),  # the chart owns host
    ({"config": {"lmdb_sync": "yes"}}, "/config/lmdb_sync"),
    ({"config": {"lease_ttl_s": 0}}, "/config/lease_ttl_s"),
    ({"config": {"max_items": 2.5}}, "/config/max_items"),
    ({"config": {"port": 70000}}, "/config/port"),
    ({"config": {"log_level": "LOUD"}}, "/config/log_level"),
    ({"auth": {"tenants": {"t": {"token_sha256": "not-a-digest"}}}}, "/auth/tenants/t/token_sha256"),
    ({"auth": {"tenants": {"t": {"token": "plaintext"}}}}, "/auth/tenants/t"),
    ({"auth": {"tenants": {"t": {"token_sha256": HEX_B, "quota_bytes": "-1GiB"}}}}, "/auth/tenants/t/quota_bytes"),
    ({"tls": {"enabled": True}}, "/tls/secretName"),  # no secretName
    ({"persistence": {"size": "ten gigs"}}, "/persistence/size"),
    ({"metrics": {"prometheusRule": {"stateHitCollapse": {"kvHitRateMin": 2}}}}, "kvHitRateMin"),
    ({"metrics": {"prometheusRule": {"evictionStorm": {"window": "5 minutes"}}}}, "window"),
]


@pytest.mark.parametrize(("values", "names"), BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_schema_rejects_bad_values(values: dict[str, Any], names: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render(values)
    assert names in str(err.value), str(err.value)


@pytest.mark.parametrize(("values", "names"), [
    ({"auth": {"admin_token_sha256": HEX_A}}, "auth.admin_token_sha256"),
    ({"tls": {"mutual": True, "secretName": "x"}}, "tls.mutual"),
    ({"replicaCount": 3, "auth": {"tenants": {"t": {"token_sha256": HEX_B}}}}, "auth.clusterToken"),
], ids=["admin-without-tenants", "mutual-without-tls", "tenants-replicating-without-cluster-token"])
def test_templates_refuse_inconsistent_values(values: dict[str, Any], names: str) -> None:
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert names in str(err.value)


def _manifest_names(r: Rendered) -> list[tuple[str, str]]:
    return sorted((m["kind"], m["metadata"]["name"]) for m in r.manifests)


def test_dashboard_configmap_ships_the_dashboard_file() -> None:
    r = render({"metrics": {"dashboard": {"enabled": True}}})
    cm: Manifest = r.one("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["prefixstore.json"] == (CHART / "dashboards" / "prefixstore.json").read_text().rstrip("\n")
    assert (("ConfigMap", f"{FULLNAME}-dashboard") not in _manifest_names(render()))


def test_notes_print_sizes_as_written_and_survive_missing_limits() -> None:
    notes = render({"config": {"ram_bytes": 34359738368}, "resources": {"limits": None}}).notes
    assert "RAM arena 34359738368 bytes per node (memory limit none)" in notes  # not 3.4359738368e+10
    notes = render().notes
    assert "RAM arena 1GiB per node (memory limit 2Gi)" in notes
    assert f"http://{FULLNAME}.{NAMESPACE}.svc.cluster.local:8077" in notes


def test_packaged_chart_ships_the_dashboard_but_not_its_builder(tmp_path: Path) -> None:
    import tarfile

    archive = helm.package(CHART, destination=tmp_path)
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert "prefixstore/dashboards/prefixstore.json" in names
    assert "prefixstore/values.schema.json" in names
    assert not any(n.endswith(".py") for n in names), names


def test_values_schema_is_a_valid_draft7_schema_that_accepts_the_defaults() -> None:
    import json

    import yaml

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)  # Helm 3's validators speak draft-07 too
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))


def test_notes_give_engines_every_replica_as_a_seed_and_say_quotas_hold_per_node() -> None:
    """A cluster client needs the nodes, not the load-balanced Service (a node of several answers a
    raw /v1/lookup 409): NOTES lists every pod's stable name under the headless Service."""
    for count in (3, 5):
        notes = render({"replicaCount": count, "config": {"replicas": 2}}).notes
        seeds = re.findall(r'"(http://[^"]+)",', notes)
        assert seeds == [f"http://{FULLNAME}-{i}.{FULLNAME}-headless.{NAMESPACE}.svc.cluster.local:8077"
                         for i in range(count)]
        assert "ClientConfig(urls=(" in notes and "replicas=2" in notes
        assert "409" in notes and "do not point engines at the load-balanced Service" in notes
    notes = render({"replicaCount": 3, "auth": {"tenants": {"alpha": {"token_sha256": "a" * 64, "quota_bytes": "1GiB"}},
                                                "clusterToken": "0123456789abcdef0123"}}).notes
    assert "token=<the tenant's token>" in notes
    assert "Quotas hold PER NODE" in notes and "3 x quota_bytes across the cluster" in notes
    assert "PER NODE" in (CHART / "values.yaml").read_text()


def test_replicas_reach_the_store_config_and_the_schema_refuses_less_than_one() -> None:
    text = render({"config": {"replicas": 3}}).one("ConfigMap")["data"]["store.toml"]
    assert tomllib.loads(text)["replicas"] == 3
    assert tomllib.loads(render().one("ConfigMap")["data"]["store.toml"])["replicas"] == 1
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(helm.HelmValuesError, match="replicas"):
            render({"config": {"replicas": bad}})
