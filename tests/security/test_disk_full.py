"""A full disk under the LMDB tier (issue 30, defect 3), in both durability modes.

Before: the ENOSPC of a commit (LMDB reports it as ``mdb_txn_commit: Input/output error`` when the
disk fills mid-write) was taken for damage, the tier reset, data.mdb deleted, and every entry
committed before the disk filled lost, after a restart too. Now a full disk is back-pressure:
saves are refused (sync: at once; write-behind: once its bounds are behind), every entry committed
before -- and, in write-behind, those committed while the queue had room -- is served with its
own bytes, and writes resume when space returns, surviving a restart.

Two ways to fill the disk: a real small tmpfs (the test skips, saying why, where mounting is not
permitted), and ENOSPC injected at the tier's commit seam (``LmdbTier.commit_fault``), which runs
everywhere.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import pytest

from prefixstore.client import PrefixClient
from prefixstore.protocol import KVLayout, Namespace
from prefixstore.store import StoreConfig

from ..conftest import RunningStore
from ..factories import kv_payload

StartStore = Callable[[StoreConfig], Awaitable[RunningStore]]
MODES = ("sync", "write-behind")
BLOCK = 16


def big_namespace() -> Namespace:
    """64 KiB blocks (16 tokens x 2 layers x 2 KiB): a few MiB fill a small disk."""
    return Namespace(model="disk-full", kv=KVLayout(num_layers=2, num_heads=4, head_dim=64, dtype="float32"),
                     block_tokens=BLOCK)


@dataclass
class Ledger:
    """What each prompt was acknowledged with: the tokens it must be served for, after anything."""

    ns: Namespace
    committed: dict[int, list[int]] = field(default_factory=dict)  # prompt number -> its tokens
    refused: int = 0

    def prompt(self, n: int) -> list[int]:
        return [n * 1000 + i + 1 for i in range(4 * BLOCK)]

    async def save(self, c: PrefixClient, n: int) -> bool:
        tokens = self.prompt(n)
        res = await c.save(c.prompt(tokens), len(tokens), lambda a, b: kv_payload(self.ns, tokens, a, b))
        assert res.dropped == 0, res  # a refusal is an answer, never a store failure
        if res.stored == 4:
            self.committed[n] = tokens
            return True
        assert res.stored == 0, res  # one commit, one transaction: all of a prompt or none of it
        self.refused += 1
        return False

    async def check(self, c: PrefixClient) -> tuple[int, int]:
        """(prompts served whole, wrong bytes) over every committed prompt."""
        whole = wrong = 0
        for tokens in self.committed.values():
            found = await c.lookup(tokens)
            reads = found.kv_reads(found.kv_tokens)
            outs = [bytearray(self.ns.block_bytes) for _ in reads]
            got = await c.read([item for item, _, _ in reads], outs)
            ok = found.kv_tokens == len(tokens) and all(n == self.ns.block_bytes for n in got)
            for (_, a, b), out, n in zip(reads, outs, got):
                if n > 0 and bytes(out[:n]) != kv_payload(self.ns, tokens, a, b):
                    wrong += 1
                    ok = False
            await c.release(found.lease_id)
            whole += ok
        return whole, wrong


def metric(running: RunningStore, name: str) -> float:
    value = running.store.metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


async def wait_for(predicate: Callable[[], Awaitable[bool]], what: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not await predicate():
        assert time.monotonic() < end, f"not within {deadline_s}s: {what}"
        await asyncio.sleep(0.05)


async def fill_and_recover(start_store: StartStore, config: StoreConfig, fill: Callable[[RunningStore], None],
                           make_room: Callable[[RunningStore], None], caplog: pytest.LogCaptureFixture) -> None:
    """Save until the disk is full, check everything committed, give space back, save again,
    restart, check again. ``fill`` makes the disk full (or lets the saves fill it)."""
    caplog.set_level(logging.WARNING, logger="prefixstore.store.disk")
    ns = big_namespace()
    ledger = Ledger(ns)
    running = await start_store(config)
    async with running.client(ns) as c:
        for n in range(8):  # before the disk fills: all acknowledged
            assert await ledger.save(c, n)
        await running.store.drain_writes()
        before = dict(ledger.committed)
        fill(running)
        n = 8
        while ledger.refused == 0:  # until the store says the disk is full
            await ledger.save(c, n)
            n += 1
            assert n < 400, "the disk never filled"
            if config.durability == "write-behind":
                await asyncio.sleep(0.02)  # let the writer meet the full disk
        assert metric(running, "prefixstore_lmdb_full") == 1.0
        assert metric(running, "prefixstore_lmdb_full_refusals_total") >= 1
        assert all(n in ledger.committed for n in before)
        assert await ledger.check(c) == (len(ledger.committed), 0)  # every acknowledged prompt, its own bytes
        assert "found the disk full" in caplog.text
        make_room(running)

        async def resumed() -> bool:
            return await ledger.save(c, n + 1000)

        await wait_for(resumed, "a save after space returned")
        await running.store.drain_writes()
        assert running.store.behind.entries == 0  # what waited in RAM is on disk now
        assert metric(running, "prefixstore_lmdb_full") == 0.0
        assert "writes resumed" in caplog.text
        assert await ledger.check(c) == (len(ledger.committed), 0)
    assert metric(running, "prefixstore_lmdb_resets_total") == 0  # never taken for damage
    await running.server.close()
    running = await start_store(config)  # restarted on the same directory
    async with running.client(ns) as c:
        assert await ledger.check(c) == (len(ledger.committed), 0)  # before: 0 of them, data.mdb deleted


def store_config(data_dir: Path, durability: str) -> StoreConfig:
    # A small arena: most entries are read back from LMDB, not RAM.
    return StoreConfig(port=0, data_dir=str(data_dir), ram_bytes=2 << 20, page_bytes=64 << 10, disk_bytes=1 << 30,
                       durability=durability, write_behind_s=0.2, nixl="off")


@pytest.mark.parametrize("durability", MODES)
async def test_enospc_at_commit_keeps_every_committed_entry(start_store: StartStore, tmp_path: Path,
                                                            durability: str, caplog: pytest.LogCaptureFixture) -> None:
    """ENOSPC through the commit seam, as LMDB raises it (a plain lmdb.Error with strerror's text)."""

    def enospc() -> None:
        raise lmdb.Error(f"mdb_txn_commit: {os.strerror(errno.EIO)}")

    def fill(running: RunningStore) -> None:
        assert running.store.tier is not None
        running.store.tier.commit_fault = enospc

    def make_room(running: RunningStore) -> None:
        assert running.store.tier is not None
        running.store.tier.commit_fault = None

    await fill_and_recover(start_store, store_config(tmp_path / "lmdb", durability), fill, make_room, caplog)


@pytest.fixture
def small_disk(tmp_path: Path) -> AsyncIterator[Path]:
    """A 24 MiB tmpfs, 16 MiB of it taken by a ballast file (deleted to give space back)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        with open(mnt / "ballast", "wb") as f:
            f.write(b"\xa5" * (16 << 20))
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("durability", MODES)
async def test_a_real_full_filesystem_keeps_every_committed_entry(start_store: StartStore, small_disk: Path,
                                                                  durability: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    def fill(running: RunningStore) -> None:
        pass  # the saves fill the 8 MiB left

    def make_room(running: RunningStore) -> None:
        (small_disk / "ballast").unlink()

    await fill_and_recover(start_store, store_config(small_disk / "lmdb", durability), fill, make_room, caplog)
