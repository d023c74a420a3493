"""The trace simulator: traces, determinism, the baselines' known behaviours, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixstore.admission import get_model
from prefixstore.sim.engine import Simulator, get_policy, simulate
from prefixstore.sim.traces import Request, TraceError, generate, read_trace, write_trace

MODEL = get_model("mamba2-hybrid-7b")
BIG = 1 << 40  # nothing is ever evicted


def test_trace_roundtrip_and_errors_name_the_line(tmp_path: Path) -> None:
    reqs = generate("multi-turn", 20, seed=3)
    path = tmp_path / "t.jsonl"
    write_trace(path, reqs)
    assert list(read_trace(path)) == reqs
    path.write_text('{"session_id": "a", "input_tokens": [1, 2], "output_tokens": []}\n{"input_tokens": [-1]}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: input_tokens"):
        list(read_trace(path))


def test_replays_are_deterministic() -> None:
    reqs = generate("multi-turn", 60, seed=1)
    a = simulate(reqs, MODEL, 2 << 30, get_policy("adaptive"))
    b = simulate(reqs, MODEL, 2 << 30, get_policy("adaptive"))
    assert a.to_dict() | {"seconds": 0} == b.to_dict() | {"seconds": 0}


def test_second_hit_collects_nothing_when_every_prompt_is_sent_twice() -> None:
    reqs = generate("reuse-twice", 80, seed=2)
    always = simulate(reqs, MODEL, BIG, get_policy("always"))
    second = simulate(reqs, MODEL, BIG, get_policy("second-hit"))
    adaptive = simulate(reqs, MODEL, BIG, get_policy("adaptive"))
    assert second.token_hit_rate == 0.0
    assert always.token_hit_rate > 0.4  # each second request reuses its whole prompt
    assert adaptive.token_hit_rate >= 0.9 * always.token_hit_rate


def test_engine_page_baseline_reuses_only_whole_pages() -> None:
    reqs = generate("multi-turn", 60, seed=4)
    page = simulate(reqs, MODEL, BIG, get_policy("engine-page"))
    ours = simulate(reqs, MODEL, BIG, get_policy("adaptive"))
    assert ours.token_hit_rate > 2 * page.token_hit_rate
    sim = Simulator(MODEL, BIG, get_policy("engine-page"))
    try:
        for r in reqs[:30]:
            reused = sim.step(r)
            assert reused % sim.page == 0  # snapshots exist only at page boundaries
    finally:
        sim.close()


def test_a_store_under_pressure_keeps_its_invariants() -> None:
    reqs = generate("rag", 60, seed=5)
    sim = Simulator(MODEL, 2 << 30, get_policy("adaptive"))
    try:
        for r in reqs:
            sim.step(r)
            sim.store.check()
        assert sum(sim.store.index.stored_bytes.values()) <= 2 << 30
    finally:
        sim.close()


def test_exact_reuse_never_exceeds_kv_reuse() -> None:
    reqs = [Request("s", list(range(1, 200)), [7, 8, 9])] * 3
    r = simulate(reqs, MODEL, BIG, get_policy("always"))
    assert r.reused_tokens <= r.kv_tokens
    assert r.reused_tokens == 2 * 199  # the prompt-end snapshot serves the two repeats exactly


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefixstore", *args], capture_output=True, text=True, timeout=120)


def test_cli_simulate_plan_and_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert _cli("trace", "multi-turn", "-o", str(trace), "--requests", "40").returncode == 0
    out = tmp_path / "out"
    run = _cli("simulate", "--trace", str(trace), "--capacity", "1GiB,4GiB", "--policy", "adaptive,lru",
               "--out", str(out))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "token hit" in run.stdout and sum(line.startswith("adaptive ") for line in lines) == 2
    # ... and what each policy chose: the default's periodic interval and why, per capacity.
    chose = [line for line in lines if line.startswith("  adaptive @ ")]
    assert len(chose) == 2 and all("periodic" in line and "snapshots admitted/offered" in line for line in chose)
    results = json.loads((out / "simulate.json").read_text())
    assert {r["policy"] for r in results} == {"adaptive", "lru"} and (out / "simulate.png").stat().st_size > 0
    plan = json.loads(_cli("plan", "--model", "all", "--json").stdout)
    hybrid = next(p for p in plan if p["model"] == "mamba2-hybrid-7b")
    assert hybrid["kv_bytes_per_token"] == 16384 and hybrid["crossover_tokens"] > 1000
    bad = _cli("simulate", "--workload", "multi-turn", "--capacity", "lots")
    assert bad.returncode == 2 and "capacity" in bad.stderr


def test_the_default_takes_periodic_snapshots_where_contexts_are_resumed_mid_way() -> None:
    """Long contexts resumed at truncated points: the default's interval tuner plans periodic
    snapshots (the prior, then I* from the traffic), and exact reuse beats the same policy
    without them."""
    import dataclasses

    reqs = generate("long-context", 40, seed=0)
    default = get_policy("adaptive")
    ours = simulate(reqs, MODEL, 4 << 30, default)
    without = simulate(reqs, MODEL, 4 << 30, dataclasses.replace(default, auto_interval=False))
    assert ours.snapshots["periodic"]["admitted"] > 0 and "periodic" not in without.snapshots
    assert ours.token_hit_rate > without.token_hit_rate + 0.05
    assert ours.retention is not None and ours.retention["interval"] > 0


def test_simulate_out_without_matplotlib_keeps_its_results(tmp_path: Path) -> None:
    """Without matplotlib, --out refused to run at all: now the JSON is written, then the command
    says which extra draws the figure and exits 1."""
    blocker = tmp_path / "site" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed (test)')\n")
    env = {**os.environ, "PYTHONPATH": str(blocker.parent)}
    out = subprocess.run([sys.executable, "-m", "prefixstore", "simulate", "--workload", "rag", "--requests", "20",
                          "--capacity", "1GiB", "--policy", "lru", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1, out.stderr
    assert json.loads((tmp_path / "out" / "simulate.json").read_text())[0]["policy"] == "lru"
    assert not (tmp_path / "out" / "simulate.png").exists()
    assert "pip install -c constraints.txt '.[plot]'" in out.stderr and "Traceback" not in out.stderr
