"""One connector load and one connector save, timed phase by phase, against a raw read of the same
bytes from the same store, in one run: where a load's time goes, and what is left above the wire.

The connector's worker (vLLM's real ``KVConnectorFactory``, its KV cache allocator and views, a
serving model's shapes (``--model``): the wide LFM2's 4 attention layers of 2 KV heads of 256,
float32, 16 KiB of KV per token, plus 4 conv-state layers; or the tests' tiny LFM2's 2 layers of 2
heads of 64, 2 KiB a token; blocks of 32 tokens) against a real ``prefixstore serve`` process:

* ``load``: what a hybrid request's asynchronous load does (the worker's own leased lookup, the
  reads into the staging region, checksums, the scatter into vLLM's blocks and the state block),
  timed end to end and by phase (``relookup``, ``receive``, ``scatter``);
* ``raw``: the same payloads read by the client alone into a host buffer (the wire and the
  checks, no lookup, no scatter): the floor a load stands on;
* ``save copy``: the copy of a finished request's payloads out of the blocks (what vLLM's step
  waits for in ``wait_for_save``; offer and put run after, off the engine's thread).

Load and raw alternate rep by rep. ``--data-path`` picks HTTP or NIXL (NIXL reads land in the
registered staging region).

    python benchmarks/vllm_load.py                     # 2,239 tokens (the multi-turn benchmark's turn 5)
    python benchmarks/vllm_load.py --tokens 8192 --data-path nixl
    python benchmarks/vllm_load.py --model tiny --tokens 464 --data-path nixl   # a tiny-model turn's hit
    python benchmarks/vllm_load.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _harness as h

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

BLOCK = 32
SHAPES = {"wide": (2, 256, 4, 512), "tiny": (2, 64, 2, 128)}
"""Per model: KV heads, head size, attention layers (as many conv layers beside them), hidden size
(a conv state is hidden x 2): benchmarks/vllm_serving.py's wide and tiny LFM2."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_common_args(p, reps="7 (quick: 2)", warmup="1")
    p.add_argument("--tokens", type=int, default=None,
                   help="Tokens per load (and per save). Default: 2239 (quick: 200).")
    p.add_argument("--model", choices=tuple(SHAPES), default="wide",
                   help="Whose KV shapes: wide (LFM2 hidden 512, 8 layers, 16 KiB a token) or tiny (the tests' "
                        "LFM2, hidden 128, 4 layers, 2 KiB a token). Default: wide.")
    p.add_argument("--data-path", choices=("http", "nixl", "auto"), default="http",
                   help="The connector's and the raw read's data path (ClientConfig.data_path). Default: http.")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (200 if args.quick else 2239)
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 7)
    args.warmup = args.warmup if args.warmup is not None else 1
    if args.tokens < BLOCK or args.reps < 1:
        p.error(f"--tokens: at least {BLOCK}; --reps: at least 1")
    return args


class Rig:
    """vLLM's connector, both roles, over views vLLM allocates, against a store process."""

    def __init__(self, url: str, data_path: str, tokens: int, model: str = "wide") -> None:
        import torch
        from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        heads, head_dim, layers, hidden = SHAPES[model]
        self.attn = [f"model.layers.{2 * i + 1}.self_attn.attn" for i in range(layers)]
        mamba = [f"model.layers.{2 * i}.conv" for i in range(layers)]
        transfer = KVTransferConfig(kv_connector="PrefixStoreConnector", kv_role="kv_both",
                                    kv_connector_module_path="prefixstore.client.vllm.connector",
                                    kv_connector_extra_config={"url": url, "model_id": f"vllm-load-{time.time_ns()}",
                                                               "data_path": data_path})
        config = VllmConfig(kv_transfer_config=transfer, cache_config=CacheConfig(block_size=BLOCK,
                                                                                  mamba_cache_mode="align"))
        config.cache_config.kv_cache_layout = "LBHNC"  # what vLLM's engine core resolves on CPU
        specs: dict[str, Any] = {n: FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_dim,
                                                      dtype=torch.float32) for n in self.attn}
        specs.update({n: MambaSpec(block_size=BLOCK, shapes=((hidden, 2),), dtypes=(torch.float32,),
                                   mamba_cache_mode="align") for n in mamba})
        blocks = 4 * (-(-tokens // BLOCK)) + 8
        page = (BLOCK * 2 * heads * head_dim * 4) * (len(self.attn) + len(mamba))
        kv_config = get_kv_cache_config_from_groups(config, get_kv_cache_groups(config, specs), blocks * page)
        self.views = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBHNC,
                                       [g.kv_cache_spec.block_size for g in kv_config.kv_cache_groups])
        for name in self.attn:
            self.views[name].normal_()  # written once, as a served engine's pages are
        self.groups = len(kv_config.kv_cache_groups)
        # PrefixStoreConnector, both roles (typed as such: the factory's return type is the base class)
        self.scheduler: Any = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_config)
        self.worker: Any = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_config)
        self.worker.register_kv_caches(self.views)
        self.n = 0

    def step(self) -> tuple[Any, float]:
        """One engine step of the worker; the time its wait_for_save took (the save copy)."""
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput

        self.worker.bind_connector_metadata(self.scheduler.build_connector_meta(SchedulerOutput.make_empty()))
        self.worker.start_load_kv(None)
        t = time.perf_counter()
        self.worker.wait_for_save()
        copy_s = time.perf_counter() - t
        self.worker.drain()
        self.scheduler.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=self.worker.build_connector_worker_meta()))
        results = self.worker.get_transfer_results(set())
        self.worker.clear_connector_metadata()
        return results, copy_s

    def request(self, tokens: list[int], computed: int = 0) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.n += 1
        r = Request(f"r{self.n}", tokens, SamplingParams(max_tokens=4), None)
        r.num_computed_tokens = computed
        return r

    def save(self, tokens: list[int], computed: int) -> float:
        ids = list(range(1, -(-computed // BLOCK) + 1))
        self.scheduler.request_finished_all_groups(self.request(tokens, computed), tuple(ids for _ in range(self.groups)))
        return self.step()[1]

    def load(self, tokens: list[int], end: int) -> float:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        r = self.request(tokens)
        matched = self.scheduler.get_num_new_matched_tokens(r, 0)
        if matched != (end, True):
            raise RuntimeError(f"the store answers {matched} for a {end}-token load")
        nb = -(-end // BLOCK)
        target = list(range(2 * nb + 4, 3 * nb + 4))
        self.scheduler.update_state_after_alloc(
            r, KVCacheBlocks(blocks=tuple([KVCacheBlock(block_id=b) for b in target] for _ in range(self.groups))), end)
        t = time.perf_counter()
        results, _ = self.step()
        took = time.perf_counter() - t
        if results.failed_recving or results.finished_recving != {r.request_id}:
            raise RuntimeError(f"the load failed: {results}")
        return took


def timed(phases: dict[str, list[float]], obj: object, name: str, label: str) -> None:
    """Wrap ``obj.name`` (a coroutine function or a function) to add its wall time to ``phases``."""
    fn: Callable[..., Any] = getattr(obj, name)
    if asyncio.iscoroutinefunction(fn):
        async def awrapped(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                phases[label][-1] += time.perf_counter() - t
        setattr(obj, name, awrapped)
    else:
        def wrapped(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[label][-1] += time.perf_counter() - t
        setattr(obj, name, wrapped)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from _vllm_sides import prefixstore_nodes, stop

    import numpy as np

    N = args.tokens
    tokens = [(7 * i + 3) % 500 for i in range(N + 1)]
    with tempfile.TemporaryDirectory(prefix="vllm-load-") as tmp:
        urls, procs = prefixstore_nodes(1, Path(tmp), ["--state-admission", "always"])
        try:
            rig = Rig(urls[0], args.data_path, N, args.model)
            side = rig.worker.worker_side
            copies = [rig.save(tokens, N)]  # the first copy touches fresh pages: a warm-up
            for k in range(args.reps):  # later saves of other requests' tokens: the copies a served engine makes
                copies.append(rig.save(tokens[: N - 1 - k] + [1000 + k], N - 1 - k))
            phases: dict[str, list[float]] = defaultdict(list)
            timed(phases, side.client, "lookup", "relookup")
            timed(phases, side.staging, "receive", "receive")
            timed(phases, side.kv, "scatter_payloads", "scatter")
            client = side.client
            ns_items = None
            loads: list[float] = []
            raws: list[float] = []
            for rep in range(args.warmup + args.reps):
                for label in ("relookup", "receive", "scatter"):
                    phases[label].append(0.0)
                took = rig.load(tokens + [9] * 10, N)
                if ns_items is None:  # the same payloads, read raw: every block and the state
                    lookup = side.run(client.lookup(client.prompt(tokens[:N]), lease=False))
                    ns_items = [item for item, _, _ in lookup.kv_reads(N)]
                    state = lookup.state_read()
                    if state is not None:
                        ns_items.append(state)
                    sizes = side.run(client.read(ns_items, [np.empty(1 << 22, np.uint8) for _ in ns_items]))
                    bufs = [np.empty(max(s, 1), np.uint8) for s in sizes]
                t = time.perf_counter()
                got = side.run(client.read(ns_items, bufs))
                raw = time.perf_counter() - t
                if min(got) < 0:
                    raise RuntimeError("the raw read missed a payload")
                if rep >= args.warmup:
                    loads.append(took)
                    raws.append(raw)
                h.progress(f"rep {rep + 1}/{args.warmup + args.reps}: load {took * 1e3:.1f} ms, raw {raw * 1e3:.1f} ms")
            nbytes = sum(got)
        finally:
            stop(procs)
    med = statistics.median
    phase = {k: med(v[args.warmup:]) for k, v in phases.items()}
    results = {"tokens": N, "bytes": nbytes, "data_path": args.data_path,
               "load_ms": med(loads) * 1e3, "raw_ms": med(raws) * 1e3,
               "load_gb_s": nbytes / med(loads) / 1e9, "raw_gb_s": nbytes / med(raws) / 1e9,
               "load_over_raw": med(loads) / med(raws), "phases_ms": {k: v * 1e3 for k, v in phase.items()},
               "save_copy_ms": med(copies[1:]) * 1e3, "save_copy_first_ms": copies[0] * 1e3,
               "loads_ms": [x * 1e3 for x in loads], "raws_ms": [x * 1e3 for x in raws]}
    h.print_table(f"One connector load of {N} tokens ({args.model} model, {nbytes / 1e6:.1f} MB, {args.data_path}) against a raw read "
                  "of the same bytes (medians)",
                  ["what", "ms", "GB/s"],
                  [["load (whole)", results["load_ms"], results["load_gb_s"]],
                   *[[f"  {k}", v, "-"] for k, v in results["phases_ms"].items()],
                   ["raw read", results["raw_ms"], results["raw_gb_s"]],
                   ["load / raw", results["load_over_raw"], "-"],
                   ["save copy (engine thread)", results["save_copy_ms"], nbytes / results["save_copy_ms"] / 1e6]])
    h.write_json(args.out, "vllm_load", {"benchmark": "vllm_load", "machine": h.machine_note(), "args": vars(args)
                                         | {"out": str(args.out)}, "results": results})
    plt = h.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = ["raw read", "load: relookup", "load: receive", "load: scatter", "load: rest", "save copy"]
    rest = results["load_ms"] - sum(results["phases_ms"].values())
    vals = [results["raw_ms"], *[results["phases_ms"].get(k, 0) for k in ("relookup", "receive", "scatter")], rest,
            results["save_copy_ms"]]
    ax.barh(names, vals, color=["gray", "C0", "C0", "C0", "C0", "C1"])
    ax.set_xlabel("ms (median)")
    ax.set_title(f"{N}-token connector load vs raw read ({args.model} model, {args.data_path})", fontsize=9)
    h.save_figure(fig, args.out / "vllm_load.png")
    return 0


if __name__ == "__main__":
    sys.path.insert(1, str(h.HERE.parent))
    raise SystemExit(main())
