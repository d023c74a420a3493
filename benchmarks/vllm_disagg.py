"""Prefill/decode disaggregation through prefixstore against one vLLM instance doing both.

What runs, per model: one ``prefixstore serve``; a prefill instance (``kv_role: kv_producer``,
tensor-parallel size ``--prefill-tp``, vLLM block size ``--prefill-block-size``); a decode instance
(``kv_consumer``, ``--decode-tp``, ``--decode-block-size``); and, for the baseline, one instance of
the decode instance's shape without a connector that does both (vLLM alone). All are vLLM's
OpenAI-compatible servers (benchmarks/_vllm_sides.py starts them as docs/vllm.md says). Each
request of the P/D side takes the flow of vLLM's own disaggregation examples, as
examples/pd_proxy.py does (its functions, loaded from that file): the prompt to the prefill
instance with ``max_tokens=1``, its answer's ``kv_transfer_params`` to the decode instance with the
same prompt, which loads it from the store (waiting for the prefill's commit, ``commit_wait_s``)
and generates.

Figures per model and prompt length (a fresh random prompt per repetition, greedy decoding, end of
sequence ignored):

* one instance: time to first token (TTFT) of vLLM alone doing prefill and decode;
* P/D: the prefill call's duration plus the decode instance's TTFT (what the user waits for);
* decode-side TTFT: the decode instance's own TTFT with the load, against the same decode instance
  recomputing the same prompt itself (another ``cache_salt``: nothing in the store matches); the
  load's TTFT includes its wait for the prefill's commit (the prefill answers as its step ends,
  its save still on its way), which is also reported apart (``commit wait``: its connector's
  ``prefixstore_vllm_commit_wait_seconds_total``), and the load without it;
* the tokens the decode instance loaded from the store (its connector's
  ``prefixstore_vllm_loaded_tokens_total``: vLLM reports a disaggregated request's cached tokens as
  the prefill instance's own hits), the waits for a commit and their timeouts (its connector's
  counters), and whether it generates the one instance's tokens.

    python benchmarks/vllm_disagg.py --quick                      # a smoke run (tests/vllm/test_disagg_serving.py)
    python benchmarks/vllm_disagg.py --models wide                # the headline: 1k-8k-token prompts

Writes ``vllm_disagg.json`` and ``vllm_disagg.png`` into ``--out``; every server's log into
``--out``/logs.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h
import aiohttp
import numpy as np
from _cluster import free_ports
from _serving_load import VOCAB, Result, complete, completion_body
from _vllm_sides import MODELS, Model, build_model, prefixstore_nodes, scrape, spawn, stop, tail, wait_http


def _proxy() -> Any:
    """examples/pd_proxy.py: the proxy flow, one definition for users and this benchmark."""
    path = h.HERE.parent / "examples" / "pd_proxy.py"
    spec = importlib.util.spec_from_file_location("pd_proxy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PD = _proxy()


@dataclass
class Server:
    url: str
    proc: Any
    log: Path
    tag: str


def launch_server(logs: Path, model: Model, *, port: int, tp: int, block_size: int, role: str | None, store: str,
                  max_model_len: int, kv_cache_tokens: int, commit_wait_s: float, cores: str, tag: str) -> Server:
    """One OpenAI-compatible vLLM server on ``port``, started (:func:`ready` waits for it).
    ``role``: the connector's kv_role (None: no connector). ``cores``: ``VLLM_CPU_OMP_THREADS_BIND``
    (one core list per rank, ``|``-separated)."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": "1"}
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model.path,
            "--served-model-name", model.name, "--skip-tokenizer-init", "--port", str(port),
            "--max-model-len", str(max_model_len), "--block-size", str(block_size), "--dtype", model.dtype,
            "--enable-prefix-caching", "--mamba-cache-mode", "align", "--max-num-seqs", "4",
            "--enable-prompt-tokens-details", "--seed", "0", "--disable-uvicorn-access-log",
            "--tensor-parallel-size", str(tp), "--enforce-eager",
            "--kv-cache-memory-bytes", str(kv_cache_tokens * model.kv_bytes_per_token // tp), *model.extra_args]
    if tp > 1:
        args += ["--distributed-executor-backend", "mp"]
    if role is not None:
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "PrefixStoreConnector", "kv_role": role,
            "kv_connector_module_path": "prefixstore.client.vllm.connector",
            "kv_connector_extra_config": {"url": store, "model_id": model.model_id, "commit_wait_s": commit_wait_s}})]
    log = logs / f"{tag}.log"
    return Server(url=f"http://127.0.0.1:{port}", proc=spawn(args, log, env), log=log, tag=tag)


def ready(servers: list[Server], deadline_s: float = 900) -> None:
    """Wait for every server of ``servers``, started together: they start side by side, since a
    start leaves a core idle much of the time (one process importing). All are watched at once: the
    first that exits, or any still not up after ``deadline_s``, stops them all, named with its
    log's last lines."""
    deadline = time.monotonic() + deadline_s
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            failed = None
            if server.proc.poll() is not None:
                failed = f"vLLM {server.tag} exited with status {server.proc.returncode} before it was up"
            elif time.monotonic() > deadline:
                failed = f"vLLM {server.tag} not up within {deadline_s:g} s"
            else:
                try:
                    wait_http(server.url + "/health", 0, server.proc, f"vLLM {server.tag}")  # one try
                    waiting.remove(server)
                except RuntimeError:
                    pass  # not up yet
            if failed is not None:
                stop([s.proc for s in servers])
                raise RuntimeError(f"{failed}; its log's last lines:\n{tail(server.log)}")
        time.sleep(0.2)


@dataclass
class Row:
    """One prompt: the three ways of serving it."""

    length: int
    rep: int
    one: Result
    decode_load: Result
    decode_recompute: Result
    prefill_s: float
    handoff: dict[str, object] = field(default_factory=dict)
    commit_wait_s: float = 0.0
    """How long the decode instance's load waited for the prefill's save to be committed (its
    connector's counter): part of its TTFT, the price of a handoff through a store."""
    loaded_tokens: float = 0.0
    """Tokens the decode instance's loads wrote for this prompt (its connector's counter): vLLM
    reports a disaggregated request's cached tokens as the prefill instance's own hits."""

    @property
    def pd_ttft_s(self) -> float:
        return self.prefill_s + self.decode_load.ttft_s


def prompt_of(seed: int, length: int, rep: int) -> list[int]:
    rng = np.random.default_rng([seed, length, rep])
    return [int(t) for t in rng.integers(1, VOCAB, length)]


async def serve_one(session: aiohttp.ClientSession, model: Model, one: Server, prefill: Server, decode: Server,
                    length: int, rep: int, args: argparse.Namespace, run: str) -> Row:
    prompt = prompt_of(args.seed, length, rep)
    n = args.answer_tokens

    def result() -> Result:
        return Result(conversation=rep, turn=0, replica=0, prompt=prompt, answer_tokens=n)

    alone, loaded, recomputed = result(), result(), result()
    await complete(session, one.url, model.name, alone, f"{run}-one", args.logprobs, args.timeout_s)
    body = completion_body(model.name, prompt, n, f"{run}-pd", args.logprobs)
    started = time.perf_counter()
    handoff = await PD.prefill(session, prefill.url, "/v1/completions", body)
    prefill_s = time.perf_counter() - started
    before = counter(decode.url, "prefixstore_vllm_loaded_tokens_total")
    waited = counter(decode.url, "prefixstore_vllm_commit_wait_seconds_total")
    await complete(session, decode.url, model.name, loaded, f"{run}-pd", args.logprobs, args.timeout_s,
                   extra={"kv_transfer_params": handoff} if handoff else None)
    after = await settled(lambda: counter(decode.url, "prefixstore_vllm_loaded_tokens_total"), before)
    waited = counter(decode.url, "prefixstore_vllm_commit_wait_seconds_total") - waited
    await complete(session, decode.url, model.name, recomputed, f"{run}-recompute", args.logprobs, args.timeout_s)
    return Row(length=length, rep=rep, one=alone, decode_load=loaded, decode_recompute=recomputed,
               prefill_s=prefill_s, handoff=handoff, loaded_tokens=after - before, commit_wait_s=waited)


def counter(url: str, name: str) -> float:
    """A counter of a server's /metrics, summed over its label sets."""
    return sum(v for k, v in scrape(url + "/metrics").items() if k == name or k.startswith(name + "{"))


async def settled(read: Any, before: float, bound_s: float = 3.0) -> float:
    """``read()`` once it moved from ``before`` (vLLM publishes the connector's counters with a
    step's outputs, a moment after the answer), or its value after ``bound_s``."""
    deadline = time.monotonic() + bound_s
    value = read()
    while value == before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        value = read()
    return float(value)


def same_tokens(a: Result, b: Result, tie: float) -> str:
    """'same', 'tie' (the first difference a greedy near tie on both sides), or 'different'."""
    if a.output == b.output:
        return "same"
    i = next(i for i, (x, y) in enumerate(zip(a.output, b.output)) if x != y) if len(a.output) == len(b.output) \
        else min(len(a.output), len(b.output))
    if i >= min(len(a.top_logprobs), len(b.top_logprobs)) or i >= min(len(a.output), len(b.output)):
        return "different"
    x, y, la, lb = a.output[i], b.output[i], a.top_logprobs[i], b.top_logprobs[i]
    if y in la and x in lb and la[x] - la[y] <= tie and lb[y] - lb[x] <= tie:
        return "tie"
    return "different"


def events(url: str) -> dict[str, float]:
    """The decode instance's connector counters (``prefixstore_vllm_events_total`` by event)."""
    out: dict[str, float] = {}
    for key, value in scrape(url + "/metrics").items():
        if key.startswith("prefixstore_vllm_events_total{") and 'event="' in key:
            event = key.split('event="', 1)[1].split('"', 1)[0]
            out[event] = out.get(event, 0.0) + value
    return out


def run_model(kind: str, args: argparse.Namespace, tmp: Path, logs: Path) -> dict[str, object]:
    model = build_model(kind, tmp / "models", args.max_model_len)
    cores = [str(c) for c in range(os.cpu_count() or 1)]
    urls, store_procs = prefixstore_nodes(1, tmp)
    procs = list(store_procs)
    blocks = (args.prefill_block_size, args.decode_block_size)
    try:
        h.progress(f"{kind}: starting the prefill instance (TP={args.prefill_tp}, block {blocks[0]}), the decode "
                   f"instance (TP={args.decode_tp}, block {blocks[1]}) and one instance doing both")
        ports = free_ports(3)  # at once: the servers start side by side and bind later (distinct ports)
        common = dict(store=urls[0], max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens,
                      commit_wait_s=args.commit_wait_s)
        prefill = launch_server(logs, model, port=ports[0], tp=args.prefill_tp, block_size=blocks[0], role="kv_producer",
                                cores="|".join(cores[i % len(cores)] for i in range(args.prefill_tp)),
                                tag=f"{kind}-prefill", **common)  # type: ignore[arg-type]
        procs.append(prefill.proc)
        decode = launch_server(logs, model, port=ports[1], tp=args.decode_tp, block_size=blocks[1], role="kv_consumer",
                               cores="|".join(cores[(i + 1) % len(cores)] for i in range(args.decode_tp)),
                               tag=f"{kind}-decode", **common)  # type: ignore[arg-type]
        procs.append(decode.proc)
        one = launch_server(logs, model, port=ports[2], tp=args.decode_tp, block_size=blocks[1], role=None,
                            cores="|".join(cores[i % len(cores)] for i in range(args.decode_tp)),
                            tag=f"{kind}-one", **common)  # type: ignore[arg-type]
        procs.append(one.proc)
        ready([prefill, decode, one])
        rows: list[Row] = []

        async def drive() -> None:
            async with aiohttp.ClientSession() as session:
                for length in args.lengths:
                    for rep in range(args.warmup + args.reps):
                        row = await serve_one(session, model, one, prefill, decode, length, rep, args, f"{kind}-{rep}")
                        if rep >= args.warmup:
                            rows.append(row)
                        bad = [r.error for r in (row.one, row.decode_load, row.decode_recompute) if r.error]
                        h.progress(f"{kind} {length} tokens rep {rep}: one {row.one.ttft_s * 1e3:.0f} ms, "
                                   f"P/D {row.pd_ttft_s * 1e3:.0f} ms (prefill {row.prefill_s * 1e3:.0f}), "
                                   f"decode load {row.decode_load.ttft_s * 1e3:.0f} ms / recompute "
                                   f"{row.decode_recompute.ttft_s * 1e3:.0f} ms, commit wait "
                                   f"{row.commit_wait_s * 1e3:.0f} ms, loaded "
                                   f"{row.loaded_tokens:.0f}{' ERRORS ' + str(bad) if bad else ''}")

        asyncio.run(drive())
        counters = events(decode.url)
    finally:
        stop(procs)
    return {"model": kind, "model_id": model.model_id, "dtype": model.dtype, "events": counters,
            "rows": [row_json(r, args.tie_logprob) for r in rows]}


def row_json(r: Row, tie: float) -> dict[str, object]:
    return {"length": r.length, "rep": r.rep, "prefill_ms": r.prefill_s * 1e3,
            "one_ttft_ms": r.one.ttft_s * 1e3, "pd_ttft_ms": r.pd_ttft_s * 1e3,
            "decode_load_ttft_ms": r.decode_load.ttft_s * 1e3, "decode_recompute_ttft_ms": r.decode_recompute.ttft_s * 1e3,
            "decode_loaded_tokens": r.loaded_tokens, "commit_wait_ms": r.commit_wait_s * 1e3,
            "decode_load_after_commit_ttft_ms": (r.decode_load.ttft_s - r.commit_wait_s) * 1e3, "recompute_cached_tokens": r.decode_recompute.cached_tokens,
            "tokens_vs_one": same_tokens(r.decode_load, r.one, tie), "handoff": r.handoff,
            "errors": [x.error for x in (r.one, r.decode_load, r.decode_recompute) if x.error],
            "one_tokens": r.one.output, "decode_tokens": r.decode_load.output}


def summarize(models: list[dict[str, Any]]) -> list[list[object]]:
    table = []
    for m in models:
        for length in sorted({r["length"] for r in m["rows"]}):
            rows = [r for r in m["rows"] if r["length"] == length]

            def med(key: str) -> float:
                return statistics.median(r[key] for r in rows)

            table.append([m["model"], length, med("one_ttft_ms"), med("pd_ttft_ms"), med("prefill_ms"),
                          med("commit_wait_ms"), med("decode_load_ttft_ms"), med("decode_load_after_commit_ttft_ms"),
                          med("decode_recompute_ttft_ms"),
                          f"{med('decode_load_after_commit_ttft_ms') / med('decode_recompute_ttft_ms'):.2f}x",
                          f"{min(r['decode_loaded_tokens'] for r in rows):.0f}/{length}",
                          sum(r["tokens_vs_one"] != "different" for r in rows), len(rows)])
    return table


COLUMNS = ("model", "prompt", "one TTFT ms", "P/D TTFT ms", "prefill ms", "commit wait ms", "decode TTFT load ms",
           "decode TTFT load after commit ms", "decode TTFT recompute ms", "load/recompute", "loaded (min)",
           "tokens ok", "n")


def plot(models: list[dict[str, Any]], path: Path) -> None:
    plt = h.pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        lengths = sorted({r["length"] for r in m["rows"]})
        series = {"one instance": "one_ttft_ms", "P/D (prefill + decode TTFT)": "pd_ttft_ms",
                  "decode TTFT, load (with its commit wait)": "decode_load_ttft_ms",
                  "decode TTFT, load after the commit": "decode_load_after_commit_ttft_ms",
                  "decode TTFT, recompute": "decode_recompute_ttft_ms"}
        width = 0.8 / len(series)
        for i, (label, key) in enumerate(series.items()):
            ys = [statistics.median(r[key] for r in m["rows"] if r["length"] == n) for n in lengths]
            ax.bar([x + i * width for x in range(len(lengths))], ys, width, label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(lengths))], [str(n) for n in lengths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{m['model']}: TTFT")
        ax.legend(fontsize=7)
    h.save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_common_args(parser, reps="3 (1 with --quick)", warmup="1 (0 with --quick)")
    parser.add_argument("--models", default=None,
                        help=f"Comma-separated models among {list(MODELS)}. Default: wide (--quick: tiny,gdn).")
    parser.add_argument("--lengths", default=None,
                        help="Comma-separated prompt lengths in tokens. Default: 1024,2048,4096,8192 "
                             "(--quick: 40,75,200: under two decode pages, mid-block, longer).")
    parser.add_argument("--answer-tokens", type=int, default=8, help="Tokens the decode instance generates. Default: 8.")
    parser.add_argument("--prefill-tp", type=int, default=2, help="The prefill instance's tensor-parallel size. Default: 2.")
    parser.add_argument("--decode-tp", type=int, default=1, help="The decode instance's tensor-parallel size. Default: 1.")
    parser.add_argument("--prefill-block-size", type=int, default=32,
                        help="The prefill instance's vLLM block size (tokens). Default: 32.")
    parser.add_argument("--decode-block-size", type=int, default=64,
                        help="The decode instance's vLLM block size (tokens), another than the prefill's. Default: 64.")
    parser.add_argument("--commit-wait-s", type=float, default=10.0,
                        help="The decode instance's commit_wait_s: its longest wait for the prefill's save. Default: 10.")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="vLLM's --max-model-len. Default: the longest prompt plus the answer, rounded up to 1024.")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="Each instance's KV cache in tokens (sets --kv-cache-memory-bytes). Default: 2 x max-model-len.")
    parser.add_argument("--logprobs", type=int, default=3, help="Top log-probabilities returned per token. Default: 3.")
    parser.add_argument("--tie-logprob", type=float, default=0.3,
                        help="A first differing token counts as a near tie (not a wrong token) when both runs' "
                             "top log-probabilities of the two tokens are within this. Default: 0.3 (bfloat16).")
    parser.add_argument("--timeout-s", type=float, default=600, help="Per-request timeout. Default: 600.")
    args = parser.parse_args()
    args.reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    args.models = (args.models or ("tiny,gdn" if args.quick else "wide")).split(",")
    args.lengths = [int(x) for x in (args.lengths or ("40,75,200" if args.quick else "1024,2048,4096,8192")).split(",")]
    longest = max(args.lengths) + args.answer_tokens
    args.max_model_len = args.max_model_len or -(-longest // 1024) * 1024
    args.kv_cache_tokens = args.kv_cache_tokens or 2 * args.max_model_len
    for m in args.models:
        if m not in MODELS:
            parser.error(f"--models: {m!r} is not one of {list(MODELS)}")
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-disagg-"))
    models = []
    try:
        for kind in args.models:
            models.append(run_model(kind, args, tmp, logs))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = summarize(models)
    text = h.print_table("P/D through the store against one instance doing both (medians)", COLUMNS, table)
    h.write_json(args.out, "vllm_disagg", {
        "benchmark": "vllm_disagg", "machine": h.machine_note(), "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "models": models, "table": text})
    plot(models, args.out / "vllm_disagg.png")


if __name__ == "__main__":
    main()
