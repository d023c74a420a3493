"""Can a tenant tell, by timing, whether another tenant stored a prompt? (tenant isolation)

A namespace id is the hash of public fields, so tenant beta can compute tenant alpha's hash
chain for any prompt it guesses and replay it in a lookup under its own namespace. The answers
are identical whether alpha stored the prompt or not (tests/security/test_adversary.py); this
measures whether their *latency* differs.

What it does: starts a store in a child process with two tenants; alpha saves ``--prompts``
prompts of ``--tokens`` tokens; then beta sends, interleaved one by one, a replay of a stored
prompt's chain and one of a never-stored prompt's chain (the same length), ``--reps`` times each,
over one kept-alive connection. Reports the median and p10/p90 of each class and their ratio,
with alpha's own lookups of its stored prompts as a reference (those do match). Also times the
refusal of a hostile namespace registration (3.5M state shapes in a 10.5 MB frame; one such froze
a store for 14 s). Writes tenant_oracle.json and tenant_oracle.png (latency CDFs) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

import _harness as H
from prefixstore.client import ClientConfig, PrefixClient, Prompt
from prefixstore.protocol import KVLayout, Namespace, StateLayout
from prefixstore.protocol.wire import CONTENT_TYPE, decode_frame, encode_frame
from prefixstore.store.tenants import token_sha256

TOKENS = {"alpha": "bench-alpha-0123456789abcdef", "beta": "bench-beta-fedcba9876543210"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/tenant_oracle.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    H.add_common_args(p, reps="2000 per class", warmup="200")
    p.add_argument("--prompts", type=int, default=None, help="Prompts alpha stores. Default: 64 (8 with --quick).")
    p.add_argument("--tokens", type=int, default=None,
                   help="Tokens per prompt (B = 16). Default: 4096 (256 with --quick).")
    return p.parse_args(argv)


def namespace(tenant: str) -> Namespace:
    return Namespace(model="oracle-bench", kv=KVLayout(num_layers=2, num_heads=1, head_dim=16),
                     state=StateLayout(num_layers=1, shapes=((64,),)), block_tokens=16, tenant=tenant)


async def timed_lookup(session: aiohttp.ClientSession, url: str, tenant: str, ns_id: bytes, prompt: Prompt
                       ) -> tuple[float, int]:
    body = encode_frame({"ns": ns_id, "hashes": b"".join(prompt.hashes), "tokens": prompt.packed, "lease": False})
    headers = {"Authorization": f"Bearer {TOKENS[tenant]}", "Content-Type": CONTENT_TYPE}
    t = time.perf_counter()
    async with session.post(url + "/v1/lookup", data=body, headers=headers) as r:
        raw = await r.read()
    elapsed = time.perf_counter() - t
    if r.status != 200:
        raise SystemExit(f"lookup answered {r.status}: {raw[:200]!r}")
    return elapsed, int(decode_frame(raw)[0]["kv_tokens"])  # type: ignore[call-overload]


async def run(args: argparse.Namespace) -> dict[str, object]:
    prompts = args.prompts or (8 if args.quick else 64)
    length = args.tokens or (256 if args.quick else 4096)
    reps = args.reps or (200 if args.quick else 2000)
    warmup = args.warmup if args.warmup is not None else (20 if args.quick else 200)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.toml"
        tenants.write_text("".join(f'[tenants.{t}]\ntoken_sha256 = "{token_sha256(tok)}"\n' for t, tok in TOKENS.items()))
        async with H.serve_store("subprocess", ram_bytes=256 << 20, page_bytes=64 << 10, tier="ram",
                                 tenants_file=str(tenants)) as rs:
            ns_a, ns_b = namespace("alpha"), namespace("beta")
            stored = [[rng.randrange(50_000) for _ in range(length)] for _ in range(prompts)]
            never = [[rng.randrange(50_000) for _ in range(length)] for _ in range(prompts)]
            H.progress(f"alpha saves {prompts} prompts of {length} tokens")
            async with PrefixClient(ns_a, ClientConfig(url=rs.url, token=TOKENS["alpha"])) as a, \
                    PrefixClient(ns_b, ClientConfig(url=rs.url, token=TOKENS["beta"])) as b:
                for toks in stored:
                    res = await a.save(a.prompt(toks), length, lambda s, e: bytes(ns_a.kv.payload_bytes(e - s)),
                                       snapshots={length: bytes(ns_a.state.snapshot_bytes)})
                    if res.dropped or res.rejected:
                        raise SystemExit(f"alpha's save failed: {res}")
                await b.lookup([1])  # registers beta's namespace
            samples = {k: H.Samples(k) for k in ("replay of a stored prompt", "replay of a never-stored prompt",
                                                  "alpha's own lookup (reference)")}
            async with aiohttp.ClientSession() as session:
                for i in range(warmup + reps):
                    j = rng.randrange(prompts)
                    order = [("replay of a stored prompt", "beta", ns_b.id, Prompt(ns_a, stored[j])),
                             ("replay of a never-stored prompt", "beta", ns_b.id, Prompt(ns_a, never[j])),
                             ("alpha's own lookup (reference)", "alpha", ns_a.id, Prompt(ns_a, stored[j]))]
                    rng.shuffle(order)
                    for name, tenant, ns_id, prompt in order:
                        elapsed, kv = await timed_lookup(session, rs.url, tenant, ns_id, prompt)
                        if tenant == "beta" and kv:
                            raise SystemExit(f"a replayed chain matched {kv} tokens: isolation is broken")
                        if i >= warmup:
                            samples[name].add(elapsed)
                    if i and i % 500 == 0:
                        H.progress(f"{i}/{warmup + reps} rounds")
            refusals = H.Samples("hostile namespace registration refused")
            huge = namespace("beta").to_wire()
            huge[5] = [4, [[1, 1]] * 3_500_000, "float16"]  # type: ignore[index]
            frame = encode_frame({"namespace": huge})
            host, port = rs.url.removeprefix("http://").split(":")
            head = (f"POST /v1/namespaces HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKENS['beta']}\r\n"
                    f"Content-Type: {CONTENT_TYPE}\r\nContent-Length: {len(frame)}\r\n\r\n").encode()
            for _ in range(5 if args.quick else 20):
                # The head, then the first 64 KiB of the body; timed until the status line arrives.
                reader, writer = await asyncio.open_connection(host, int(port))
                t = time.perf_counter()
                writer.write(head + frame[: 64 << 10])
                status = await reader.readline()
                refusals.add(time.perf_counter() - t)
                writer.close()
                if b" 413 " not in status:
                    raise SystemExit(f"the hostile namespace was answered {status!r}, not 413")
            H.progress(f"hostile {len(frame) / 1e6:.1f} MB namespace registration refused (413) in "
                       f"{refusals.median * 1e3:.2f} ms (median of {len(refusals.values)}: head + 64 KiB sent, "
                       "until the status line)")
    base = samples["replay of a never-stored prompt"].median
    rows = [[name, round(s.median * 1e3, 4), round(s.quantile(0.1) * 1e3, 4), round(s.quantile(0.9) * 1e3, 4),
             round(s.median / base, 3)] for name, s in samples.items()]
    H.print_table(f"lookup latency, {length}-token prompts, {reps} per class (loopback, store in a child process)",
                  ["lookup", "median ms", "p10 ms", "p90 ms", "median / never-stored replay"], rows)
    return {"benchmark": "tenant_oracle", "machine": H.machine_note(), "prompts": prompts, "tokens": length, "reps": reps,
            "results": {name: s.summary_ms() for name, s in samples.items()},
            "hostile_namespace_refusal": refusals.summary_ms(),
            "raw_ms": {name: [v * 1e3 for v in s.values] for name, s in samples.items()}}


def plot(result: dict[str, object], path: Path) -> None:
    plt = H.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    raw: dict[str, list[float]] = result["raw_ms"]  # type: ignore[assignment]
    for name, values in raw.items():
        v = sorted(values)
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("lookup latency (ms, log scale)")
    ax.set_ylabel("fraction of lookups")
    ax.set_title(f"Replaying another tenant's hash chain: {result['tokens']}-token prompts")
    ax.legend(fontsize=8)
    H.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args))
    H.write_json(args.out, "tenant_oracle", result)
    plot(result, args.out / "tenant_oracle.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
