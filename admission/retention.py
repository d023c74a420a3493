"""Retention: which boundaries an engine snapshots, and the cost model behind the interval.

A boundary is the number of tokens the model has actually consumed. After a
prefill of P prompt tokens that is P; after decoding N tokens it is P + N - 1
(the last sampled token has not been fed through the model yet). Every
boundary the planner returns is one the engine can copy the state at before
the next chunk extends it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixstore.protocol.keys import Origin


def crossover_tokens(state_bytes: float, kv_bytes_per_token: float) -> float:
    """Prefix length at which one snapshot costs as many bytes as the prefix's KV."""
    if state_bytes <= 0 or kv_bytes_per_token <= 0:
        raise ValueError("state_bytes and kv_bytes_per_token must be positive")
    return state_bytes / kv_bytes_per_token


def optimal_interval(context_tokens: float, state_bytes: float, storage_price: float, recompute_price: float) -> float:
    """I* = sqrt(2·T·S·α/β).

    Snapshotting every I tokens of a T-token context stores T/I snapshots of S
    bytes (cost α per byte) and makes a resume at a uniformly random position
    recompute I/2 tokens on average (cost β per token). The sum
    α·S·T/I + β·I/2 is smallest at I*."""
    if min(context_tokens, state_bytes, storage_price, recompute_price) <= 0:
        raise ValueError("context_tokens, state_bytes and both prices must be positive")
    return math.sqrt(2 * context_tokens * state_bytes * storage_price / recompute_price)


@dataclass(frozen=True, kw_only=True)
class RetentionPlanner:
    """The boundaries to snapshot for one request.

    ``interval`` > 0 adds one every ``interval`` tokens; 0 keeps only the
    structural ones (prompt end, generation end, junction hints), which suits
    conversations where each turn replays the previous one."""

    interval: int = 0
    prompt_end: bool = True
    generation_end: bool = True
    junction_hints: bool = True

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"interval: must be >= 0 tokens, got {self.interval}")

    def prefill_boundaries(self, prompt_tokens: int, reused_tokens: int, hint: int = 0) -> dict[int, Origin]:
        """Boundaries inside the prefill, (reused_tokens, prompt_tokens], with why each was chosen."""
        out: dict[int, Origin] = {}
        if self.interval:
            first = (reused_tokens // self.interval + 1) * self.interval
            out.update(dict.fromkeys(range(first, prompt_tokens + 1, self.interval), Origin.PERIODIC))
        if self.junction_hints and reused_tokens < hint <= prompt_tokens:
            out[hint] = Origin.JUNCTION
        if self.prompt_end and prompt_tokens > reused_tokens:
            out[prompt_tokens] = Origin.PROMPT_END
        return {b: o for b, o in sorted(out.items()) if b > reused_tokens}

    def decode_boundaries(self, prompt_tokens: int, generated_tokens: int) -> dict[int, Origin]:
        """Boundaries reached while decoding: periodic ones and the generation end (P + N - 1)."""
        consumed = prompt_tokens + generated_tokens - 1
        out: dict[int, Origin] = {}
        if self.interval:
            first = (prompt_tokens // self.interval + 1) * self.interval
            out.update(dict.fromkeys(range(first, consumed + 1, self.interval), Origin.PERIODIC))
        if self.generation_end and consumed > prompt_tokens:
            out[consumed] = Origin.GENERATION_END
        return dict(sorted(out.items()))

    def plan(self, prompt_tokens: int, generated_tokens: int, reused_tokens: int = 0, hint: int = 0) -> dict[int, Origin]:
        """All boundaries of one request, sorted, each with its origin (a prompt end or
        generation end wins over a junction or periodic boundary at the same token)."""
        out = self.decode_boundaries(prompt_tokens, generated_tokens)
        out.update(self.prefill_boundaries(prompt_tokens, reused_tokens, hint))
        return dict(sorted(out.items()))


#: Periodic boundaries lie on multiples of this many tokens, whatever the interval: they
#: fall on block ends for any block size dividing it (no tail entry needed), and a
#: snapshot found at a multiple of it is, but for odds of 1/256, a periodic one.
INTERVAL_GRANULE = 256


@dataclass(frozen=True, kw_only=True)
class IntervalChoice:
    """What the tuner chose and why: the cost model's inputs as the traffic showed them."""

    interval: int  # 0: no periodic snapshots; -1: no evidence yet (the prior, per context)
    ideal_tokens: float  # I* before rounding to the granule (inf: none)
    tokens_per_resume: float  # T: new context tokens per mid-context resume
    state_bytes: int  # S
    byte_price_tokens: float  # alpha/beta: tokens of recompute one byte held is worth
    resume_share: float  # mid-context resumes per request
    requests: float  # (decayed) requests the choice rests on
    reason: str

    def to_dict(self) -> dict[str, object]:
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None  # JSON has no infinity

        return {"interval": self.interval, "ideal_tokens": finite(self.ideal_tokens),
                "tokens_per_resume": finite(self.tokens_per_resume), "state_bytes": self.state_bytes,
                "byte_price_tokens": self.byte_price_tokens, "resume_share": self.resume_share,
                "requests": self.requests, "reason": self.reason}

    def describe(self) -> str:
        """One line for people: what was chosen, from what."""
        if self.interval > 0:
            return (f"periodic every {self.interval:,} tokens: I* = sqrt(2*T*S*alpha/beta) = {self.ideal_tokens:,.0f} "
                    f"with T = {self.tokens_per_resume:,.0f} new tokens per mid-context resume "
                    f"({self.resume_share:.0%} of requests resume mid-context), S = {self.state_bytes:,} bytes, "
                    f"alpha/beta = 1/{1 / self.byte_price_tokens:,.0f} tokens per byte")
        if self.interval < 0:
            return f"periodic per context from the prior ({self.reason})"
        return f"no periodic snapshots: {self.reason}"


class IntervalTuner:
    """Chooses the periodic interval from the cost model and the traffic one engine sees.

    ``I* = sqrt(2·T·S·α/β)`` (:func:`optimal_interval`): checkpoints every I
    tokens over T tokens of context cost S·T/I bytes at α per byte, and a resume at
    a uniformly random point of it then recomputes I/2 tokens at β per token
    instead of everything back to the last structural snapshot (prompt end,
    generation end, junction). Per request, T is the new context the engine
    computes (tokens past its KV match, prefill and decode) per *mid-context
    resume*, measured on its own lookups:

    - a mid-context resume is a lookup whose KV match ran at least one granule past
      the snapshot it got (a truncated context, or a snapshot evicted from under its
      KV), or whose snapshot was a periodic one: the checkpoints hide the gap they
      serve, and counting only the gaps they leave would switch them off as soon as
      they work;
    - α/β prices a byte as KV: a byte of KV saves 1/kv_bytes_per_token tokens each
      time it is reused, and the bytes a snapshot displaces are, at the margin of a
      cache, entries reused about once. So a snapshot costs what the KV of the
      crossover length S / kv_bytes_per_token does. (The cache's average yield,
      reused tokens per stored byte, was tried: it rises with capacity while the
      marginal price falls, and gave intervals 2-3x too coarse on long contexts.)

    Traffic enters through T: more resumes per new token make checkpoints denser; a
    small cache, whose contexts are evicted and computed again, makes them sparser.
    In conversation traffic a turn resumes exactly at the previous turn's end, where
    a structural snapshot lies, so mid-context resumes are rare, T is large and I*
    passes every context: no periodic boundary is planned and they cost nothing.
    Where they are planned but do not pay, the store's admission learns that the
    periodic origin is dead and refuses them before any byte moves.

    Before ``min_requests`` requests there is no evidence: the prior is one
    mid-context resume per context (T = the request's own context,
    :meth:`interval_for`), so the contexts computed first, the ones later requests
    resume in, get checkpoints too. Sums decay by half every ``half_life``
    requests, so the choice follows the traffic."""

    def __init__(self, state_bytes: int, kv_bytes_per_token: int, half_life: float = 256.0,
                 min_requests: float = 16.0, granule: int = INTERVAL_GRANULE) -> None:
        if state_bytes <= 0 or kv_bytes_per_token <= 0:
            raise ValueError(f"state_bytes and kv_bytes_per_token: must be > 0, got {state_bytes}, "
                             f"{kv_bytes_per_token}")
        self.state_bytes = state_bytes
        self.byte_price = 1.0 / kv_bytes_per_token
        self.half_life = half_life
        self.min_requests = min_requests
        self.granule = granule
        self.num_observed = 0  # requests seen, not decayed (min_requests counts these)
        self.requests = 0.0
        self.new_tokens = 0.0
        self.resumes = 0.0
        self.interval = -1  # no evidence yet: interval_for uses the prior

    def observe(self, *, kv_tokens: int, state_tokens: int, consumed_tokens: int) -> int:
        """One request: its lookup's KV match and snapshot, and the tokens the model
        consumed (prompt + output - 1). Returns the interval for the next requests."""
        f = 0.5 ** (1.0 / self.half_life)
        self.num_observed += 1
        self.requests = self.requests * f + 1.0
        self.new_tokens = self.new_tokens * f + max(0, consumed_tokens - kv_tokens)
        periodic = self.interval != 0 and state_tokens > 0 and state_tokens % self.granule == 0
        resumed = kv_tokens - state_tokens >= self.granule or (periodic and kv_tokens > state_tokens)
        self.resumes = self.resumes * f + resumed
        self.interval = self.choice().interval
        return self.interval

    def _round(self, ideal: float) -> int:
        return max(self.granule, round(ideal / self.granule) * self.granule)

    def interval_for(self, context_tokens: int) -> int:
        """The interval for a request whose context is ``context_tokens`` long: the
        chosen one, or before any evidence the prior's (T = this context)."""
        if self.interval >= 0:
            return self.interval
        return self._round(self.state_bytes * self.byte_price)

    def choice(self) -> IntervalChoice:
        share = self.resumes / self.requests if self.requests else 0.0
        common = dict(state_bytes=self.state_bytes, byte_price_tokens=self.byte_price, resume_share=share,
                      requests=self.requests)
        if self.num_observed < self.min_requests:
            return IntervalChoice(interval=-1, ideal_tokens=math.inf, tokens_per_resume=math.inf,
                                  reason=f"fewer than {self.min_requests:g} requests seen; prior: one resume "
                                  "per context", **common)  # type: ignore[arg-type]
        if self.resumes < 0.5:
            return IntervalChoice(interval=0, ideal_tokens=math.inf, tokens_per_resume=math.inf,
                                  reason="no mid-context resumes: structural snapshots serve every resume",
                                  **common)  # type: ignore[arg-type]
        t = max(1.0, self.new_tokens / self.resumes)
        ideal = optimal_interval(t, self.state_bytes, self.byte_price, 1.0)
        return IntervalChoice(interval=self._round(ideal), ideal_tokens=ideal, tokens_per_resume=t,
                              reason="I* = sqrt(2*T*S*alpha/beta), rounded to the granule", **common)  # type: ignore[arg-type]
