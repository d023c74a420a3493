"""Rendering the chart with real Helm (helm-python-sdk: Helm v4's library) and reading what it made.

``render(values)`` is ``helm template``: defaults merged with ``values``,
values.schema.json enforced, every template rendered offline.
``materialize`` plays the kubelet for the store container: it writes the
ConfigMap and Secret files where the StatefulSet mounts them (under a
temporary root), expands the container's environment, and returns the
config file path the container's args name, so a test can load exactly what
a pod would load.
"""

from __future__ import annotations

import base64
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "prefixstore"
RELEASE = "ps"
NAMESPACE = "cache"
FULLNAME = "ps-prefixstore"  # release "ps" + chart "prefixstore"

Manifest = dict[str, Any]

# Knobs of StoreConfig the chart sets itself; every other field is a key of .Values.config.
CHART_MANAGED = frozenset({"host", "node_url", "peers", "peers_dns", "data_dir", "tenants_file", "cluster_token_file",
                           "tls_cert_file", "tls_key_file", "tls_client_ca_file"})


@dataclass
class Rendered:
    files: dict[str, str]  # template path -> rendered text (NOTES.txt included)
    manifests: list[Manifest] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> Manifest:
        found = [m for m in self.of_kind(kind) if name is None or m["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, got {[m['metadata']['name'] for m in found]}"
        return found[0]

    @property
    def notes(self) -> str:
        return self.files[f"{CHART.name}/templates/NOTES.txt"]


# The chart requires image.repository (no registry carries the image: the operator pushes it); every
# render here names one unless a test says otherwise (``image_given=False``).
IMAGE = {"repository": "registry.example.com/prefixstore"}


def render(values: dict[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE,
           image_given: bool = True) -> Rendered:
    """Render the chart; raises helm.HelmValuesError (schema) or helm.HelmRenderError (a template's fail)."""
    values = dict(values or {})
    if image_given:
        values["image"] = {**IMAGE, **values.get("image", {})}
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=name, namespace=namespace, is_install=True)
    out = Rendered(files)
    for path, text in sorted(files.items()):
        if path.endswith((".yaml", ".yml")):
            out.manifests += [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def chart_values() -> dict[str, Any]:
    """The chart's default values (values.yaml as Helm reads it)."""
    with helm.Chart.load(CHART) as chart:
        return chart.values


def chart_schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def store_container(r: Rendered) -> Manifest:
    sts = r.one("StatefulSet")
    (container,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "prefixstore"]
    return container


def secret_data(secret: Manifest) -> dict[str, bytes]:
    out = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    out.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
    return out


@dataclass
class Pod:
    root: Path  # the container's "/" for mounted files
    config_file: Path  # the file its args pass to --config, under root
    env: dict[str, str]  # its environment, $(VAR) references expanded
    pod_name: str

    def path(self, in_pod: str) -> Path:
        return self.root / in_pod.lstrip("/")


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of env values (a reference to an unknown variable stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def materialize(r: Rendered, root: Path, external_secrets: dict[str, dict[str, bytes]] | None = None,
                ordinal: int = 0) -> Pod:
    """Lay out pod ``ordinal``'s mounted files under ``root`` as the kubelet would, from the rendered objects.

    Secrets the chart does not make (tls.secretName, auth.existingSecret) come from ``external_secrets``."""
    sts = r.one("StatefulSet")
    pod_spec = sts["spec"]["template"]["spec"]
    container = store_container(r)
    pod_name = f"{sts['metadata']['name']}-{ordinal}"
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    external = external_secrets or {}

    for mount in container.get("volumeMounts", []):
        target = root / mount["mountPath"].lstrip("/")
        if mount["name"] in claims:
            target.mkdir(parents=True, exist_ok=True)
            continue
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            continue
        if "configMap" in volume:
            cm = r.one("ConfigMap", volume["configMap"]["name"])
            data = {k: v.encode() for k, v in cm["data"].items()}
            items = volume["configMap"].get("items")
        elif "secret" in volume:
            secret_name = volume["secret"]["secretName"]
            made = [s for s in r.of_kind("Secret") if s["metadata"]["name"] == secret_name]
            data = secret_data(made[0]) if made else external[secret_name]
            items = volume["secret"].get("items")
        else:
            raise AssertionError(f"volume {mount['name']}: a kind this helper does not lay out: {volume}")
        files = {item["path"]: data[item["key"]] for item in items} if items else data
        if "subPath" in mount:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(files[mount["subPath"]])
        else:
            target.mkdir(parents=True, exist_ok=True)
            for rel, content in files.items():
                (target / rel).write_bytes(content)

    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = pod_name
        else:
            raise AssertionError(f"env {var['name']}: a source this helper does not resolve: {var}")
    args = container["args"]
    config_in_pod = args[args.index("--config") + 1]
    return Pod(root=root, config_file=root / config_in_pod.lstrip("/"), env=env, pod_name=pod_name)


def rooted_config(pod: Pod, out: Path) -> Path:
    """The pod's TOML with every absolute in-pod path moved under pod.root (so the files it names exist here)."""
    raw = tomllib.loads(pod.config_file.read_text())
    lines = []
    for key, value in raw.items():
        if isinstance(value, str) and value.startswith("/"):
            value = str(pod.path(value))
        lines.append(f"{key} = {json.dumps(value)}")
    out.write_text("\n".join(lines) + "\n")
    return out
