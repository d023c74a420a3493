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
  the end of the scatter), a least-squares line over the recent ones.

Until each figure has samples, loads are made (the store's reason to exist; the first loads are
also what measures them).
"""

from __future__ import annotations

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

    def load_pays(self, tokens: int) -> bool:
        """Whether loading ``tokens`` beats recomputing them (True while a figure is missing)."""
        if None in (self.prefill_s_per_token, self.step_s, self.load_s_per_token, self.load_fixed_s):
            return True
        assert self.prefill_s_per_token is not None and self.step_s is not None
        assert self.load_s_per_token is not None and self.load_fixed_s is not None
        recompute = tokens * self.prefill_s_per_token
        return recompute > tokens * self.load_s_per_token + self.load_fixed_s + self.step_s

    def worst(self, other: CostFigures) -> CostFigures:
        """Tensor-parallel ranks each report: the load is as slow as the slowest rank's, the
        recompute as slow as the slowest rank's too (the ranks compute in lockstep)."""
        def pick(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else max(a, b)

        return CostFigures(prefill_s_per_token=pick(self.prefill_s_per_token, other.prefill_s_per_token),
                           step_s=pick(self.step_s, other.step_s),
                           load_s_per_token=pick(self.load_s_per_token, other.load_s_per_token),
                           load_fixed_s=pick(self.load_fixed_s, other.load_fixed_s))


class CostMeter:
    """The worker's measurements (one engine thread records steps, the client loop records loads;
    each figure is a float assignment, so no lock is needed to read a consistent-enough value)."""

    def __init__(self) -> None:
        self._prefill: float | None = None
        self._step: float | None = None
        self._loads: deque[tuple[int, float]] = deque(maxlen=LOAD_SAMPLES)

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

    def figures(self) -> CostFigures:
        per_token = fixed = None
        if len(self._loads) >= 2:
            n = [float(t) for t, _ in self._loads]
            s = [d for _, d in self._loads]
            mean_n, mean_s = sum(n) / len(n), sum(s) / len(s)
            var = sum((x - mean_n) ** 2 for x in n)
            if var > 0:  # loads of different sizes: the line through them
                per_token = max(sum((x - mean_n) * (y - mean_s) for x, y in zip(n, s)) / var, 0.0)
                fixed = max(mean_s - per_token * mean_n, 0.0)
            else:  # all of one size: all of it per token (no fixed part can be told apart)
                per_token, fixed = mean_s / mean_n, 0.0
        return CostFigures(prefill_s_per_token=self._prefill, step_s=self._step, load_s_per_token=per_token,
                           load_fixed_s=fixed)


__all__ = ["ALPHA", "LOAD_SAMPLES", "MIN_PREFILL_TOKENS", "CostFigures", "CostMeter"]
