"""benchmarks/compare_commits.py: the verdict arithmetic, the common flag subset, the figures it reads.

The comparison itself (two worktrees, a copied venv, ~25 minutes of benchmarks) is not run here;
its record is docs/benchmarks.md, "House redesign". These pin the parts that decide what the
record says.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import compare_commits as C  # noqa: E402


def test_noise_is_the_larger_relative_range_and_sets_the_verdict() -> None:
    base, head = [10.0, 12.0, 11.0], [11.0, 11.0, 11.0]
    s = C.summarize(base, head, higher_is_better=False)
    assert s["baseline_median"] == 11.0 and s["head_median"] == 11.0
    assert s["noise"] == pytest.approx(2.0 / 11.0)  # the baseline's (12 - 10) / 11; the head's is 0
    assert s["verdict"] == "within noise"
    # 11 -> 12.9 ms: ratio 1.173 is inside 2/11 = 0.182 ... and 13.1 (1.191) is outside
    assert C.summarize(base, [12.9, 12.9, 12.9], higher_is_better=False)["verdict"] == "within noise"
    slower = C.summarize(base, [13.1, 13.1, 13.1], higher_is_better=False)
    assert slower["verdict"] == "head SLOWER" and slower["speed"] == pytest.approx(11.0 / 13.1)
    # the same numbers as GB/s: more is faster
    faster = C.summarize(base, [13.1, 13.1, 13.1], higher_is_better=True)
    assert faster["verdict"] == "head faster" and faster["speed"] == pytest.approx(13.1 / 11.0)
    # the head's own spread counts too: it widens the band
    assert C.summarize(base, [10.0, 13.1, 16.0], higher_is_better=False)["noise"] == pytest.approx(6.0 / 13.1)


def test_one_round_has_no_noise_estimate() -> None:
    s = C.summarize([10.0], [20.0], higher_is_better=False)
    assert s["noise"] is None and s["verdict"] == "n/a (one round)" and s["ratio"] == 2.0


def test_noise_band_in_speed_terms() -> None:
    assert C.noise_band(0.2, higher_is_better=True) == pytest.approx((0.8, 1.2))
    # a ms figure within 20 %: head ms in [0.8, 1.2] x baseline, speed = 1 / that
    assert C.noise_band(0.2, higher_is_better=False) == pytest.approx((1 / 1.2, 1 / 0.8))
    assert C.noise_band(3.0, higher_is_better=True) == (C.XLIM[0], C.XLIM[1])  # clipped to the axis


def test_only_flags_both_trees_accept_are_passed() -> None:
    case = C.Case(name="lookup@16384", script="lookup.py",
                  args=(("--tokens", "16384"), ("--reps", "150"), ("--quick", None)))
    old = "usage: lookup.py [--reps REPS] [--quick]\n  --reps REPS  Measured repetitions.\n  --quick  smoke"
    new = old + "\n  --tokens TOKENS  Tokens in the prompt."
    argv, dropped = C.common_args(case, [old, new])
    assert argv == ["--reps", "150", "--quick"] and dropped == ["--tokens"]
    assert C.common_args(case, [new, new]) == (["--tokens", "16384", "--reps", "150", "--quick"], [])


def _fig(median_ms: float) -> dict[str, float]:
    return {"median_ms": median_ms}


def test_lookup_figures_by_prompt_length_and_block_size() -> None:
    keys = ("end_to_end", "round_trip", "server_lookup", "hash_array", "echo")
    payload = {"results": [{"tokens": 131072, "block_tokens": 16,
                            "figures": {k: _fig(float(i)) for i, k in enumerate(keys)}}]}
    figs = {f.name: f for f in C.lookup_figures(payload)}
    assert figs["lookup 131,072 tok B=16: end-to-end"].value == 0.0
    assert figs["lookup 131,072 tok B=16: Store.lookup"].value == 2.0
    echo = figs["lookup 131,072 tok B=16: raw echo"]
    assert echo.control and echo.unit == "ms" and not echo.higher_is_better
    assert sum(f.control for f in figs.values()) == 1


def test_cluster_lookup_figures_by_prompt_shape() -> None:
    """Named by the prompt shape only (the nodes a walk asks differ with the ports, run to run), so the
    two trees' figures pair up."""
    payload = {"results": {"one branch": {"single_ms": 1.5, "cluster_ms": 2.0, "ratio": 1.33, "nodes": 1},
                           "two branches": {"single_ms": 1.5, "cluster_ms": 2.5, "ratio": 1.67, "nodes": 2}}}
    figs = {f.name: f for f in C.cluster_lookup_figures(payload)}
    assert figs["cluster lookup, two branches: cluster"].value == 2.5
    assert figs["cluster lookup, one branch: single node"].value == 1.5
    assert not any(f.control or f.higher_is_better for f in figs.values()) and len(figs) == 4


def test_nixl_figures_include_the_prefix_load() -> None:
    keys = ("nixl_get", "nixl_get_placed", "nixl_put", "http_get", "http_put", "raw_read")
    payload = {"results": [{"payload_bytes": 65536, "figures": {k: {"median_gbps": 1.5} for k in keys}}],
               "prefix_load": {"tokens": 32768, "nixl": _fig(40.0), "http": _fig(90.0)}}
    figs = {f.name: f for f in C.nixl_figures(payload)}
    assert figs["nixl 64 KiB: NIXL GET"].higher_is_better and figs["nixl 64 KiB: raw NIXL READ"].control
    assert figs["nixl prefix load 32,768 tok: http"].value == 90.0
    assert not figs["nixl prefix load 32,768 tok: nixl"].higher_is_better


def test_lookup_latency_figures_by_cluster_size_load_length_and_kind() -> None:
    payload = {"results": [{"nodes": 4, "load": "idle", "tokens": 131072, "kind": "hit", "p50_ms": 1.2, "p99_ms": 2.0},
                           {"nodes": 4, "load": "idle", "tokens": 131072, "kind": "miss", "p50_ms": 1.7, "p99_ms": 3.0}]}
    figs = {f.name: f for f in C.lookup_latency_figures(payload)}
    assert figs["lookup latency 4 node(s) idle 131,072 tok: miss"].value == 1.7
    assert not any(f.control or f.higher_is_better for f in figs.values()) and len(figs) == 2


def test_every_flag_has_help() -> None:
    parser_actions = C.build_parser()._actions
    flags = [a for a in parser_actions if a.option_strings]
    assert len(flags) >= 15
    for action in flags:
        assert action.help and len(action.help) > 10, action.option_strings
