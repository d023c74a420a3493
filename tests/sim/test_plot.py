"""The `simulate --out` figure, checked on its data (the drawn artists), not its pixels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefixstore.sim.engine import SimResult
from prefixstore.sim.plot import PANELS, figure

pytest.importorskip("matplotlib")

GIB = 1 << 30


def result(policy: str, capacity: int, *, reused: int, hits: int, saved: float) -> SimResult:
    """100 requests of 1000 input tokens; ``reused`` tokens, ``hits`` state hits, ``saved`` of 1e15 FLOPs."""
    return SimResult(policy=policy, capacity_bytes=capacity, num_requests=100, input_tokens=1000,
                     reused_tokens=reused, kv_tokens=reused, state_hits=hits, prefill_flops=1e15,
                     flops_saved=saved * 1e15)


def test_one_capacity_draws_a_bar_per_policy_in_each_panel() -> None:
    results = [result("adaptive", 4 * GIB, reused=600, hits=70, saved=0.55),
               result("lru", 4 * GIB, reused=300, hits=20, saved=0.25)]
    fig = figure(results, "workload multi-turn: 100 requests, model m")
    assert fig.get_suptitle() == "workload multi-turn: 100 requests, model m"
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [title for _, title, _ in PANELS]
    expected = {"token_hit_rate": [0.6, 0.3], "state_hit_rate": [0.7, 0.2], "flops_saved_fraction": [0.55, 0.25]}
    for ax, (attr, _, ylabel) in zip(axes, PANELS):
        assert [p.get_height() for p in ax.patches] == pytest.approx(expected[attr])
        assert [t.get_text() for t in ax.get_xticklabels()] == ["adaptive", "lru"]
        assert not ax.get_lines()  # bars, not a stack of dots on one x
        assert ax.get_xscale() == "linear" and "4GiB" in ax.get_xlabel()
        assert ylabel == ax.get_ylabel()
    assert "tokens" in axes[0].get_ylabel() and "requests" in axes[1].get_ylabel()
    assert "FLOPs" in axes[2].get_ylabel()


def test_several_capacities_draw_a_line_per_policy_over_a_log_axis() -> None:
    caps = (1 * GIB, 4 * GIB, 32 * GIB)
    results = [result(p, c, reused=r, hits=h, saved=s) for p, rows in (
        ("adaptive", ((100, 10, 0.1), (500, 50, 0.5), (900, 90, 0.9))),
        ("lru", ((50, 5, 0.05), (300, 30, 0.3), (800, 80, 0.8)))) for c, (r, h, s) in zip(caps, rows)]
    fig = figure(results, "t")
    for ax, (attr, _, _) in zip(fig.axes, PANELS):
        assert ax.get_xscale() == "log"
        assert list(ax.get_xticks()) == pytest.approx([1, 4, 32])
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1GiB", "4GiB", "32GiB"]
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {"adaptive", "lru"}
        for policy, line in lines.items():
            want = [getattr(r, attr) for r in results if r.policy == policy]
            assert list(line.get_xdata()) == pytest.approx([1, 4, 32])
            assert list(line.get_ydata()) == pytest.approx(want)
        assert not ax.patches


def test_simulate_out_titles_the_figure_with_workload_and_model(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "prefixstore", "simulate", "--workload", "rag", "--requests", "30",
                          "--capacity", "1GiB", "--policy", "adaptive,lru", "--model", "gdn-hybrid",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    head, units = out.stdout.splitlines()[:2]
    assert "token hit" in head and "state hit" in head
    assert units.split()[:4] == ["per", "token", "per", "token"] and "per req" in units
    from PIL import Image

    with Image.open(tmp_path / "simulate.png") as png:
        assert png.info["Title"] == "workload rag: 30 requests, model gdn-hybrid, 16-token blocks"
