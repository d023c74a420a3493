"""Soak of issue 30's heap pattern: two tenants pin what they can and never read their gets.

    python benchmarks/pin_soak.py [--duration-s 120] [--quick]

A real ``prefixstore serve`` at its defaults (ram_bytes 256 MiB, read_buffer_bytes 64 MiB,
max_leased_share 0.25, write-behind, LMDB in a temporary directory) with a tenants file of two
tenants (``--quota`` each). Each tenant saves ``--entries`` prompts of one 1 MiB block (together
well over the arena: alpha saves first, so all of its end on disk only, and beta's first
``entries - ram_bytes / 1 MiB``), then, round after round until ``--duration-s``:

* looks up its ``--leases`` most recent prompts with a lease each and never releases them (they
  end when it takes more than its share, or after lease_ttl_s);
* opens ``--connections`` raw connections, each sending one ``/v1/get`` of its disk-only keys and
  never reading the answer, in three shapes taken in turn: the issue's (one key named 200 times),
  the same with one-layer ranges, and wide (``--keys`` distinct keys, 4 times each, a different
  run of keys per connection: enough to fill the arena with pins and push the rest into read
  buffers, and past them);
* holds them ``--hold-s`` seconds, then drops them.

The store's RSS is sampled every 0.25 s, as VmRSS and its parts: anonymous memory (the arena,
the heap, read buffers), file-backed pages (shared libraries, and LMDB's memory map: the pages of
a value copied out are let go, store/heap.py ``unmap_pages``; its B-tree pages stay) and shared
memory. Reported: each idle before the pattern (the arena is resident from start), at its peak
during it, and after the clients left; the bound this soak checks, ``ram_bytes + --overhead``
on VmRSS; the store's read-buffer gauge and refusals. Exit status 1 when the peak is over the
bound or any request was answered 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness as H
from _cluster import free_ports, wait_healthy

from prefixstore.client import ClientConfig, PrefixClient, Prompt
from prefixstore.protocol import KVLayout, Namespace
from prefixstore.protocol.wire import CONTENT_TYPE, GetItem, encode_frame, encode_get_items
from prefixstore.store.tenants import token_sha256

MIB = 1 << 20
BLOCK = 32
TENANTS = {"alpha": "tok-soak-alpha-00112233445566778899", "beta": "tok-soak-beta-99887766554433221100"}
SHAPES = ("one key x200", "one key x200, one layer", "wide")


def namespace(tenant: str) -> Namespace:
    """1 MiB blocks: 32 tokens x 4 layers x 8 KiB."""
    return Namespace(model="pin-soak", kv=KVLayout(num_layers=4, num_heads=8, head_dim=128, dtype="float32"),
                     block_tokens=BLOCK, tenant=tenant)


def tokens_of(n: int) -> list[int]:
    return [n * 1000 + i + 1 for i in range(BLOCK)]


def payload(n: int) -> bytes:
    return (n.to_bytes(4, "little") * (MIB // 4))[:MIB]


def memory(pid: int) -> dict[str, int]:
    text = Path(f"/proc/{pid}/status").read_text()
    out = {}
    for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
        m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
        out[key] = int(m.group(1)) << 10 if m else 0
    return out


def gauge(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        m = re.search(rf"^{name} (\S+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def get_request(url: str, ns: Namespace, token: str, items: list[GetItem]) -> bytes:
    body = encode_frame({"ns": ns.id, **encode_get_items(items)})
    host = url.split("//", 1)[1]
    return (f"POST /v1/get HTTP/1.1\r\nHost: {host}\r\nContent-Type: {CONTENT_TYPE}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def sampler(pid: int, samples: list[tuple[float, dict[str, int]]], t0: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((time.monotonic() - t0, memory(pid)))
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


async def tenant_rounds(url: str, tenant: str, disk_only: int, args: argparse.Namespace, end: float,
                        counts: dict[str, int]) -> None:
    """``disk_only``: how many of the tenant's first prompts are on disk only (what its gets name)."""
    ns, token = namespace(tenant), TENANTS[tenant]
    host, port = url.split("//", 1)[1].split(":")
    async with PrefixClient(ns, ClientConfig(url=url, token=token, data_path="http")) as c:
        shape = 0
        while time.monotonic() < end:
            for n in range(args.entries - args.leases, args.entries):
                await c.lookup(tokens_of(n))  # leased, never released
            counts["leases"] += args.leases
            writers = []
            for k in range(args.connections):
                if SHAPES[shape] == "wide":
                    keys = [Prompt(ns, tokens_of((k * args.keys + j) % disk_only)).block_key(0) for j in range(args.keys)]
                    items = [GetItem(key=key) for key in keys] * 4
                else:
                    key = Prompt(ns, tokens_of(k % disk_only)).block_key(0)
                    items = [GetItem(key=key, layer_start=k % 4, layer_end=k % 4 + 1)
                             if "layer" in SHAPES[shape] else GetItem(key=key)] * 200
                _, writer = await asyncio.open_connection(host, int(port), limit=1 << 16)
                writer.write(get_request(url, ns, token, items))
                await writer.drain()
                writers.append(writer)
            counts["gets"] += len(writers)
            counts[SHAPES[shape]] += 1
            await asyncio.sleep(args.hold_s)
            for w in writers:
                w.close()
            shape = (shape + 1) % len(SHAPES)


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    tenants = tmp / "tenants.toml"
    lines = []
    for name, token in TENANTS.items():
        lines += [f"[tenants.{name}]", f'token_sha256 = "{token_sha256(token)}"', f'quota_bytes = "{args.quota}"']
    tenants.write_text("\n".join(lines) + "\n")
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prefixstore", "serve", "--port", str(port), "--data-dir",
                             str(tmp / "lmdb"), "--tenants-file", str(tenants), *args.serve_flag],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        await asyncio.to_thread(wait_healthy, url, time.monotonic() + 120)
        H.progress(f"store pid {proc.pid} on {url}; each tenant saves {args.entries} x 1 MiB")
        for tenant in TENANTS:
            ns = namespace(tenant)
            async with PrefixClient(ns, ClientConfig(url=url, token=TENANTS[tenant], data_path="http")) as c:
                for n in range(args.entries):
                    res = await c.save(c.prompt(tokens_of(n)), BLOCK, lambda a, b, n=n: payload(n))
                    if res.stored != 1:
                        raise SystemExit(f"{tenant}'s save {n} was not stored: {res}")
            H.progress(f"{tenant}: saved")
        await asyncio.sleep(2.0)  # the write-behind settles; the idle baseline is taken now
        idle = memory(proc.pid)
        ram_bytes = int(gauge(url, "prefixstore_arena_capacity_bytes"))
        H.progress(f"idle RSS {idle['VmRSS'] / MIB:.0f} MiB (arena {ram_bytes / MIB:.0f} MiB); "
                   f"the pattern for {args.duration_s:.0f} s")
        samples: list[tuple[float, dict[str, int]]] = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        watch = asyncio.create_task(sampler(proc.pid, samples, t0, stop))
        counts: dict[str, int] = {"leases": 0, "gets": 0, **{s: 0 for s in SHAPES}}
        end = t0 + args.duration_s
        buffered_peak = 0.0

        scrape_s: list[float] = []

        async def watch_buffers() -> None:
            nonlocal buffered_peak
            while time.monotonic() < end:
                t = time.monotonic()
                buffered_peak = max(buffered_peak, await asyncio.to_thread(gauge, url, "prefixstore_read_buffer_bytes"))
                scrape_s.append(time.monotonic() - t)  # /metrics must keep answering throughout
                await asyncio.sleep(0.5)
                if int(time.monotonic() - t0) % 15 == 0:
                    H.progress(f"{time.monotonic() - t0:5.0f} s: RSS {samples[-1][1]['VmRSS'] / MIB:.0f} MiB, "
                               f"peak {max(s[1]['VmRSS'] for s in samples) / MIB:.0f} MiB")

        on_disk = {"alpha": args.entries, "beta": max(1, args.entries - ram_bytes // MIB)}
        await asyncio.gather(*(tenant_rounds(url, t, on_disk[t], args, end, counts) for t in TENANTS),
                             watch_buffers())
        await asyncio.sleep(args.hold_s + 1.0)  # the last gets' buffers given back
        stop.set()
        await watch
        after = memory(proc.pid)
        refusals = gauge(url, "prefixstore_read_buffer_refusals_total")
        buffered_end = gauge(url, "prefixstore_read_buffer_bytes")
        fivexx = 0.0
        import urllib.request

        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("prefixstore_requests_total") and 'status="5xx"' in line:
                    fivexx += float(line.rsplit(" ", 1)[1])
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp / "serve.log", args.out / "pin_soak.serve.log")  # what the store said, kept
    peak = max(s[1]["VmRSS"] for s in samples)
    bound = ram_bytes + args.overhead
    return {"ram_bytes": ram_bytes, "overhead_bytes": args.overhead, "bound_bytes": bound, "idle": idle,
            "peak_rss_bytes": peak, "peak_anon_bytes": max(s[1]["RssAnon"] for s in samples),
            "peak_file_bytes": max(s[1]["RssFile"] for s in samples),
            "peak_shmem_bytes": max(s[1]["RssShmem"] for s in samples), "after": after,
            "read_buffer_peak_bytes": buffered_peak, "read_buffer_end_bytes": buffered_end,
            "read_buffer_refusals": refusals, "requests_5xx": fivexx, "counts": counts,
            "scrape_max_s": max(scrape_s, default=0.0),
            "within_bound": peak <= bound, "samples": [(round(t, 2), m["VmRSS"], m["RssAnon"], m["RssFile"])
                                                       for t, m in samples]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/pin_soak.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=H.DEFAULT_OUT,
                   help="Directory for pin_soak.json and pin_soak.png. Default: benchmarks/out.")
    p.add_argument("--quick", action="store_true",
                   help="A smoke run: 8 s, 2 connections, the same defaults otherwise. Figures are not meaningful.")
    p.add_argument("--duration-s", type=float, default=120.0, help="Seconds of the pattern. Default: 120.")
    p.add_argument("--entries", type=int, default=320,
                   help="1 MiB prompts each tenant saves; with the default arena, 320 leave alpha's all and beta's "
                        "first 64 on disk only (what the gets name). Default: 320.")
    p.add_argument("--leases", type=int, default=64,
                   help="Leases each tenant takes per round over its newest prompts, never released. Default: 64.")
    p.add_argument("--connections", type=int, default=4,
                   help="Never-read gets each tenant sends per round, one connection each. Default: 4.")
    p.add_argument("--keys", type=int, default=64,
                   help="Disk-only keys a wide get names, 4 times each (connection k: the tenant's prompts from "
                        "k x KEYS on, modulo its disk-only ones). Default: 64.")
    p.add_argument("--hold-s", type=float, default=3.0, help="Seconds each round's gets are held open. Default: 3.")
    p.add_argument("--quota", default="1GiB", help="quota_bytes of each tenant. Default: 1GiB.")
    p.add_argument("--overhead", type=H.parse_size, default=320 * MIB,
                   help="The fixed overhead the bound allows RSS over ram_bytes: read_buffer_bytes (64 MiB); the "
                        "LMDB map pages reads may leave mapped before the tier lets them go (64 MiB, "
                        "store/lmdb_tier.py UNMAP_EVERY_BYTES); the dirty pages LMDB allocates for one write-behind "
                        "transaction, which the C heap may keep after it (64 MiB, store/behind.py TXN_BYTES); and "
                        "128 MiB of the process's own (interpreter, aiohttp, numpy, shared libraries, the NIXL agent, "
                        "heap_keep_bytes, request buffers, LMDB's B-tree pages). Default: 320MiB.")
    p.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                   help="A flag passed to prefixstore serve as it is (repeat it; e.g. --serve-flag=--nixl=off). "
                        "Default: none: the defaults are what is soaked.")
    args = p.parse_args(argv)
    if args.quick:
        args.duration_s, args.connections, args.hold_s = 8.0, 2, 2.0
    with tempfile.TemporaryDirectory(prefix="prefixstore-pin-soak-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    rows = [["idle (after the saves)", *(result["idle"][k] / MIB for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"))],  # type: ignore[index]
            ["peak during the pattern", *(result[k] / MIB for k in ("peak_rss_bytes", "peak_anon_bytes",  # type: ignore[operator]
                                                                    "peak_file_bytes", "peak_shmem_bytes"))],
            ["after the clients left", *(result["after"][k] / MIB for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"))]]  # type: ignore[index]
    H.print_table(f"store RSS, MiB (bound: ram_bytes {result['ram_bytes'] / MIB:.0f} + overhead "  # type: ignore[operator]
                  f"{args.overhead / MIB:.0f} = {result['bound_bytes'] / MIB:.0f} MiB; "  # type: ignore[operator]
                  f"within: {'yes' if result['within_bound'] else 'NO'})",
                  ["when", "RSS", "anonymous", "file", "shared"], rows)
    H.print_table("the pattern", ["leases taken", "gets held", "read buffers peak MiB", "item refusals", "5xx"],
                  [[result["counts"]["leases"], result["counts"]["gets"],  # type: ignore[index]
                    result["read_buffer_peak_bytes"] / MIB, result["read_buffer_refusals"],  # type: ignore[operator]
                    result["requests_5xx"]]])
    payload_ = {"benchmark": "pin_soak", "machine": H.machine_note(),
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "results": [{k: v for k, v in result.items() if k != "samples"}], "samples": result["samples"]}
    H.write_json(args.out, "pin_soak", payload_)
    plt = H.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ts = [s[0] for s in result["samples"]]  # type: ignore[union-attr, index]
    ax.plot(ts, [s[1] / MIB for s in result["samples"]], label="RSS")  # type: ignore[union-attr, index]
    ax.plot(ts, [s[2] / MIB for s in result["samples"]], label="anonymous", lw=0.8)  # type: ignore[union-attr, index]
    ax.plot(ts, [s[3] / MIB for s in result["samples"]], label="file-backed", lw=0.8)  # type: ignore[union-attr, index]
    ax.axhline(result["bound_bytes"] / MIB, color="red", ls="--", label="bound: ram_bytes + overhead")  # type: ignore[operator]
    ax.axhline(result["ram_bytes"] / MIB, color="grey", ls=":", label="ram_bytes")  # type: ignore[operator]
    ax.set_xlabel("seconds into the pattern")
    ax.set_ylabel("MiB")
    ax.set_title("two tenants pinning the arena, never-read gets of disk-only keys")
    ax.legend(fontsize=8, loc="lower right")
    H.save_figure(fig, args.out / "pin_soak.png")
    return 0 if result["within_bound"] and not result["requests_5xx"] else 1


if __name__ == "__main__":
    sys.exit(main())
