"""A multi-turn conversation of the reference model against a store: what ``prefixstore demo`` runs.

Each turn's prompt is the whole conversation so far (every earlier prompt
and answer) plus a new user message, as chat serving does. The previous turn
stored its prompt + answer up to the generation end, so each turn should
reuse all of it: KV and state hit rates near 100% of the previous
conversation, and only the new message computed.

The store is not started here (gpu_staging never imports the store): the
caller passes its URL. The CLI starts an embedded one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixstore.client import RetentionPlanner
from prefixstore.client.client import PrefixClient
from prefixstore.client.config import ClientConfig
from .engine import Engine, EngineConfig, RequestResult, ReuseMode
from .reference_model import HybridModel, ModelConfig


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    turns: int = 4
    """Turns of the conversation."""
    user_tokens: int = 96
    """Tokens of each new user message."""
    answer_tokens: int = 24
    """Tokens the model answers per turn (greedy)."""
    block_tokens: int = 16
    """Store block size B."""
    page_tokens: int = 16
    """Engine page size (independent of B)."""
    mode: ReuseMode = "exact"
    """exact, replay or auto (see EngineConfig.mode)."""
    replay_fraction: float = 0.1
    """Tail-Replay budget as a fraction of the reused prefix."""
    interval: int = 0
    """Snapshot every this many tokens as well (0: prompt and generation ends only)."""
    seed: int = 0
    """Seed of the model weights and the user messages."""

    def __post_init__(self) -> None:
        for name in ("turns", "user_tokens", "answer_tokens", "block_tokens", "page_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class TurnReport:
    turn: int
    result: RequestResult

    @property
    def looked_up(self) -> int:
        """Tokens the lookup asked about (the prompt less its last token, always computed)."""
        return self.result.prompt_tokens - 1

    @property
    def kv_hit_rate(self) -> float:
        return self.result.kv_tokens / self.looked_up if self.looked_up else 0.0

    @property
    def state_hit_rate(self) -> float:
        return self.result.state_tokens / self.looked_up if self.looked_up else 0.0

    def line(self) -> str:
        r = self.result
        saved = (f"saved {r.save.stored} entries ({r.save.stored_bytes / 2**20:.2f} MiB)" if r.save is not None
                 else "saved nothing (approximate state)" if not r.plan.exact else "saved nothing")
        replay = f", replayed {r.plan.replay_tokens}" if r.plan.replay_tokens else ""
        fallback = f" [load failed, recomputed: {r.fallback}]" if r.fallback else ""
        return (f"turn {self.turn}: prompt {r.prompt_tokens} tokens | store had KV {r.kv_tokens}, state "
                f"{r.state_tokens} of {self.looked_up} (KV hit {self.kv_hit_rate:.0%}, state hit "
                f"{self.state_hit_rate:.0%}) | reused {r.reused_tokens}{replay}, computed {r.computed_tokens} | "
                f"TTFT {r.ttft_s * 1e3:.0f} ms | answered {len(r.generated)} tokens | {saved}{fallback}")


async def run_conversation(url: str, options: DemoOptions, say: Callable[[str], None]) -> list[TurnReport]:
    """Run the conversation against the store at ``url``, reporting each turn through ``say``."""
    model = HybridModel(ModelConfig(seed=options.seed))
    ns = model.config.namespace(block_tokens=options.block_tokens)
    longest = options.turns * (options.user_tokens + options.answer_tokens)
    config = EngineConfig(mode=options.mode, replay_fraction=options.replay_fraction, page_tokens=options.page_tokens,
                          num_pages=-(-longest // options.page_tokens) + 4,
                          retention=RetentionPlanner(interval=options.interval))
    messages = torch.Generator().manual_seed(options.seed + 1)
    reports: list[TurnReport] = []
    say(f"model: {len(model.config.layers)} layers ({', '.join(model.config.layers)}), "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, float32, seed {options.seed}; "
        f"KV {ns.kv.token_bytes} B/token, snapshot {ns.state.snapshot_bytes / 2**10:.0f} KiB; "
        f"block {options.block_tokens} tokens, page {options.page_tokens} tokens, mode {options.mode}")
    async with PrefixClient(ns, ClientConfig(url=url)) as client:
        engine = Engine(model, client, config)
        conversation: list[int] = []
        for turn in range(1, options.turns + 1):
            conversation += torch.randint(0, model.config.vocab_size, (options.user_tokens,),
                                          generator=messages).tolist()
            say(f"turn {turn}: user sends {options.user_tokens} tokens; looking up {len(conversation) - 1} ...")
            result = await engine.generate(conversation, options.answer_tokens)
            report = TurnReport(turn=turn, result=result)
            reports.append(report)
            say(report.line())
            conversation += result.generated
    looked = sum(r.looked_up for r in reports)
    kv = sum(r.result.kv_tokens for r in reports)
    state = sum(r.result.state_tokens for r in reports)
    reused = sum(r.result.reused_tokens for r in reports)
    prompts = sum(r.result.prompt_tokens for r in reports)
    say(f"all turns: {prompts} prompt tokens, {reused} reused ({reused / prompts:.0%}); "
        f"KV hit rate {kv / looked:.0%}, state hit rate {state / looked:.0%} of {looked} looked-up tokens"
        + (f"; store failures: {dict(client.failures)}" if client.failures else ""))
    return reports


__all__ = ["DemoOptions", "TurnReport", "run_conversation"]
