"""The chart's values map one-to-one onto StoreConfig, and what a pod loads is what the values say.

The rendered ConfigMap and Secrets are laid out where the StatefulSet mounts
them (tests/helm/chart.py plays the kubelet) and loaded with
StoreConfig.from_sources, the way `prefixstore serve --config` does, with
the pod's environment: every conversion and start-up check of the store runs
on them (sizes, policy names, the tenants file, the TLS certificate).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import pytest

from prefixstore.admission import ADMISSION_POLICIES, EVICTION_POLICIES
from prefixstore.store.config import LOG_LEVELS, StoreConfig, _convert
from prefixstore.store.tenants import load_tenants

from ..security.helpers import make_pki
from .chart import (CHART_MANAGED, FULLNAME, NAMESPACE, Pod, chart_schema, chart_values, materialize, render,
                    rooted_config)

FIELDS = {f.name: f for f in dataclasses.fields(StoreConfig)}
# Values whose chart default deliberately differs from StoreConfig's (sized for a cluster node).
CHART_DEFAULTS_DIFFER = {"ram_bytes", "disk_bytes"}
POD_DOMAIN = f"{FULLNAME}-headless.{NAMESPACE}.svc.cluster.local"


def load_pod_config(pod: Pod, tmp_path: Path) -> StoreConfig:
    return StoreConfig.from_sources(env=pod.env, config_file=rooted_config(pod, tmp_path / "rooted.toml"))


def test_default_configmap_loads_into_store_config(tmp_path: Path) -> None:
    r = render()
    pod = materialize(r, tmp_path / "pod", ordinal=2)
    config = load_pod_config(pod, tmp_path)
    defaults = chart_values()["config"]
    assert config.host == "0.0.0.0"
    assert config.port == 8077
    assert config.ram_bytes == 1 << 30 and config.disk_bytes == 8 << 30 and config.page_bytes == 64 << 10
    assert config.node_url == f"http://{FULLNAME}-2.{POD_DOMAIN}:8077"
    assert config.peers_dns == f"{POD_DOMAIN}:8077" and config.peers == ""
    assert config.lmdb_path == pod.path("/var/lib/prefixstore/lmdb")
    assert config.lmdb_path.parent.is_dir()  # on the data volume
    assert (config.tenants_file, config.tls_cert_file) == ("", "")
    for name, value in defaults.items():
        assert getattr(config, name) == _convert(StoreConfig, name, value), name


def test_non_default_values_reach_the_store(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    values: dict[str, Any] = {
        "config": {"port": 9100, "ram_bytes": "32GiB", "disk_bytes": 214748364800, "page_bytes": "128KiB",
                   "lmdb_sync": True, "lease_ttl_s": 12.5, "state_admission": "second-hit", "eviction": "lru",
                   "max_items": 8192, "replication_threshold": 7.5, "replication_max_replicas": 2,
                   "nixl": "off", "log_level": "debug", "owner_grace_s": 600},
        # Sized for that config (the chart refuses a 32GiB arena under its default 2Gi limit).
        "resources": {"requests": {"memory": "33Gi"}, "limits": {"memory": "34Gi"}},
        "persistence": {"size": "300Gi"},
        "tls": {"enabled": True, "secretName": "ps-tls", "mutual": True},
        "auth": {"admin_token_sha256": "a" * 64, "clusterToken": "cluster-token-0123456789abcdef",
                 "tenants": {"team-a": {"token_sha256": "b" * 64, "quota_bytes": "8GiB"},
                             "team.b": {"token_sha256": "c" * 64}}},
    }
    tls_secret = {"tls.crt": pki.server_cert.read_bytes(), "tls.key": pki.server_key.read_bytes(),
                  "ca.crt": pki.ca.read_bytes()}
    pod = materialize(render(values), tmp_path / "pod", external_secrets={"ps-tls": tls_secret})
    config = load_pod_config(pod, tmp_path)
    assert (config.port, config.ram_bytes, config.disk_bytes, config.page_bytes) == (
        9100, 32 << 30, 200 << 30, 128 << 10)
    assert config.lmdb_sync is True and config.lease_ttl_s == 12.5 and config.max_items == 8192
    assert (config.state_admission, config.eviction, config.nixl, config.log_level) == (
        "second-hit", "lru", "off", "debug")
    assert (config.replication_threshold, config.replication_max_replicas, config.owner_grace_s) == (7.5, 2, 600.0)
    assert config.node_url == f"https://{FULLNAME}-0.{POD_DOMAIN}:9100"
    assert config.peers_dns == f"{POD_DOMAIN}:9100"
    # TLS: the mounted certificate loads (StoreConfig built the server context at construction).
    assert config.ssl_context() is not None
    assert Path(config.tls_client_ca_file).read_bytes() == pki.ca.read_bytes()
    # Tenants: the Secret's file is the store's tenants file; digests, never tokens.
    tenants = load_tenants(config.tenants_file)
    assert {t.name: t.quota_bytes for t in tenants.tenants} == {"team-a": 8 << 30, "team.b": None}
    assert tenants.admin_token_sha256 == bytes.fromhex("a" * 64)
    # The cluster token: mounted in plain text for this node to present, its digest in the tenants file.
    assert config.cluster_token() == "cluster-token-0123456789abcdef"
    assert tenants.is_peer("cluster-token-0123456789abcdef") and not tenants.is_peer("team-a")


def test_tenants_secret_authenticates_the_tokens_it_was_made_for(tmp_path: Path) -> None:
    from prefixstore.store.tenants import token_sha256

    values = {"auth": {"tenants": {"alpha": {"token_sha256": token_sha256("tok-alpha-0123456789abcdef")}},
                       "clusterToken": "cluster-token-0123456789abcdef"}}
    pod = materialize(render(values), tmp_path / "pod")
    tenants = load_tenants(load_pod_config(pod, tmp_path).tenants_file)
    alpha = tenants.authenticate("tok-alpha-0123456789abcdef")
    assert alpha is not None and alpha.name == "alpha"
    assert tenants.authenticate("tok-wrong") is None


def test_store_config_fields_are_exactly_the_chart_config_plus_what_the_chart_sets() -> None:
    """No drift: a new StoreConfig field must be added to values.yaml and the schema (or to CHART_MANAGED)."""
    values = set(chart_values()["config"])
    schema = chart_schema()["properties"]["config"]
    assert values.isdisjoint(CHART_MANAGED)
    assert values | CHART_MANAGED == set(FIELDS)
    assert set(schema["properties"]) == values
    assert set(schema["required"]) == values
    assert schema["additionalProperties"] is False


def test_rendered_toml_names_every_field_but_the_per_pod_and_unused_ones() -> None:
    text = render().one("ConfigMap")["data"]["store.toml"]
    keys = set(tomllib.loads(text))
    assert keys <= set(FIELDS)
    # node_url comes from the pod's environment, peers (a static list) is unused, and without
    # tenants or TLS their files are unset.
    assert set(FIELDS) - keys == {"node_url", "peers", "tenants_file", "cluster_token_file", "tls_cert_file",
                                  "tls_key_file", "tls_client_ca_file"}


def test_chart_defaults_are_store_config_defaults() -> None:
    for name, value in chart_values()["config"].items():
        if name in CHART_DEFAULTS_DIFFER:
            continue
        assert _convert(StoreConfig, name, value) == FIELDS[name].default, name


def _schema_type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[1]
    return str(prop["type"])


SIZES_THAT_MAY_BE_ZERO = {"heap_keep_bytes"}  # 0 turns it off (store/config.py)


def test_schema_types_follow_the_fields() -> None:
    props = chart_schema()["properties"]["config"]["properties"]
    for name, prop in props.items():
        f = FIELDS[name]
        default = f.default
        if f.metadata.get("kind") == "size":
            expected = {"quota"} if name in SIZES_THAT_MAY_BE_ZERO else {"size"}
        elif isinstance(default, bool):
            expected = {"boolean"}
        elif isinstance(default, int):
            expected = {"integer", "count"}
        elif isinstance(default, float):
            expected = {"number", "seconds"}
        else:
            expected = {"string"}
        assert _schema_type(prop) in expected, (name, prop)


def test_schema_policy_names_are_the_registries() -> None:
    props = chart_schema()["properties"]["config"]["properties"]
    assert sorted(props["kv_admission"]["enum"]) == sorted(ADMISSION_POLICIES)
    assert sorted(props["state_admission"]["enum"]) == sorted(ADMISSION_POLICIES)
    assert sorted(props["eviction"]["enum"]) == sorted(EVICTION_POLICIES)
    assert set(LOG_LEVELS) <= set(props["log_level"]["enum"])
    # Every name the schema lets through, the store accepts.
    for knob in ("kv_admission", "state_admission", "eviction", "nixl", "log_level"):
        for value in props[knob]["enum"]:
            StoreConfig(**{knob: value})


@pytest.mark.parametrize("size", ["64KiB", "4GiB", "1.5GB", "0.5GiB", "512mib", "100 MiB", "65536", 65536])
def test_sizes_the_schema_accepts_parse_as_positive_sizes(size: object) -> None:
    render({"config": {"max_get_bytes": size}})  # the schema accepts it (a knob that allocates nothing at start)
    assert _convert(StoreConfig, "max_get_bytes", size) > 0  # and the store reads it


def test_the_example_values_in_docs_operations_deploy(tmp_path: Path) -> None:
    """docs/operations.md's production values file renders, validates and loads (so the docs cannot rot)."""
    import re

    import yaml

    from .chart import ROOT
    from .test_chart import validate_all

    text = (ROOT / "docs" / "operations.md").read_text()
    block = re.search(r"A production values file.*?```yaml\n(.*?)```", text, re.S)
    assert block, "docs/operations.md lost its example values file"
    values = yaml.safe_load(block.group(1))
    r = render(values, name="cache", namespace="llm")
    validate_all(r, namespace="llm")
    pki = make_pki(tmp_path)
    secret = {"tls.crt": pki.server_cert.read_bytes(), "tls.key": pki.server_key.read_bytes()}
    pod = materialize(r, tmp_path / "pod", external_secrets={values["tls"]["secretName"]: secret})
    config = load_pod_config(pod, tmp_path)
    assert config.ram_bytes == 48 << 30 and config.node_url.startswith("https://cache-prefixstore-0.")
    tenants = load_tenants(config.tenants_file)
    assert tenants.authenticate("example-chat-token-change-me") is not None
    assert tenants.is_admin("example-admin-token-change-me")
    # The engines' seed list the page shows is the one NOTES prints for these values.
    seeds = re.search(r"ClientConfig\(urls=\((.*?)\), token=", text, re.S)
    assert seeds, "docs/operations.md lost its seed list"
    listed = re.findall(r'"(https?://[^"]+)"', seeds.group(1))
    assert listed == re.findall(r'"(https?://[^"]+)",', r.notes) and len(listed) == values["replicaCount"]
