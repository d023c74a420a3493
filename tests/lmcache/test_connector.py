"""The remote storage plugin under LMCache's real classes on CPU, against a real store process.

Chunks are stored by one process (``written``: LMCache's RemoteBackend over the plugin, keys
from LMCache's ChunkedTokenDatabase) and read back by others through LMCache's RemoteBackend,
byte-exact. Chunk contents encode their coordinates (engine.py).

Every check runs in a process of its own (checks.py), never in the test process: LMCache's CPU
ops load numba and with it llvmlite, whose FFI object answers any attribute, ``__dict__``
included; vLLM's CPU platform scans every loaded module for kernels to override at engine start
(``vllm/triton_utils/dispatcher.py``) and fails on it. An LMCache import here would break
tests/vllm's engines, which run later in this process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest

from ..serve_process import ServeProcess, clean_env
from .conftest import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lmcache") is None,
                                reason="LMCache is not installed: tests/lmcache/install_lmcache.sh installs it")


@pytest.fixture(scope="module")
def results(store: ServeProcess, written: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every check of checks.py, run once in one LMCache process; name -> "ok" or its traceback."""
    assert store.url is not None
    tmp = tmp_path_factory.mktemp("checks")
    (tmp / "written.json").write_text(json.dumps(written))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # a port nothing listens on (reserved by the OS, then released)
    dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.lmcache.checks", store.url, dead_url,
                           str(tmp / "written.json"), str(tmp / "results.json")],
                          cwd=ROOT, env=clean_env(PYTHONPATH=os.pathsep.join(sys.path)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return dict(json.loads((tmp / "results.json").read_text()))


def check(results: dict[str, str], name: str) -> None:
    assert results[name] == "ok", results[name]


def test_lmcache_loads_the_plugin_and_its_namespace(results: dict[str, str]) -> None:
    check(results, "plugin_and_namespace")


def test_chunks_from_another_process_read_back_byte_exact(results: dict[str, str]) -> None:
    check(results, "read_back_byte_exact")


def test_keys_nobody_stored_are_misses(results: dict[str, str]) -> None:
    check(results, "unstored_keys_miss")


def test_exists_sync_path(results: dict[str, str]) -> None:
    check(results, "exists_sync")


def test_the_store_holds_chunks_layer_major(results: dict[str, str]) -> None:
    check(results, "layer_major")


def test_dead_store_gives_misses_and_drops_saves(results: dict[str, str]) -> None:
    check(results, "dead_store")


def test_a_bad_plugin_key_names_itself(results: dict[str, str]) -> None:
    check(results, "bad_key")


def test_compressed_chunks_make_the_connector_idle(results: dict[str, str]) -> None:
    check(results, "compressed_serde_idle")


def test_each_rank_keys_its_own_chunks(results: dict[str, str]) -> None:
    check(results, "per_rank_namespace")


def test_every_check_has_a_test(results: dict[str, str]) -> None:
    """A check added to checks.py without a test here would run unasserted."""
    tested = {"plugin_and_namespace", "read_back_byte_exact", "unstored_keys_miss", "exists_sync", "layer_major",
              "dead_store", "bad_key", "compressed_serde_idle", "per_rank_namespace"}
    assert set(results) == tested
