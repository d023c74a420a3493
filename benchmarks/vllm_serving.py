"""vLLM serving with prefixstore, head to head: two real `vllm serve` replicas under concurrent
multi-turn agentic load, vLLM alone against vLLM + prefixstore (one node, and a 3-node cluster)
and against the peer connectors that run here, in one run.

What runs (benchmarks/_vllm_sides.py): per side, its back-end (nothing; ``prefixstore serve``;
three of them as a cluster; a peer's processes) and two vLLM OpenAI-compatible servers of a
random-weight hybrid model, each with the side's ``--kv-transfer-config`` exactly as the side's
docs tell users. The request stream (benchmarks/_serving_load.py): conversations led by one of a
few long shared system/tool prompts (Zipf), ShareGPT turn lengths, Poisson arrivals, replayed
closed loop per conversation over the two replicas round robin (a conversation's next turn
usually lands on the other replica: the case a shared tier exists for), at each concurrency
(conversations in flight). Each run uses its own ``cache_salt``, so nothing one run left in a
cache serves another; sides alternate rep by rep, each rep on freshly started servers and
stores. Greedy decoding, end of sequence ignored: every side must generate vLLM alone's tokens.

Figures per model, concurrency and side: TTFT p50/p90/p99 by turn; TTFT p50 of turns 2 and
later; TPOT p50/p99 over all requests; output tokens/s and requests/s; prompt tokens computed
per request (prompt - the engine's cached tokens); the store's KV and state hit rates (its
/metrics, ``prefixstore_lookup_tokens_total``); requests whose tokens differ from vLLM alone's
(a greedy near tie, both runs' top log-probabilities within ``--tie-logprob``, is counted apart
from a wrong token); failed requests; and the decode tax: the engines' decode-only steps with a
load of the connector in flight against those without, batch size by batch size
(``prefixstore_vllm_decode_step_seconds_total``, measured on the worker); and where the first
token's time goes, by vLLM's own request histograms: queued (a lookup answered, a hybrid load
awaited) against prefill (the prompt's compute and whatever shares its cores). ``--kill-store``
adds a run where the store is killed (SIGKILL) after 40% of the requests: every request must
still complete, from recompute, with vLLM alone's tokens.

    python benchmarks/vllm_serving.py --quick                       # smoke run (CI: tests/test_benchmarks_smoke.py)
    python benchmarks/vllm_serving.py --models wide --concurrency 8 # the headline cell
    python benchmarks/vllm_serving.py                               # every model, concurrency 1, 4, 8, 16

Writes ``vllm_serving.json`` (a ``summary`` object: the headline ratios, store side against vLLM
alone) and ``vllm_serving.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _harness as h
from _serving_load import Result, RunState, Trace, build_trace, replay
from _vllm_sides import (MODELS, SIDES, Backends, Model, Replica, SideUnavailable, build_model, prefixstore_nodes, scrape,
                         start_replicas, stop)

try:  # the peers register their sides (they need nothing of prefixstore's)
    import _vllm_peers  # noqa: F401
except ImportError:
    pass

HEADLINE = ("wide", 8)
"""The cell the summary reports (the issue's target): the wide model at concurrency 8."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_common_args(p, reps="2 (quick: 1)", warmup="1 per replica")
    p.add_argument("--models", default=None,
                   help=f"Comma-separated models of {list(MODELS)}: tiny (the tests' LFM2), wide (LFM2 of hidden "
                        "512 and 8 layers), gdn (the tests' Qwen3-Next-shaped gated-delta-net model, bfloat16), "
                        "llama (the tests' tiny Llama, attention only: for the peers that take no hybrid). "
                        "Default: tiny,wide,gdn (quick: tiny).")
    p.add_argument("--sides", default=None,
                   help="Comma-separated sides (vllm, vLLM alone, always runs, first of a pair): "
                        + "; ".join(f"{name}: {side.description}" for name, side in SIDES.items())
                        + ". A side that cannot run here is reported with its exact error. Default: vllm, store, "
                          "cluster and every peer (quick: vllm,store).")
    p.add_argument("--connector-extra", default="{}",
                   help="JSON object of keys added to prefixstore's kv_connector_extra_config on its sides "
                        "(e.g. {\"load_policy\": \"always\"}). Default: {} (the connector as docs/vllm.md "
                        "configures it).")
    p.add_argument("--concurrency", default=None,
                   help="Comma-separated conversations in flight. Default: 1,4,8,16 (quick: 2).")
    p.add_argument("--conversations", type=int, default=None,
                   help="Conversations per run (at least the largest concurrency). Default: 2 x the largest "
                        "concurrency, at least 8 (quick: 4).")
    p.add_argument("--turns", type=int, default=None, help="Turns per conversation (at most). Default: 6 (quick: 3).")
    p.add_argument("--systems", type=int, default=4, help="Shared system/tool prompts. Default: 4.")
    p.add_argument("--system-tokens", type=int, default=None,
                   help="Tokens of each shared system/tool prompt. Default: 1024 (quick: 96).")
    p.add_argument("--zipf", type=float, default=1.1,
                   help="Zipf exponent of the system prompts' popularity (0: uniform). Default: 1.1.")
    p.add_argument("--rate", type=float, default=4.0,
                   help="Conversation arrivals per second (Poisson); 'inf': all at once. Default: 4.")
    p.add_argument("--max-user-tokens", type=int, default=None,
                   help="Cap on a turn's new user tokens (ShareGPT lengths above it are cut). Default: 512 "
                        "(quick: 48).")
    p.add_argument("--max-answer-tokens", type=int, default=None,
                   help="Cap on a turn's generated tokens (ShareGPT answers are mostly longer). Default: 128 "
                        "(quick: 8).")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="vLLM's max_model_len (prompts that would outgrow it end their conversation). "
                        "Default: 4096 (quick: 1024).")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="Tokens of attention KV each replica's cache holds (CPU: vLLM's kv_cache_memory_bytes). "
                        "Default: 4 x --max-model-len, a busy engine's cache: at 8 conversations in flight its "
                        "share of the running requests fills most of it, and little of the conversations' "
                        "history stays (larger caches: docs/benchmarks.md has the same cell at 3 sizes).")
    p.add_argument("--max-num-seqs", type=int, default=16, help="vLLM's max_num_seqs per replica. Default: 16.")
    p.add_argument("--kill-store", action="store_true",
                   help="Also run the store side once at --kill-concurrency with the store killed (SIGKILL) "
                        "after 40%% of the requests; every request must complete.")
    p.add_argument("--kill-concurrency", type=int, default=None,
                   help="Conversations in flight in the --kill-store run. Default: the largest --concurrency.")
    p.add_argument("--tie-logprob", type=float, default=None,
                   help="Two greedy choices within this log-probability of each other on both sides are a near "
                        "tie (a divergence there is not a wrong token). Default: 0.02 (bfloat16 models: 0.3, the "
                        "tests' GDN tolerance).")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="Where the engines run: cpu (vLLM's CPU build; each replica's OpenMP threads pinned to a "
                        "core) or cuda (a GPU machine; the replicas share the GPU). Default: cpu.")
    p.add_argument("--timeout-s", type=float, default=900.0, help="Per request. Default: 900.")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                   help="Time lookups against a store of its own that no engine uses (benchmarks/_store_probe.py, "
                        "one every 50 ms) while each side serves, and once with nothing running: what the machine "
                        "leaves a process beside the engines (column 'probe p99'). Default: on.")
    args = p.parse_args(argv)
    args.probe_url = None  # set once the probe's store runs
    q = args.quick
    args.models = _names(args.models or ("tiny" if q else "tiny,wide,gdn"), MODELS, "--models", p)
    default_sides = "vllm,store" if q else ",".join(["vllm", "store", "cluster", *(s for s in SIDES
                                                                                   if s not in ("vllm", "store", "cluster",
                                                                                                "flaky", "store-http"))])
    args.sides = _names(args.sides or default_sides, tuple(SIDES), "--sides", p)
    try:
        args.connector_extra = json.loads(args.connector_extra)
    except ValueError as err:
        p.error(f"--connector-extra: not JSON: {err}")
    if not isinstance(args.connector_extra, dict):
        p.error("--connector-extra: a JSON object")
    if "vllm" not in args.sides:
        args.sides.insert(0, "vllm")  # every ratio is against vLLM alone, in the same run
    try:
        args.concurrency = [int(c) for c in (args.concurrency or ("2" if q else "1,4,8,16")).split(",")]
    except ValueError:
        p.error("--concurrency: comma-separated integers")
    if min(args.concurrency) < 1:
        p.error("--concurrency: at least 1")
    args.conversations = args.conversations or (4 if q else max(8, 2 * max(args.concurrency)))
    args.turns = args.turns or (3 if q else 6)
    args.system_tokens = args.system_tokens or (96 if q else 1024)
    args.max_user_tokens = args.max_user_tokens or (48 if q else 512)
    args.max_answer_tokens = args.max_answer_tokens or (8 if q else 128)
    args.max_model_len = args.max_model_len or (1024 if q else 4096)
    args.kv_cache_tokens = args.kv_cache_tokens or 4 * args.max_model_len
    args.kill_concurrency = args.kill_concurrency or max(args.concurrency)
    args.reps = args.reps if args.reps is not None else (1 if q else 2)
    if min(args.conversations, args.turns, args.reps, args.system_tokens) < 1:
        p.error("--conversations, --turns, --reps, --system-tokens: at least 1")
    if args.system_tokens + 2 > args.max_model_len:
        p.error("--system-tokens: must leave room for a turn within --max-model-len")
    return args


def _names(text: str, known: Sequence[str], flag: str, p: argparse.ArgumentParser) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        p.error(f"{flag}: {bad or text!r} not among {list(known)}")
    return names


# ---------------------------------------------------------------- one run


def store_hits(urls: Sequence[str]) -> dict[str, float]:
    """The store nodes' lookup tokens, summed: {'kv:hit': n, 'kv:miss': n, 'state:hit': ...}."""
    out: dict[str, float] = {}
    for url in urls:
        try:
            samples = scrape(url + "/metrics")
        except OSError:
            continue  # a node killed on purpose
        for key, value in samples.items():
            if key.startswith("prefixstore_lookup_tokens_total{"):
                kind = _label(key, "kind")
                result = _label(key, "result")
                out[f"{kind}:{result}"] = out.get(f"{kind}:{result}", 0.0) + value
    return out


def replica_samples(replicas: Sequence[Replica]) -> list[dict[str, float]]:
    """Each replica's /metrics samples (empty where it did not answer: a dead replica counts nothing)."""
    out = []
    for r in replicas:
        try:
            out.append(r.metrics())
        except OSError:
            out.append({})
    return out


def connector_events(replicas: Sequence[Replica]) -> dict[str, float]:
    """The connectors' event counters (prefixstore_vllm_events_total), summed over replicas."""
    out: dict[str, float] = {}
    for samples in replica_samples(replicas):
        for key, value in samples.items():
            if key.startswith("prefixstore_vllm_events_total{"):
                event = _label(key, "event")
                out[event] = out.get(event, 0.0) + value
    return out


def connector_costs(replicas: Sequence[Replica]) -> list[dict[str, float]]:
    """Per replica, the cost figures its connector's last load decision used (prefixstore_vllm_cost_seconds):
    why hits were loaded or recomputed."""
    return [{_label(k, "figure"): v for k, v in samples.items() if k.startswith("prefixstore_vllm_cost_seconds{")}
            for samples in replica_samples(replicas)]


#: vLLM's own per-request histograms that split a request's first token (v1/metrics/loggers.py):
#: queued (arrival to first scheduled: a lookup deferred, a hybrid load awaited, a full batch) and
#: prefill (first scheduled to first token: the prompt's compute, and whatever shares its cores).
ENGINE_PHASES = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                 "engine_ttft": "vllm:time_to_first_token_seconds"}


def engine_phases(replicas: Sequence[Replica]) -> dict[str, float]:
    """Sums and counts of ENGINE_PHASES over the replicas: {'queue:s': seconds, 'queue:n': requests}."""
    out: dict[str, float] = {}
    for samples in replica_samples(replicas):
        for key, value in samples.items():
            for phase, metric in ENGINE_PHASES.items():
                for suffix, kind in (("_sum", "s"), ("_count", "n")):
                    if key.startswith(metric + suffix):
                        out[f"{phase}:{kind}"] = out.get(f"{phase}:{kind}", 0.0) + value
    return out


def phase_means(phases: dict[str, float]) -> dict[str, float]:
    """Mean seconds per request of each phase over a run (from engine_phases' difference)."""
    return {phase: phases[f"{phase}:s"] / phases[f"{phase}:n"] for phase in ENGINE_PHASES
            if phases.get(f"{phase}:n")}


def step_counters(replicas: Sequence[Replica]) -> dict[str, float]:
    """The connectors' decode-step counters, summed over replicas: {'yes:5-8:n': steps, 'yes:5-8:s': seconds}."""
    out: dict[str, float] = {}
    for samples in replica_samples(replicas):
        for key, value in samples.items():
            for metric, suffix in (("prefixstore_vllm_decode_steps_total{", "n"),
                                   ("prefixstore_vllm_decode_step_seconds_total{", "s")):
                if key.startswith(metric):
                    k = f"{_label(key, 'load_in_flight')}:{_label(key, 'batch')}:{suffix}"
                    out[k] = out.get(k, 0.0) + value
    return out


def _label(key: str, name: str) -> str:
    marker = f'{name}="'
    i = key.find(marker)
    return key[i + len(marker): key.index('"', i + len(marker))] if i >= 0 else ""


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def run_once(trace: Trace, replicas: Sequence[Replica], model: Model, backends: Backends, *, concurrency: int,
             salt: str, label: str, timeout_s: float, kill_after: float | None = None,
             probe_url: str | None = None) -> dict[str, Any]:
    """Replay the trace once; the results and what the stores and engines counted meanwhile (and,
    with ``probe_url``, what benchmarks/_store_probe.py saw of that store meanwhile)."""
    probe = start_probe(probe_url) if probe_url else None
    hits0, steps0, events0 = store_hits(backends.store_urls), step_counters(replicas), connector_events(replicas)
    phases0 = engine_phases(replicas)
    total = trace.num_requests
    killed: list[str] = []
    last = [time.monotonic()]

    def on_result(result: Result, state: RunState) -> None:
        if time.monotonic() - last[0] > 10 or state.done == total:
            last[0] = time.monotonic()
            h.progress(f"  {label}: {state.done}/{total} requests, {state.failed} failed")
        if kill_after is not None and not killed and state.done >= kill_after * total:
            for proc in backends.processes[:1]:
                proc.send_signal(signal.SIGKILL)
            killed.append(backends.store_urls[0] if backends.store_urls else "")
            h.progress(f"  {label}: killed the store ({killed[0]}) after {state.done} requests")

    t0 = time.perf_counter()
    results = asyncio.run(replay(trace, [r.url for r in replicas], model.name, concurrency=concurrency, salt=salt,
                                 timeout_s=timeout_s, on_result=on_result))
    wall = time.perf_counter() - t0
    return {"results": results, "wall_s": wall, "hits": _diff(store_hits(backends.store_urls), hits0),
            "steps": _diff(step_counters(replicas), steps0), "killed": killed,
            "events": _diff(connector_events(replicas), events0), "costs": connector_costs(replicas),
            "phases": phase_means(_diff(engine_phases(replicas), phases0)),
            "probe": end_probe(probe) if probe is not None else None}


def start_probe(url: str) -> subprocess.Popen[bytes]:
    """benchmarks/_store_probe.py against ``url`` (a store no engine uses) until end_probe."""
    return subprocess.Popen([sys.executable, str(Path(__file__).with_name("_store_probe.py")), "--url", url],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def end_probe(proc: subprocess.Popen[bytes]) -> dict[str, Any] | None:
    """The probe's lookups (p50/p99/max ms, how many over 250 ms), or None if it failed."""
    try:
        out, _ = proc.communicate(timeout=60)
        return json.loads(out.decode().strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        proc.kill()
        proc.wait()
        return None


# ---------------------------------------------------------------- figures


def quantile(values: Sequence[float], q: float) -> float:
    v = sorted(x for x in values if not math.isnan(x))
    if not v:
        return math.nan
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def figures(run: dict[str, Any], turns: int) -> dict[str, Any]:
    results: list[Result] = run["results"]
    ok = [r for r in results if r.ok]
    by_turn = {k: [r.ttft_s for r in ok if r.turn == k] for k in range(turns)}
    later = [r.ttft_s for r in ok if r.turn >= 1]
    out_tokens = sum(len(r.output) for r in ok)
    hits = run["hits"]
    kv_q = hits.get("kv:hit", 0) + hits.get("kv:miss", 0)
    st_q = hits.get("state:hit", 0) + hits.get("state:miss", 0)
    return {
        "requests": len(results), "failed_requests": len(results) - len(ok), "wall_s": run["wall_s"],
        "ttft_by_turn": {k + 1: {"p50": quantile(v, .5), "p90": quantile(v, .9), "p99": quantile(v, .99), "n": len(v)}
                         for k, v in by_turn.items() if v},
        "ttft_p50_turn2plus": quantile(later, .5), "ttft_p90_turn2plus": quantile(later, .9),
        "tpot_p50": quantile([r.tpot_s for r in ok], .5), "tpot_p99": quantile([r.tpot_s for r in ok], .99),
        "output_tokens_per_s": out_tokens / run["wall_s"], "requests_per_s": len(ok) / run["wall_s"],
        "prefill_computed_per_request": statistics.fmean([r.prefill_computed for r in ok]) if ok else math.nan,
        "store_kv_hit_rate": hits.get("kv:hit", 0) / kv_q if kv_q else None,
        "store_state_hit_rate": hits.get("state:hit", 0) / st_q if st_q else None,
        "decode_tax": decode_tax(run["steps"]),
        "killed": run["killed"],
        "connector_events": {k: v for k, v in run["events"].items() if v},
        "connector_costs": run["costs"],
        "engine_phases_s": run.get("phases") or {},
        "probe": run.get("probe"),
        "requests_detail": [{"conversation": r.conversation, "turn": r.turn + 1, "replica": r.replica,
                             "prompt": len(r.prompt), "cached": r.cached_tokens, "ttft_ms": round(r.ttft_s * 1e3, 1),
                             "tpot_ms": round(r.tpot_s * 1e3, 2), "error": r.error} for r in results],
    }


def decode_tax(steps: dict[str, float]) -> dict[str, Any] | None:
    """Mean decode step with a load in flight over the mean without, per batch size, and their mean
    weighted by the loading steps (the steps a load could have slowed)."""
    per: dict[str, dict[str, float]] = {}
    for key, value in steps.items():
        flag, batch, kind = key.split(":")
        per.setdefault(batch, {})[f"{flag}:{kind}"] = value
    rows = {}
    weight = weighted = 0.0
    for batch, d in per.items():
        ny, nn = d.get("yes:n", 0), d.get("no:n", 0)
        if ny and nn:
            ratio = (d["yes:s"] / ny) / (d["no:s"] / nn)
            rows[batch] = {"loading_steps": ny, "other_steps": nn, "loading_ms": 1e3 * d["yes:s"] / ny,
                           "other_ms": 1e3 * d["no:s"] / nn, "ratio": ratio}
            weight += ny
            weighted += ny * ratio
    if not rows:
        return None
    return {"ratio": weighted / weight, "by_batch": rows}


def compare_tokens(side: list[Result], alone: list[Result], tie: float) -> dict[str, int]:
    """Requests (same conversation, turn and prompt) whose tokens differ from vLLM alone's: at a near
    tie (both runs' log-probabilities of the two choices within ``tie``) or not (wrong tokens)."""
    reference = {(r.conversation, r.turn): r for r in alone if r.ok}
    same = ties = wrong = wrong_tokens = compared = 0
    for r in side:
        ref = reference.get((r.conversation, r.turn))
        if ref is None or not r.ok or ref.prompt != r.prompt:
            continue  # an earlier turn diverged (its prompt differs) or failed: nothing to compare
        compared += 1
        if r.output == ref.output:
            same += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(r.output, ref.output)) if a != b)
        a, b = r.output[i], ref.output[i]
        mine = r.top_logprobs[i] if i < len(r.top_logprobs) else {}
        theirs = ref.top_logprobs[i] if i < len(ref.top_logprobs) else {}
        if (b in mine and a in theirs and mine[a] - mine[b] <= tie and theirs[b] - theirs[a] <= tie):
            ties += 1
        else:
            wrong += 1
            wrong_tokens += sum(x != y for x, y in zip(r.output[i:], ref.output[i:]))
    return {"compared": compared, "same": same, "near_ties": ties, "wrong_requests": wrong, "wrong_tokens": wrong_tokens}


# ---------------------------------------------------------------- the run


def run_side(side_name: str, model: Model, trace: Trace, args: argparse.Namespace, tmp: Path, rep: int,
             kill: bool = False) -> dict[int, dict[str, Any]] | str:
    """Every concurrency on one freshly started side; or the exact error of a side that cannot run."""
    side = SIDES[side_name](args.connector_extra)
    tag = f"{model.name}-{side_name}-{rep}{'-kill' if kill else ''}"
    h.progress(f"{tag}: starting ({side.description})")
    try:
        backends = side.start(tmp, model, args.device)
    except SideUnavailable as err:
        return str(err)
    try:
        replicas = start_replicas(2, tmp, model, backends, device=args.device, max_model_len=args.max_model_len,
                                  kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=args.max_num_seqs, tag=tag)
    except SideUnavailable as err:
        backends.stop()
        return str(err)
    try:
        asyncio.run(_warm(replicas, model.name))
        runs = {}
        levels = [args.kill_concurrency] if kill else args.concurrency
        for c in levels:
            runs[c] = run_once(trace, replicas, model, backends, concurrency=c, salt=f"{model.name}-r{rep}-c{c}",
                               label=f"{tag} c={c}", timeout_s=args.timeout_s, kill_after=0.4 if kill else None,
                               probe_url=args.probe_url)
        return runs
    finally:
        stop([r.proc for r in replicas])
        backends.stop()
        keep_logs(tmp, args.out / "logs" / tag)


def keep_logs(tmp: Path, dest: Path) -> None:
    """The run's replica, store and proxy logs, moved where the results go (what a failed request
    or a slow run is read from afterwards)."""
    dest.mkdir(parents=True, exist_ok=True)
    for log in tmp.glob("*.log"):
        log.rename(dest / log.name)


async def _warm(replicas: Sequence[Replica], model: str) -> None:
    """One unmeasured request per replica (its own salt): an engine's first requests pay one-off costs."""
    import aiohttp

    from _serving_load import complete

    async with aiohttp.ClientSession() as session:
        for i, r in enumerate(replicas):
            res = Result(conversation=-1, turn=0, replica=i, prompt=list(range(1, 65)), answer_tokens=4)
            await complete(session, r.url, model, res, "warmup", 0, 600)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    h.progress(f"models {args.models}, sides {args.sides}, concurrency {args.concurrency}, "
               f"{args.conversations} conversations x {args.turns} turns, {args.reps} rep(s)")
    report: dict[str, Any] = {"machine": h.machine_note(), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                     for k, v in vars(args).items()},
                              "unavailable": {}, "cells": []}
    with tempfile.TemporaryDirectory(prefix="vllm-serving-") as tmpdir:
        tmp = Path(tmpdir)
        probe_store: list[subprocess.Popen[bytes]] = []
        if args.probe:
            (tmp / "probe").mkdir()
            urls, probe_store = prefixstore_nodes(1, tmp / "probe")
            args.probe_url = urls[0]
            report["probe_idle"] = end_probe(start_probe(urls[0]))  # the machine with nothing else running
            h.progress(f"probe store {urls[0]}, idle: {report['probe_idle']}")
        try:
            run_models(args, tmp, report)
        finally:
            stop(probe_store)
    report["summary"] = summary(report["cells"])
    h.write_json(args.out, "vllm_serving", report)
    print_tables(report)
    plot(report, args.out / "vllm_serving.png")
    return 0


def run_models(args: argparse.Namespace, tmp: Path, report: dict[str, Any]) -> None:
    """Every model: its trace, every side rep by rep (and the killed-store run); cells into ``report``."""
    for model_name in args.models:
        model = build_model(model_name, tmp / "models", args.max_model_len)
        trace = build_trace(seed=args.seed, conversations=args.conversations, turns=args.turns,
                            systems=args.systems, system_tokens=args.system_tokens, zipf_s=args.zipf,
                            rate_per_s=args.rate, max_user_tokens=args.max_user_tokens,
                            max_answer_tokens=args.max_answer_tokens, max_model_len=args.max_model_len)
        h.progress(f"{model_name}: {trace.num_requests} requests per run, longest prompt {trace.max_prompt()}")
        tie = args.tie_logprob if args.tie_logprob is not None else (0.3 if model.dtype == "bfloat16" else 0.02)
        collected: dict[str, list[dict[int, dict[str, Any]]]] = {}
        for rep in range(args.reps):
            order = args.sides if rep % 2 == 0 else ["vllm", *reversed(args.sides[1:])]
            for side_name in order:
                out = run_side(side_name, model, trace, args, tmp, rep)
                if isinstance(out, str):
                    h.progress(f"{model_name}/{side_name}: unavailable: " + out.replace("\n", "\n    "))
                    report["unavailable"][side_name] = out
                    continue
                collected.setdefault(side_name, []).append(out)
        if args.kill_store and "store" in collected:
            out = run_side("store", model, trace, args, tmp, 0, kill=True)
            if not isinstance(out, str):
                collected["store-killed"] = [out]
        report["cells"] += cells_of(model, collected, args, tie)


def cells_of(model: Model, collected: dict[str, list[dict[int, dict[str, Any]]]], args: argparse.Namespace,
             tie: float) -> list[dict[str, Any]]:
    """One cell per (concurrency, side): each rep's figures, their medians, tokens against vLLM alone."""
    cells = []
    alone = collected.get("vllm", [])
    for side_name, reps in collected.items():
        for c in sorted({c for rep in reps for c in rep}):
            per_rep = [figures(rep[c], args.turns) for rep in reps if c in rep]
            tokens = [compare_tokens(rep[c]["results"], alone[min(i, len(alone) - 1)][c]["results"], tie)
                      for i, rep in enumerate(reps) if c in rep and alone and c in alone[0]]
            if side_name == "vllm" and len(reps) > 1:  # vLLM alone against itself: its own run-to-run noise
                tokens = [compare_tokens(reps[1][c]["results"], reps[0][c]["results"], tie)]
            cells.append({"model": model.name, "concurrency": c, "side": side_name, "reps": per_rep,
                          "median": _median_figures(per_rep), "tokens": _sum_dicts(tokens)})
    return cells


def _median_figures(per_rep: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("ttft_p50_turn2plus", "ttft_p90_turn2plus", "tpot_p50", "tpot_p99", "output_tokens_per_s",
            "requests_per_s", "prefill_computed_per_request", "store_kv_hit_rate", "store_state_hit_rate")
    out: dict[str, Any] = {}
    for k in keys:
        vals = [r[k] for r in per_rep if r.get(k) is not None and not math.isnan(r[k])]
        out[k] = statistics.median(vals) if vals else None
    out["failed_requests"] = sum(r["failed_requests"] for r in per_rep)
    probes = [r["probe"]["p99_ms"] for r in per_rep if r.get("probe") and "p99_ms" in r["probe"]]
    out["probe_p99_ms"] = statistics.median(probes) if probes else None
    taxes = [r["decode_tax"]["ratio"] for r in per_rep if r.get("decode_tax")]
    out["decode_tax"] = statistics.median(taxes) if taxes else None
    for phase in ENGINE_PHASES:
        vals = [r["engine_phases_s"][phase] for r in per_rep if phase in r.get("engine_phases_s", {})]
        out[f"{phase}_mean"] = statistics.median(vals) if vals else None
    turns = sorted({t for r in per_rep for t in r["ttft_by_turn"]})
    out["ttft_p50_by_turn"] = {t: statistics.median([r["ttft_by_turn"][t]["p50"] for r in per_rep
                                                     if t in r["ttft_by_turn"]]) for t in turns}
    return out


def _sum_dicts(ds: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def ratios(cell: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    """A side's figures against vLLM alone's (same model, concurrency): speed-ups above 1 are better,
    ``tpot_p99_ratio`` below 1 is better."""
    m, a = cell["median"], alone["median"]

    def div(x: float | None, y: float | None) -> float | None:
        return x / y if x and y else None

    return {"ttft_p50_ratio_turn2plus": div(a["ttft_p50_turn2plus"], m["ttft_p50_turn2plus"]),
            "tpot_p99_ratio": div(m["tpot_p99"], a["tpot_p99"]),
            "throughput_ratio": div(m["output_tokens_per_s"], a["output_tokens_per_s"]),
            "decode_step_tax": m["decode_tax"],
            "wrong_tokens": cell["tokens"].get("wrong_tokens", 0),
            "near_ties": cell["tokens"].get("near_ties", 0),
            "failed_requests": m["failed_requests"]}


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    index = {(c["model"], c["concurrency"], c["side"]): c for c in cells}
    out: dict[str, Any] = {"by_cell": []}
    for c in cells:
        alone = index.get((c["model"], c["concurrency"], "vllm"))
        if c["side"] != "vllm" and alone is not None:
            out["by_cell"].append({"model": c["model"], "concurrency": c["concurrency"], "side": c["side"],
                                   **ratios(c, alone)})
    head = next((r for r in out["by_cell"] if (r["model"], r["concurrency"], r["side"]) == (*HEADLINE, "store")), None)
    if head is None:  # a run without the headline cell: the store side's largest concurrency of its first model
        stores = [r for r in out["by_cell"] if r["side"] == "store"]
        head = stores[-1] if stores else None
    if head is not None:
        out.update({k: head[k] for k in ("ttft_p50_ratio_turn2plus", "tpot_p99_ratio", "throughput_ratio",
                                         "decode_step_tax")})
        out["headline_cell"] = {"model": head["model"], "concurrency": head["concurrency"]}
    out["wrong_tokens"] = sum(r["wrong_tokens"] for r in out["by_cell"])
    out["failed_requests"] = sum(r["failed_requests"] for r in out["by_cell"])
    return out


def print_tables(report: dict[str, Any]) -> None:
    rows = []
    for c in report["cells"]:
        m = c["median"]
        rows.append([c["model"], c["concurrency"], c["side"], _ms(m["ttft_p50_turn2plus"]), _ms(m["ttft_p90_turn2plus"]),
                     _ms(m["tpot_p50"]), _ms(m["tpot_p99"]), _num(m["output_tokens_per_s"]), _num(m["requests_per_s"]),
                     _num(m["prefill_computed_per_request"]), _pct(m["store_kv_hit_rate"]),
                     _pct(m["store_state_hit_rate"]), _num(m["decode_tax"]),
                     f"{c['tokens'].get('same', 0)}/{c['tokens'].get('compared', 0)}",
                     c["tokens"].get("wrong_tokens", 0), m["failed_requests"], _num(m.get("probe_p99_ms"))])
    h.print_table("vLLM serving: medians over reps (TTFT of turns 2+, ms; TPOT ms; decode tax: a decode step with a "
                  "load in flight / one without; probe p99: ms of a lookup to a store no engine uses, meanwhile)",
                  ["model", "conc", "side", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p99", "out tok/s", "req/s",
                   "prefill/req", "store KV hit", "store state hit", "decode tax", "same tokens", "wrong tok",
                   "failed", "probe p99"], rows)
    h.print_table("Where the first token's time goes, by vLLM's own histograms (mean ms a request, all turns): "
                  "queued (to first scheduled: lookups, hybrid loads, a full batch), prefill (scheduled to first "
                  "token), the engine's TTFT (arrival to first token)",
                  ["model", "conc", "side", "queued", "prefill", "engine TTFT"],
                  [[c["model"], c["concurrency"], c["side"], _ms(c["median"].get("queue_mean")),
                    _ms(c["median"].get("prefill_mean")), _ms(c["median"].get("engine_ttft_mean"))]
                   for c in report["cells"]])
    if report.get("probe_idle"):
        print(f"probe with nothing else running: {report['probe_idle']}")
    rows = [[r["model"], r["concurrency"], r["side"], _num(r["ttft_p50_ratio_turn2plus"]), _num(r["tpot_p99_ratio"]),
             _num(r["throughput_ratio"]), _num(r["decode_step_tax"]), r["wrong_tokens"], r["near_ties"],
             r["failed_requests"]] for r in report["summary"]["by_cell"]]
    if rows:  # a run of vLLM alone has nothing to compare
        h.print_table("Against vLLM alone (same model, concurrency, run)",
                      ["model", "conc", "side", "TTFT p50 turns 2+ (x faster)", "TPOT p99 (x alone)", "out tok/s (x)",
                       "decode tax", "wrong tok", "near ties", "failed"], rows)
    for side, why in report["unavailable"].items():
        print(f"{side}: unavailable here: {why.splitlines()[0]}")


def _ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 1e3:.0f}"


def _num(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def plot(report: dict[str, Any], path: Path) -> None:
    plt = h.pyplot()
    models = sorted({c["model"] for c in report["cells"]})
    panels = (("ttft_p50_turn2plus", "TTFT p50, turns 2+ (s)"), ("output_tokens_per_s", "output tokens/s"),
              ("tpot_p99", "TPOT p99 (s)"))
    fig, axes = plt.subplots(len(models), len(panels), figsize=(4.2 * len(panels), 3.2 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, (key, title) in enumerate(panels):
            ax = axes[i][j]
            for side in sorted({c["side"] for c in report["cells"] if c["model"] == model}):
                pts = sorted((c["concurrency"], c["median"][key]) for c in report["cells"]
                             if c["model"] == model and c["side"] == side and c["median"][key] is not None
                             and not side.endswith("killed"))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=side)
            ax.set_title(f"{model}: {title}", fontsize=9)
            ax.set_xlabel("conversations in flight")
            ax.grid(alpha=.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    h.save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
