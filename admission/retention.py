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

from ..protocol.keys import Origin


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
