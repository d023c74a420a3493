"""Values that make valid manifests but a pod that cannot work are refused at render time
(templates/validate.yaml, the ServiceMonitor's tlsConfig), naming the values to change."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
import yaml

from .chart import FULLNAME, NAMESPACE, ROOT, render
from .test_chart import validate_all

PROD = ROOT / "helm" / "examples" / "prod.yaml"


@pytest.mark.parametrize(("values", "message"), [
    # The arena is resident from start: 8GiB under the default 2Gi limit is an OOM kill at every start.
    ({"config": {"ram_bytes": "8GiB"}},
     "resources.limits.memory 2Gi is below config.ram_bytes 8GiB + config.sighting_filter_bytes 1MiB "
     "+ memoryHeadroom 512Mi"),
    ({"config": {"ram_bytes": "2GiB"}}, "resources.limits.memory 2Gi is below config.ram_bytes 2GiB"),
    ({"memoryHeadroom": "1Gi"}, "+ memoryHeadroom 1Gi"),
    ({"config": {"sighting_filter_bytes": "600MiB"}}, "config.sighting_filter_bytes 600MiB"),
    ({"config": {"ram_bytes": 1610612736}}, "config.ram_bytes 1610612736 bytes"),  # an integer, as written
    # Decimal units are decimal: 1.5GB + 1MiB + 512Mi is above 2G (2e9 bytes).
    ({"config": {"ram_bytes": "1.5GB"}, "resources": {"limits": {"memory": "2G"}}}, "resources.limits.memory 2G"),
    ({"resources": {"limits": {"memory": "1500m"}}}, 'resources.limits.memory: "1500m" is not a quantity'),
    ({"config": {"disk_bytes": "100GiB"}}, "config.disk_bytes 100GiB needs persistence.size of at least 1.5 x it (153600Mi), got 12Gi"),
    ({"config": {"disk_bytes": "9GB"}}, "config.disk_bytes 9GB needs persistence.size of at least 1.5 x it (12875Mi), got 12Gi"),  # 13.5e9 > 12 * 2**30
    ({"tls": {"enabled": True, "secretName": "ps-tls", "mutual": True}, "metrics": {"serviceMonitor": {"enabled": True}}},
     "metrics.serviceMonitor.tlsConfig: tls.mutual"),
], ids=["ram-8GiB-under-2Gi", "ram-equal-to-limit", "headroom", "sighting-filter", "ram-integer", "decimal-units",
        "unreadable-limit", "disk-100GiB-on-12Gi", "disk-decimal", "mutual-tls-scrape-without-client-cert"])
def test_render_is_refused_naming_the_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as err:
        render(values)
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize("values", [
    {},  # the defaults are consistent: 1GiB arena under 2Gi, 8GiB of payloads on 12Gi
    {"config": {"ram_bytes": "1535MiB"}},  # 1535MiB + 1MiB + 512Mi = exactly 2Gi
    {"config": {"ram_bytes": "1.4GB"}, "resources": {"limits": {"memory": "2G"}}},
    {"config": {"ram_bytes": "8GiB"}, "resources": {"limits": {"memory": 9663676416}}},  # 9Gi as an integer
    {"config": {"ram_bytes": "64GiB"}, "resources": {"limits": None}},  # no limit: nothing to check against
    {"config": {"disk_bytes": "8GiB"}},  # 1.5 x 8GiB: exactly the volume
    {"config": {"disk_bytes": "1TiB"}, "persistence": {"enabled": False}},  # an emptyDir has no size here
], ids=["defaults", "ram-at-the-limit", "decimal-units", "integer-limit", "no-limit", "disk-at-the-volume",
        "no-volume"])
def test_consistent_values_render(values: dict[str, Any]) -> None:
    validate_all(render(values))


def _scrape_endpoint(values: dict[str, Any]) -> dict[str, Any]:
    (endpoint,) = render(values).one("ServiceMonitor")["spec"]["endpoints"]
    return endpoint


def test_https_scrapes_trust_the_store_certificate_by_its_service_name() -> None:
    tls = {"tls": {"enabled": True, "secretName": "ps-tls"}}
    endpoint = _scrape_endpoint({**tls, "metrics": {"serviceMonitor": {"enabled": True}}})
    assert endpoint["scheme"] == "https"
    # Prometheus dials pod IPs; the certificate names the Service: verify against that name and the CA.
    assert endpoint["tlsConfig"] == {"serverName": f"{FULLNAME}.{NAMESPACE}.svc",
                                     "ca": {"secret": {"name": "ps-tls", "key": "ca.crt"}}}
    given = {"serverName": "store.example", "ca": {"configMap": {"name": "ca", "key": "ca.pem"}}}
    endpoint = _scrape_endpoint({**tls, "metrics": {"serviceMonitor": {"enabled": True, "tlsConfig": given}}})
    assert endpoint["tlsConfig"] == given  # what the operator gave wins, nothing added beside a given CA
    plain = _scrape_endpoint({"metrics": {"serviceMonitor": {"enabled": True}}})
    assert plain["scheme"] == "http" and "tlsConfig" not in plain


def _operations_prod_block() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    m = re.search(r"A production values file \(`helm/examples/prod.yaml`\):\n\n```yaml\n(.*?)```", text, re.S)
    assert m, "docs/operations.md: the production values block is gone"
    return m.group(1)


def test_the_production_example_scrapes_https_trusting_its_certificate() -> None:
    """docs/operations.md shows helm/examples/prod.yaml verbatim (test_config.py deploys it); with TLS on,
    its ServiceMonitor scrapes https and verifies the certificate against the Service name it carries."""
    assert _operations_prod_block() == PROD.read_text()
    values = yaml.safe_load(PROD.read_text())
    assert values["tls"]["enabled"] and values["metrics"]["serviceMonitor"]["enabled"]
    (endpoint,) = render(values, name="cache", namespace="llm").one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"serverName": "cache-prefixstore.llm.svc",  # as the example's comment says
                                     "ca": {"secret": {"name": values["tls"]["secretName"], "key": "ca.crt"}}}
    assert "serverName cache-prefixstore.llm.svc" in PROD.read_text()


@pytest.mark.parametrize("size", ["64KiB", "4GiB", "1.5GB", "0.5GiB", "512mib", "100 MiB", "65536", 65536, "2tb"])
def test_the_chart_reads_sizes_as_the_store_does(size: object) -> None:
    """The guardrail's bytes are StoreConfig's bytes: a limit of exactly ram_bytes + filter + headroom
    renders, one byte less is refused, for every unit form the schema lets through."""
    from prefixstore.store.config import parse_size

    need = parse_size(size, "ram_bytes") + (1 << 20) + (512 << 20)  # default filter and headroom
    render({"config": {"ram_bytes": size}, "resources": {"limits": {"memory": need}}})
    with pytest.raises(helm.HelmRenderError, match="resources.limits.memory"):
        render({"config": {"ram_bytes": size}, "resources": {"limits": {"memory": need - 1}}})


def test_a_default_install_names_how_to_build_and_push_the_image() -> None:
    """The default image `prefixstore:0.1.0` named no registry: a default install could not pull it.
    No registry carries the image, so the chart asks for the one it was pushed to, saying how."""
    with pytest.raises(helm.HelmRenderError) as err:
        render(image_given=False)
    text = str(err.value)
    assert "image.repository: no public registry carries the prefixstore image" in text, text
    assert "docker build -t REGISTRY/prefixstore:0.1.0 . && docker push REGISTRY/prefixstore:0.1.0" in text
    sts = render({"image": {"repository": "registry.example.com/team/prefixstore"}}).one("StatefulSet")
    (container,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "prefixstore"]
    assert container["image"] == "registry.example.com/team/prefixstore:0.1.0"
