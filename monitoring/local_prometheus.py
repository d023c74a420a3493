"""A real Prometheus scraping a local 3-node cluster, with the chart's alert rules loaded: the
dashboard and the alerts without Kubernetes.

    apt-get install prometheus                       # Debian's package (2.42 tested)
    python monitoring/local_prometheus.py            # 3 nodes on 8077-8079, Prometheus on :9090, a workload
    python monitoring/local_prometheus.py --help     # ports, node count, no workload, a directory to keep

It starts `prefixstore serve` three times (one cluster, RAM only, a tenants file with two demo
tenants and quotas), renders the chart's PrometheusRule with ``metrics.selector='job="prefixstore"'``
(through helm-python-sdk, the test extra's, or a `helm` binary) into a rules file, writes a
prometheus.yml that scrapes the nodes as job ``prefixstore``, starts ``prometheus`` on it, and
drives a small workload (two tenants, a hybrid and a plain model) so that every panel and alert
has series. Then it prints where everything is and serves until Ctrl-C. Import
helm/prefixstore/dashboards/prefixstore.json into a Grafana pointed at the printed Prometheus URL:
the Namespace variable stays at All (a plain scrape has no namespace label), the job is
``prefixstore``.

tests/helm/test_prometheus_live.py runs this module's pieces: the same cluster, the same
Prometheus, every dashboard expression and alert rule evaluated against it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "prefixstore"
JOB = "prefixstore"
SELECTOR = f'job="{JOB}"'
TENANTS = ("alpha", "beta")
QUOTA = "256MiB"


def hash_token(token: str) -> str:
    from prefixstore.store.tenants import token_sha256

    return token_sha256(token)


def progress(text: str) -> None:
    print(f"[local-prometheus] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the rules file


def render_rules(selector: str = SELECTOR, replicas: int = 3) -> str:
    """The chart's alert rules as a Prometheus rules file (the PrometheusRule's spec), with
    ``selector`` picking the series. Needs helm-python-sdk (the test extra) or `helm` on PATH."""
    import yaml

    values = {"metrics": {"selector": selector, "prometheusRule": {"enabled": True}}, "replicaCount": replicas,
              "image": {"repository": "local/prefixstore"}}
    try:
        import helm_python as helm
    except ImportError:
        helm = None
    if helm is not None:
        with helm.Chart.load(CHART) as chart:
            files = chart.render(values, name="local", namespace="default", is_install=True)
        text = files[f"{CHART.name}/templates/prometheusrule.yaml"]
    elif shutil.which("helm"):
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(values, f)
            f.flush()
            text = subprocess.run(["helm", "template", "local", str(CHART), "-f", f.name, "-s",
                                   "templates/prometheusrule.yaml"], check=True, capture_output=True,
                                  text=True).stdout
    else:
        raise RuntimeError("rendering the chart's alert rules needs helm-python-sdk (pip install -c constraints.txt "
                           "'.[test]') or the helm binary on PATH")
    rule = next(doc for doc in yaml.safe_load_all(text) if doc and doc.get("kind") == "PrometheusRule")
    return yaml.safe_dump(rule["spec"], sort_keys=False)


def prometheus_config(targets: Sequence[str], rules_file: Path | None, interval_s: float) -> str:
    """prometheus.yml: every node scraped as job JOB, the rules file evaluated as often."""
    lines = ["global:", f"  scrape_interval: {interval_s:g}s", f"  evaluation_interval: {interval_s:g}s"]
    if rules_file is not None:
        lines += ["rule_files:", f"  - {json.dumps(str(rules_file))}"]
    lines += ["scrape_configs:", f"  - job_name: {JOB}", "    static_configs:",
              f"      - targets: {json.dumps(list(targets))}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- processes


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_for(url: str, what: str, proc: subprocess.Popen[bytes], deadline_s: float = 60.0) -> None:
    """Poll ``url`` until it answers 200, with a bound; fail naming ``what`` if it exits or never does."""
    end = time.monotonic() + deadline_s
    delay = 0.02
    while get(url, 2.0)[0] != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        if time.monotonic() > end:
            raise RuntimeError(f"{what} did not answer {url} within {deadline_s:g}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


@dataclass
class LocalCluster:
    """N `prefixstore serve` nodes and a Prometheus scraping them; stop() ends them all."""

    workdir: Path
    node_urls: list[str] = field(default_factory=list)
    prometheus_url: str = ""
    tokens: dict[str, str] = field(default_factory=dict)  # tenant (and "admin") -> bearer token
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_nodes(cluster: LocalCluster, ports: Sequence[int]) -> None:
    """The nodes, one cluster (static peers), RAM only, tenants with quotas."""
    cluster.tokens = {name: secrets.token_hex(16) for name in (*TENANTS, "admin", "cluster")}
    tenants = [f'admin_token_sha256 = "{hash_token(cluster.tokens["admin"])}"',
               f'cluster_token_sha256 = "{hash_token(cluster.tokens["cluster"])}"']
    for name in TENANTS:
        tenants += [f"[tenants.{name}]", f'token_sha256 = "{hash_token(cluster.tokens[name])}"',
                    f'quota_bytes = "{QUOTA}"']
    (cluster.workdir / "tenants.toml").write_text("\n".join(tenants) + "\n")
    (cluster.workdir / "cluster-token").write_text(cluster.tokens["cluster"] + "\n")
    cluster.node_urls = [f"http://127.0.0.1:{port}" for port in ports]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXSTORE_")}
    for port, url in zip(ports, cluster.node_urls):
        log = open(cluster.workdir / f"node-{port}.log", "wb")
        cluster.procs.append(subprocess.Popen(
            [sys.executable, "-m", "prefixstore", "serve", "--port", str(port), "--node-url", url,
             "--peers", ",".join(cluster.node_urls), "--data-dir", "none", "--ram-bytes", "64MiB",
             "--state-admission", "always", "--nixl", "off", "--tenants-file", str(cluster.workdir / "tenants.toml"),
             "--cluster-token-file", str(cluster.workdir / "cluster-token")],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cluster.workdir))
    for proc, url in zip(cluster.procs, cluster.node_urls):
        wait_for(url + "/readyz", f"the node at {url} (log: {cluster.workdir})", proc)


def start_prometheus(cluster: LocalCluster, port: int, interval_s: float, rules: str | None,
                     binary: str = "prometheus") -> None:
    rules_file = None
    if rules is not None:
        rules_file = cluster.workdir / "rules.yml"
        rules_file.write_text(rules)
    config = cluster.workdir / "prometheus.yml"
    config.write_text(prometheus_config([u.split("://", 1)[1] for u in cluster.node_urls], rules_file, interval_s))
    log = open(cluster.workdir / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={cluster.workdir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, cwd=cluster.workdir)
    cluster.procs.append(proc)
    cluster.prometheus_url = f"http://127.0.0.1:{port}"
    wait_for(cluster.prometheus_url + "/-/ready", f"prometheus (log: {cluster.workdir / 'prometheus.log'})", proc)


@contextlib.contextmanager
def local_cluster(nodes: int = 3, ports: Sequence[int] | None = None, prometheus_port: int | None = None,
                  interval_s: float = 5.0, workdir: Path | None = None, rules: bool = True) -> Iterator[LocalCluster]:
    """The nodes and Prometheus (scraping every ``interval_s``), stopped on exit."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="prefixstore-prometheus-")))
        workdir.mkdir(parents=True, exist_ok=True)
        cluster = LocalCluster(workdir=workdir)
        stack.callback(cluster.stop)
        node_ports = list(ports) if ports is not None else free_ports(nodes)
        progress(f"starting {len(node_ports)} nodes on ports {', '.join(map(str, node_ports))}")
        start_nodes(cluster, node_ports)
        text = render_rules(SELECTOR, len(node_ports)) if rules else None
        port = prometheus_port if prometheus_port is not None else free_ports(1)[0]
        progress(f"starting prometheus on port {port} (scrape and rule interval {interval_s:g}s)")
        start_prometheus(cluster, port, interval_s, text)
        yield cluster


# ---------------------------------------------------------------- the workload


def namespaces() -> list[tuple[str, Any]]:
    """(tenant, namespace): a hybrid and a plain model for alpha, a hybrid for beta."""
    from prefixstore.protocol import KVLayout, Namespace, StateLayout

    def ns(tenant: str, model: str, hybrid: bool) -> Namespace:
        return Namespace(model=model, tenant=tenant, block_tokens=16,
                         kv=KVLayout(num_layers=2, num_heads=2, head_dim=32),
                         state=StateLayout(num_layers=2, shapes=((2, 32, 32),)) if hybrid else StateLayout())

    return [("alpha", ns("alpha", "demo-hybrid", True)), ("alpha", ns("alpha", "demo-plain", False)),
            ("beta", ns("beta", "demo-hybrid", True))]


async def _workload(cluster: LocalCluster, stop: threading.Event) -> None:
    import numpy as np

    from prefixstore.client import ClientConfig, PrefixClient

    rng = np.random.default_rng(0)
    clients = [(tenant, ns, PrefixClient(ns, ClientConfig(urls=tuple(cluster.node_urls), token=cluster.tokens[tenant])))
               for tenant, ns in namespaces()]
    system = list(range(50_000, 50_064))  # a shared system prompt: conversations fork under it
    turn = 0
    try:
        while not stop.is_set():
            for _, ns, client in clients:
                tokens = system + [int(t) for t in rng.integers(1, 30_000, 96 + 16 * (turn % 4))]
                n = len(tokens)
                kv = rng.integers(0, 256, (ns.kv.num_layers, n, ns.kv.layer_token_bytes), dtype=np.uint8)
                snapshots = {n: rng.integers(0, 256, ns.state.snapshot_bytes, dtype=np.uint8)} if ns.has_state else None
                await client.save(client.prompt(tokens), n, lambda a, b, kv=kv: kv[:, a:b].tobytes(), snapshots)
                for prompt in (tokens + [7, 8, 9], system + [1, 2, 3]):  # a resumed conversation; a new one
                    res = await client.lookup(prompt)
                    reads = res.kv_reads(res.kv_tokens)
                    buffers = [bytearray(ns.kv.payload_bytes(e - s)) for _, s, e in reads]
                    await client.read([item for item, _, _ in reads], buffers)
                    await client.release(res.lease_id)
            turn += 1
            await asyncio.sleep(0.05)
    finally:
        for _, _, client in clients:
            await client.close()


@contextlib.contextmanager
def workload(cluster: LocalCluster) -> Iterator[threading.Event]:
    """Saves, lookups and reads of two tenants' models on a thread until the block exits."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(_workload(cluster, stop))
        except BaseException as err:  # reported when the block exits
            errors.append(err)

    thread = threading.Thread(target=run, name="workload", daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(60)
        if errors:
            raise RuntimeError(f"the workload failed: {errors[0]!r}") from errors[0]


# ---------------------------------------------------------------- Prometheus queries


def query(prometheus_url: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector (a scalar answer becomes one sample); raises on an error."""
    status, body = get(f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), 10.0)
    answer = json.loads(body or b"{}")
    if status != 200 or answer.get("status") != "success":
        raise ValueError(f"{expr!r}: {answer.get('error') or status}")
    data = answer["data"]
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    result: list[dict[str, Any]] = data["result"]
    return result


def rules(prometheus_url: str) -> list[dict[str, Any]]:
    """Every loaded rule with its health and last error (GET /api/v1/rules)."""
    status, body = get(prometheus_url + "/api/v1/rules", 10.0)
    answer = json.loads(body or b"{}")
    if status != 200:
        raise ValueError(f"/api/v1/rules answered {status}")
    return [r for g in answer["data"]["groups"] for r in g["rules"]]


# ---------------------------------------------------------------- the command


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python monitoring/local_prometheus.py",
        description="Start a local prefixstore cluster and a real Prometheus (Debian's prometheus package) scraping "
                    "it with the chart's alert rules loaded, drive a small workload, and serve until Ctrl-C.")
    parser.add_argument("--nodes", type=int, default=3, help="store nodes (default: 3)")
    parser.add_argument("--port", type=int, default=8077, help="first node's port; the others follow (default: 8077)")
    parser.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus's port (default: 9090)")
    parser.add_argument("--interval", type=float, default=5.0, metavar="SECONDS",
                        help="scrape and rule evaluation interval (default: 5)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the config, rules, logs and TSDB here (default: a temporary directory)")
    parser.add_argument("--no-workload", action="store_true", help="start the cluster idle (no saves or lookups)")
    args = parser.parse_args(argv)
    binary = shutil.which("prometheus")
    if binary is None:
        print("prometheus is not installed: apt-get install prometheus (Debian's package)", file=sys.stderr)
        return 1
    ports = [args.port + i for i in range(args.nodes)]
    try:
        with local_cluster(args.nodes, ports, args.prometheus_port, args.interval, args.workdir) as cluster:
            stack = contextlib.ExitStack()
            if not args.no_workload:
                stack.enter_context(workload(cluster))
            with stack:
                print(f"nodes:       {', '.join(cluster.node_urls)}")
                print(f"prometheus:  {cluster.prometheus_url} (job {JOB}; alerts: {cluster.prometheus_url}/alerts)")
                print(f"grafana:     import {CHART / 'dashboards' / 'prefixstore.json'} with that data source")
                print(f"admin CLI:   PREFIXSTORE_ADMIN_TOKEN={cluster.tokens['admin']} prefixstore stats --cluster "
                      f"{cluster.node_urls[0]}")
                print(f"tenants:     {', '.join(f'{t} token {cluster.tokens[t]}' for t in TENANTS)}")
                print(f"files:       {cluster.workdir}")
                print("Ctrl-C stops everything.", flush=True)
                done = threading.Event()
                signal.signal(signal.SIGTERM, lambda *_: done.set())
                try:
                    done.wait()
                except KeyboardInterrupt:
                    pass
    except RuntimeError as err:
        print(f"local_prometheus: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
