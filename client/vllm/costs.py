"""What a load costs against what recomputing costs, measured on the engine: a load that would not
beat recomputing its tokens is not made.

A hybrid model's load is asynchronous (worker.py): the request waits for the load, then for the
engine step that reports it, then computes the rest of its prompt. Recomputing instead costs the
engine the forward time of those tokens, in the step the request is scheduled. On a small model
(or a short hit) recomputing is the faster of the two; on a large one, by far the slower. The
worker measures both on the engine it serves and hands the figures to the scheduler each step,
which decides per request (``ConnectorSettings.load_policy``)::

    load when   recompute(n) = n * prefill_s_per_token
              > load(n) + step_s = n * load_s_per_token + load_fixed_s + step_s

* ``prefill_s_per_token``: from steps that compute many prompt tokens, their forward time less a
  decode step's, per prompt token (the marginal cost of a token of prefill);
* ``step_s``: a decode-only step's forward time (the step a loaded request waits for);
* ``load_s_per_token``, ``load_fixed_s``: from the worker's finished loads (time from start to
  the end of the scatter), a robust line over the recent ones (``robust_line``).

Until each figure has samples, loads are made (the store's reason to exist; the first loads are
also what measures them).

The right-hand side is a model of what the request waits; the scheduler also measures the wait
itself (:class:`LoadWaits`): from the step that planned an asynchronous load to the step whose
report says it ended (what the request waits beyond recomputing; a wait for room in the batch
after that, which a recomputing request would also have, is not counted). Where it has enough
recent samples, the decision uses that::

    load when   n * prefill_s_per_token > wait(n)

What the model leaves out is what made loads lose: on two busy replicas of a small model
(benchmarks/vllm_serving.py, tiny, 8 in flight) the worker's figures put a load with its step at
12-19 ms, while the requests waited 19-27 ms for it to end (the client loop shares the engine
process's GIL with a forward pass that is mostly Python; docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

#: Weight of a new sample in the exponentially weighted means.
ALPHA = 0.2

#: A step is a prefill sample when it computes at least this many prompt tokens.
MIN_PREFILL_TOKENS = 64

#: Loads kept for the line fit of load time against tokens.
LOAD_SAMPLES = 32


@dataclass(frozen=True, slots=True)
class CostFigures:
    """The measured figures, as the worker hands them to the scheduler (None: no samples yet)."""

    prefill_s_per_token: float | None = None
    step_s: float | None = None
    load_s_per_token: float | None = None
    load_fixed_s: float | None = None
    wait_s_per_token: float | None = None
    wait_fixed_s: float | None = None
    """The scheduler's measured wait of a load (:class:`LoadWaits`, ``robust_line`` over its
    samples: a wait of n tokens is ``wait_fixed_s + n * wait_s_per_token``, where most samples were
    of one size the fixed part alone, a floor, for any size: most of a wait is whole steps); None
    while there are too few recent samples. Where set, :meth:`load_gain_s` uses it in place of
    the modelled load and step."""
    load_ref_tokens: int | None = None
    """Set where most loads were of one size (``robust_line``): that size, and ``load_fixed_s`` their
    median time. A load of n tokens is then estimated at the cheapest line through that point,
    ``load_fixed_s * min(n, ref) / ref`` (all per token below it, all fixed above it): an estimate
    too low makes the load, whose own time then corrects it; one too high would keep every load
    from being made, and measured, again."""

    def load_pays(self, tokens: int) -> bool:
        """Whether loading ``tokens`` beats recomputing them (True while a figure is missing)."""
        measured = None not in (self.wait_s_per_token, self.wait_fixed_s)
        if self.prefill_s_per_token is None or not measured and None in (self.step_s, self.load_s_per_token,
                                                                         self.load_fixed_s):
            return True
        gain = self.load_gain_s(tokens)
        return gain is not None and gain > 0

    def load_gain_s(self, tokens: int) -> float | None:
        """Seconds a load of ``tokens`` saves the request against recomputing them (negative: it
        loses; None until prefill has been measured). What a lookup may spend waiting for a save
        that would let it load them: waiting longer loses more than the load gains. While the
        load's or the step's figures are missing they count as free: an upper bound, so a wait is
        never longer than recomputing the tokens would take."""
        if self.prefill_s_per_token is None:
            return None
        if self.wait_s_per_token is not None and self.wait_fixed_s is not None:
            return tokens * self.prefill_s_per_token - (self.wait_fixed_s + tokens * self.wait_s_per_token)
        load = 0.0
        if self.load_s_per_token is not None and self.load_fixed_s is not None:
            fixed = self.load_fixed_s
            if self.load_ref_tokens:
                fixed *= min(tokens, self.load_ref_tokens) / self.load_ref_tokens
            load = tokens * self.load_s_per_token + fixed
        return tokens * self.prefill_s_per_token - load - (self.step_s or 0.0)

    def as_us(self) -> dict[str, int]:
        """The figures there are, in whole microseconds, keyed as the connector's stats report them."""
        pairs = (("cost_us:prefill_per_token", self.prefill_s_per_token), ("cost_us:decode_step", self.step_s),
                 ("cost_us:load_per_token", self.load_s_per_token), ("cost_us:load_fixed", self.load_fixed_s),
                 ("cost_us:wait_per_token", self.wait_s_per_token), ("cost_us:wait_fixed", self.wait_fixed_s))
        return {key: round(v * 1e6) for key, v in pairs if v is not None}

    def worst(self, other: CostFigures) -> CostFigures:
        """Tensor-parallel ranks each report: the load is as slow as the slowest rank's, the
        recompute as slow as the slowest rank's too (the ranks compute in lockstep)."""
        def pick(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else max(a, b)

        return CostFigures(prefill_s_per_token=pick(self.prefill_s_per_token, other.prefill_s_per_token),
                           step_s=pick(self.step_s, other.step_s),
                           load_s_per_token=pick(self.load_s_per_token, other.load_s_per_token),
                           load_fixed_s=pick(self.load_fixed_s, other.load_fixed_s),
                           load_ref_tokens=max(self.load_ref_tokens or 0, other.load_ref_tokens or 0) or None,
                           wait_s_per_token=pick(self.wait_s_per_token, other.wait_s_per_token),
                           wait_fixed_s=pick(self.wait_fixed_s, other.wait_fixed_s))


#: Measured waits (LoadWaits) overrule the modelled load only with at least this many samples,
#: each at most WAIT_MAX_AGE_S old: two are a line through two points, and after a busy spell
#: the figures go back to the model, which then measures again.
MIN_WAIT_SAMPLES = 4
WAIT_MAX_AGE_S = 60.0


class LoadWaits:
    """The scheduler's measurement of what a load costs the request that makes it: seconds from the
    step that planned its asynchronous load to the step whose report says it ended, against the
    tokens loaded. The loads that end in one report and were planned in one step wait alike: they
    are one sample (their mean tokens), or one slow step would count as many. One scheduler
    thread; the last ``LOAD_SAMPLES`` samples of at most ``WAIT_MAX_AGE_S``."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float, float]] = deque(maxlen=LOAD_SAMPLES)  # (tokens, seconds, at)
        self._line: tuple[float, float, int | None] | None = None

    def add(self, tokens: int, seconds: float, at: float) -> None:
        if tokens > 0:
            self._samples.append((tokens, seconds, at))
            self._line = None

    def apply(self, figures: CostFigures, now: float) -> CostFigures:
        """``figures`` with the measured wait, or without one while there are fewer than
        ``MIN_WAIT_SAMPLES`` recent samples."""
        while self._samples and now - self._samples[0][2] > WAIT_MAX_AGE_S:
            self._samples.popleft()
            self._line = None
        if len(self._samples) < MIN_WAIT_SAMPLES:
            return dataclasses.replace(figures, wait_s_per_token=None, wait_fixed_s=None)
        if self._line is None:
            self._line = robust_line([(n, s) for n, s, _ in self._samples])
        per_token, fixed, _ = self._line
        return dataclasses.replace(figures, wait_s_per_token=per_token, wait_fixed_s=fixed)


class CostMeter:
    """The worker's measurements (one engine thread records steps, the client loop records loads;
    each figure is a float assignment, so no lock is needed to read a consistent-enough value)."""

    def __init__(self) -> None:
        self._prefill: float | None = None
        self._step: float | None = None
        self._loads: deque[tuple[int, float]] = deque(maxlen=LOAD_SAMPLES)
        self._line: tuple[float, float, int | None] | None = None  # robust_line of _loads, until the next load

    def step(self, seconds: float, num_reqs: int, num_tokens: int) -> None:
        """A forward pass of ``num_reqs`` requests computing ``num_tokens`` tokens."""
        if num_reqs and num_tokens == num_reqs:
            self._step = seconds if self._step is None else (1 - ALPHA) * self._step + ALPHA * seconds
            return
        prompt_tokens = num_tokens - num_reqs
        if prompt_tokens >= MIN_PREFILL_TOKENS and self._step is not None:
            per_token = max(seconds - self._step, 0.0) / prompt_tokens
            self._prefill = per_token if self._prefill is None else (1 - ALPHA) * self._prefill + ALPHA * per_token

    def load(self, tokens: int, seconds: float) -> None:
        """A finished load of ``tokens`` tokens that took ``seconds``."""
        if tokens > 0:
            self._loads.append((tokens, seconds))
            self._line = None

    def figures(self) -> CostFigures:
        per_token = fixed = None
        ref: int | None = None
        if len(self._loads) >= 2:
            if self._line is None:  # the line changes only with a new load: not refitted every step
                self._line = robust_line(list(self._loads))
            per_token, fixed, ref = self._line
        return CostFigures(prefill_s_per_token=self._prefill, step_s=self._step, load_s_per_token=per_token,
                           load_fixed_s=fixed, load_ref_tokens=ref)


def robust_line(points: list[tuple[int, float]]) -> tuple[float, float, int | None]:
    """Seconds per token and fixed seconds of loads, from (tokens, seconds) points: the Theil-Sen
    line (the median of the pairwise slopes, then the median intercept), both at least 0, and
    None; or, where most points are of one size, 0, their median time and that size
    (``CostFigures.load_ref_tokens``).

    Not least squares: under load a few loads wait behind saves on the client loop or a busy
    store, and one such outlier among short loads gave a least-squares line 1.5 s fixed (every
    hit then looked slower than recomputing it, and was not loaded); the medians ignore up to
    about three loads in ten."""
    slopes = sorted((s2 - s1) / (n2 - n1) for i, (n1, s1) in enumerate(points) for n2, s2 in points[i + 1:]
                    if n2 != n1)
    pairs = len(points) * (len(points) - 1) // 2
    if 2 * len(slopes) < pairs:
        # Most loads of one size (hybrid loads fall on vLLM's block grid): every slope then runs
        # through the few others, and one slow load of another size would set the line. What
        # most loads say is the median time of a load of that size, and nothing about how time
        # splits between fixed and per token. Charged all per token, the fixed part of many
        # short loads (32 tokens in 15 ms: 0.47 ms a token) made every longer hit look slower
        # than recomputing it, so no longer load was made and the figure was never measured
        # again (docs/benchmarks.md, "A cost figure that never recovers"). So the estimate is the
        # cheapest split for each size (CostFigures.load_ref_tokens).
        sizes = [n for n, _ in points]
        common = max(set(sizes), key=sizes.count)
        return 0.0, median([s for n, s in points if n == common]), common
    slope = max(median(slopes), 0.0)
    return slope, max(median([s - slope * n for n, s in points]), 0.0), None


def median(values: list[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


__all__ = ["ALPHA", "LOAD_SAMPLES", "MIN_PREFILL_TOKENS", "MIN_WAIT_SAMPLES", "WAIT_MAX_AGE_S", "CostFigures", "CostMeter",
           "LoadWaits", "median", "robust_line"]
