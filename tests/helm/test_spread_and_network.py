"""Where the pods land and who may reach them: the chart spreads the nodes over Kubernetes nodes by
default (three pods on one machine: a machine lost is the whole cache), and renders a
NetworkPolicy once the engines are named (NOTES says how, and what it lets through)."""

from __future__ import annotations

from typing import Any

from .chart import FULLNAME, NAMESPACE, render
from .test_chart import validate_all

SELECTOR = {"app.kubernetes.io/name": "prefixstore", "app.kubernetes.io/instance": "ps"}


def pod_spec(values: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = render(values).one("StatefulSet")["spec"]["template"]["spec"]
    return spec


def test_pods_spread_over_kubernetes_nodes_by_default() -> None:
    assert pod_spec()["topologySpreadConstraints"] == [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": SELECTOR}}]
    hard = pod_spec({"podSpread": {"enabled": True, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "DoNotSchedule"}})["topologySpreadConstraints"][0]
    assert (hard["topologyKey"], hard["whenUnsatisfiable"]) == ("topology.kubernetes.io/zone", "DoNotSchedule")
    given = [{"maxSkew": 2, "topologyKey": "rack", "whenUnsatisfiable": "DoNotSchedule",
              "labelSelector": {"matchLabels": {"x": "y"}}}]
    assert pod_spec({"topologySpreadConstraints": given})["topologySpreadConstraints"] == given  # replaces it
    assert "topologySpreadConstraints" not in pod_spec({"podSpread": {"enabled": False, "topologyKey": "x",
                                                                      "whenUnsatisfiable": "ScheduleAnyway"}})
    validate_all(render())


def test_no_network_policy_until_the_engines_are_named_and_notes_say_how() -> None:
    r = render()
    assert r.of_kind("NetworkPolicy") == []
    assert "no NetworkPolicy: anything that reaches the pods may call the store" in r.notes
    assert "--set networkPolicy.engines.podSelector.app=vllm" in r.notes


def test_a_network_policy_admits_the_engines_the_nodes_and_the_extra_peers() -> None:
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    r = render({"networkPolicy": {"engines": {"podSelector": {"app": "vllm"},
                                              "namespaceSelector": {"team": "llm"}},
                                  "extraFrom": [monitoring]},
                "metrics": {"serviceMonitor": {"enabled": True}}})
    assert "NetworkPolicy" in validate_all(r)
    policy = r.one("NetworkPolicy", FULLNAME)["spec"]
    assert policy["podSelector"] == {"matchLabels": SELECTOR} and policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": SELECTOR}},  # the nodes, to each other
        {"podSelector": {"matchLabels": {"app": "vllm"}}, "namespaceSelector": {"matchLabels": {"team": "llm"}}},
        monitoring]
    assert 'lets only the engines\n(pods {"app":"vllm"} in namespaces {"team":"llm"})' in r.notes
    assert "Prometheus is not among them" not in r.notes


def test_notes_warn_when_the_policy_would_block_prometheus() -> None:
    r = render({"networkPolicy": {"engines": {"podSelector": {"app": "sglang"}}},
                "metrics": {"serviceMonitor": {"enabled": True}}})
    (rule,) = r.one("NetworkPolicy")["spec"]["ingress"]
    assert rule["from"][1] == {"podSelector": {"matchLabels": {"app": "sglang"}}}  # the release's namespace only
    assert f"in {NAMESPACE})" in r.notes
    assert "Prometheus is not among them: add its pods or namespace to networkPolicy.extraFrom" in r.notes
    off = render({"networkPolicy": {"enabled": False, "engines": {"podSelector": {"app": "sglang"}}}})
    assert off.of_kind("NetworkPolicy") == []


def test_the_client_service_comment_sends_engines_to_the_pods() -> None:
    """templates/service.yaml called the Service 'what engines put in ClientConfig.url': the one thing
    NOTES and docs tell engines not to do (a raw /v1/lookup on a node of several answers 409)."""
    from .chart import CHART

    text = (CHART / "templates" / "service.yaml").read_text()
    assert "what engines put in ClientConfig.url" not in text
    assert "not for engines" in text and "ClientConfig(urls=(...))" in text
