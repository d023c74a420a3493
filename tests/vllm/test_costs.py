"""The connector's cost model (client/vllm/costs.py): a hybrid load is made only where it beats
recomputing its tokens on this engine, from figures the worker measures. No vLLM needed."""

from __future__ import annotations

import pytest

from prefixstore.client.vllm.costs import CostFigures, CostMeter

WIDE = CostFigures(prefill_s_per_token=270e-6, step_s=0.030, load_s_per_token=11e-6, load_fixed_s=0.002)
"""About the wide LFM2 on this machine: 3,700 prompt tokens/s, 30 ms decode steps, 1.45 GB/s loads."""
TINY = CostFigures(prefill_s_per_token=15e-6, step_s=0.006, load_s_per_token=2e-6, load_fixed_s=0.002)


def test_a_load_is_made_where_it_beats_recomputing() -> None:
    # wide: recompute 2,239 tokens ~ 605 ms, a load ~ 25 ms + a 30 ms step: load.
    assert WIDE.load_pays(2239)
    # wide: 100 tokens ~ 27 ms against ~ 33 ms: recompute.
    assert not WIDE.load_pays(100)
    # The break-even: n * 270 us > n * 11 us + 32 ms, n > 123.6.
    assert WIDE.load_pays(124) and not WIDE.load_pays(123)
    # tiny: n * 15 us > n * 2 us + 8 ms, n > 615.4: its short hits recompute.
    assert TINY.load_pays(616) and not TINY.load_pays(615)


def test_loads_are_made_until_every_figure_is_measured() -> None:
    assert CostFigures().load_pays(1)
    assert CostFigures(prefill_s_per_token=1.0, step_s=1.0, load_s_per_token=1.0).load_pays(1)


def test_the_meter_measures_steps_prefill_and_loads() -> None:
    meter = CostMeter()
    meter.step(0.030, num_reqs=4, num_tokens=4)  # a decode step
    assert meter.figures().step_s == pytest.approx(0.030)
    # A step of 5 requests computing 1,005 tokens (1,000 beyond one each): (0.300 - 0.030) / 1000 per token.
    meter.step(0.300, num_reqs=5, num_tokens=1005)
    assert meter.figures().prefill_s_per_token == pytest.approx(0.27e-3)
    meter.step(0.031, num_reqs=4, num_tokens=40)  # 36 prompt tokens: too few to tell
    assert meter.figures().prefill_s_per_token == pytest.approx(0.27e-3)
    # Loads of 1,000 and 3,000 tokens in 12 ms and 32 ms: 10 us a token, 2 ms fixed.
    meter.load(1000, 0.012)
    meter.load(3000, 0.032)
    f = meter.figures()
    assert f.load_s_per_token == pytest.approx(10e-6) and f.load_fixed_s == pytest.approx(0.002)


def test_a_few_slow_loads_do_not_make_every_load_look_slow() -> None:
    """Loads queued behind saves take far longer than the rest: three of ten such outliers leave the
    line the other seven give (a least-squares line gave them 1.5 s fixed: no load was made)."""
    meter = CostMeter()
    for n in (100, 200, 300, 400, 500, 600, 700):
        meter.load(n, 0.002 + n * 10e-6)
    for n in (100, 150, 250):
        meter.load(n, 1.5)
    f = meter.figures()
    assert f.load_s_per_token == pytest.approx(10e-6) and f.load_fixed_s == pytest.approx(0.002)
    assert WIDE.load_pays(1000)


def test_one_slow_load_of_another_size_does_not_set_the_line() -> None:
    """Hybrid loads fall on vLLM's block grid, so most are of one size: 31 loads of 1,024 tokens in
    20 ms and one of 2,048 in 500 ms. Every slope runs through the odd one; the median time says
    what most loads cost (a 1,024-token load: 20 ms, not 480)."""
    meter = CostMeter()
    meter.step(0.003, 4, 4)  # a decode step of 3 ms
    meter.step(0.003 + 500 * 50e-6, 5, 504)  # 500 prompt tokens at 50 us
    for _ in range(31):
        meter.load(1024, 0.020)
    meter.load(2048, 0.500)
    f = meter.figures()
    assert (f.load_s_per_token, f.load_fixed_s, f.load_ref_tokens) == (0.0, pytest.approx(0.020), 1024)
    # Nothing says how those 20 ms split: each size gets the cheapest split, all per token below
    # 1,024 tokens (256: 5 ms, + a 3 ms step, against 12.8 ms of recomputing: loaded), all fixed above.
    assert f.load_gain_s(256) == pytest.approx(256 * 50e-6 - 0.005 - 0.003, rel=0.02)
    assert f.load_gain_s(4096) == pytest.approx(4096 * 50e-6 - 0.020 - 0.003, rel=0.02)
    assert f.load_pays(256)


def test_short_loads_of_one_size_do_not_make_every_longer_hit_look_slow() -> None:
    """32 loads of 32 tokens in 15 ms each (a fixed cost, mostly). Charged per token (0.47 ms a
    token) they made a 1,000-token hit look like 470 ms against 50 ms of recomputing: no longer load
    was made, and the figure was never measured again (seen in vllm_serving runs). Their time is
    counted as fixed: the longer hit is loaded, and its own time corrects the line."""
    meter = CostMeter()
    meter.step(0.003, 4, 4)  # a decode step of 3 ms
    meter.step(0.003 + 500 * 50e-6, 5, 504)  # 500 prompt tokens at 50 us
    for _ in range(32):
        meter.load(32, 0.015)
    f = meter.figures()
    assert (f.load_s_per_token, f.load_fixed_s, f.load_ref_tokens) == (0.0, pytest.approx(0.015), 32)
    assert f.load_pays(1000) and not f.load_pays(200)
    for n in (600, 800, 1000, 1200, 1400, 1600, 1800, 2000, 2200, 2400, 2600, 2800):  # those loads, made
        meter.load(n, 0.015 + n * 10e-6)
    f = meter.figures()
    assert f.load_s_per_token == pytest.approx(10e-6, rel=0.05) and f.load_fixed_s == pytest.approx(0.015, rel=0.05)
    assert f.load_ref_tokens is None  # a line again


def test_a_wait_never_outlasts_recomputing_while_load_figures_are_missing() -> None:
    """Prefill measured, loads not yet: the gain is what recomputing would cost less the step
    (an upper bound); before prefill is measured, unknown."""
    assert CostFigures(prefill_s_per_token=1e-3, step_s=0.02).load_gain_s(1000) == pytest.approx(0.98)
    assert CostFigures(prefill_s_per_token=1e-3).load_gain_s(1000) == pytest.approx(1.0)
    assert CostFigures(step_s=0.02).load_gain_s(1000) is None
    assert WIDE.load_gain_s(2239) == pytest.approx(2239 * 259e-6 - 0.032)


def test_tensor_parallel_ranks_report_their_worst() -> None:
    a = CostFigures(prefill_s_per_token=1.0, step_s=2.0, load_s_per_token=None, load_fixed_s=3.0)
    b = CostFigures(prefill_s_per_token=2.0, step_s=1.0, load_s_per_token=4.0, load_fixed_s=None)
    assert a.worst(b) == CostFigures(prefill_s_per_token=2.0, step_s=2.0, load_s_per_token=4.0, load_fixed_s=3.0)


def test_a_measured_wait_overrules_the_modelled_load() -> None:
    """The scheduler's measured waits (LoadWaits) take the place of the modelled load and step: the
    wide model's figures load 124 tokens or more, but requests that waited 40 ms + 20 us a token
    for their loads make a load pay only past 40 ms / (270 - 20) us = 160 tokens. Fewer than
    MIN_WAIT_SAMPLES waits are not a line: the figures stay modelled; nor are waits older than
    WAIT_MAX_AGE_S: after a quiet spell the model decides, and the loads it makes measure again."""
    from prefixstore.client.vllm.costs import MIN_WAIT_SAMPLES, WAIT_MAX_AGE_S, LoadWaits

    waits = LoadWaits()
    sizes = [500 * (i + 1) for i in range(MIN_WAIT_SAMPLES)]
    for i, n in enumerate(sizes[:-1]):
        waits.add(n, 0.040 + n * 20e-6, at=100.0 + i)
    assert waits.apply(WIDE, now=110.0) == WIDE
    waits.add(0, 9.0, at=110.0)  # nothing loaded: no sample
    waits.add(sizes[-1], 0.040 + sizes[-1] * 20e-6, at=110.0)
    measured = waits.apply(WIDE, now=110.0)
    assert measured.wait_fixed_s == pytest.approx(0.040) and measured.wait_s_per_token == pytest.approx(20e-6)
    assert WIDE.load_pays(130) and not measured.load_pays(130)
    assert measured.load_pays(161) and not measured.load_pays(159)
    assert measured.as_us()["cost_us:wait_fixed"] == 40000
    # The worker's next figures get the measured wait too (the scheduler applies it to each).
    assert waits.apply(TINY, now=110.0).wait_fixed_s == pytest.approx(0.040)
    # The oldest wait ages out: too few are left, and the figures are the model's again.
    assert waits.apply(measured, now=100.0 + WAIT_MAX_AGE_S + 0.5) == WIDE


def test_waits_of_one_size_are_a_floor_for_every_size() -> None:
    """Most loads of one size (hybrid loads fall on vLLM's block grid): their median wait is what
    any load waits, a smaller one included, since most of a wait is whole engine steps. (Scaled
    down as the worker's load time is, a 32-token load next to 544-token ones 40 ms long would be
    put at 2.4 ms, and loaded where it waits a step.)"""
    from prefixstore.client.vllm.costs import LoadWaits

    waits = LoadWaits()
    for i in range(6):
        waits.add(544, 0.040, at=float(i))
    waits.add(32, 0.045, at=6.0)
    measured = waits.apply(CostFigures(prefill_s_per_token=1e-3), now=7.0)
    assert measured.wait_s_per_token == 0 and measured.wait_fixed_s == pytest.approx(0.040)
    assert not measured.load_pays(32) and not measured.load_pays(40) and measured.load_pays(41)
