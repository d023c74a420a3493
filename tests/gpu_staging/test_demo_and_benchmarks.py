"""`prefixstore demo` runs a conversation and stops; the benchmark scripts run end to end with --quick;
the store and the client import without torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prefixstore.cli import main

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_reuses_every_previous_turn(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--turns", "3", "--user-tokens", "40", "--answer-tokens", "8", "--page-tokens", "6"]) == 0
    out = capsys.readouterr().out
    turns = re.findall(r"turn (\d): prompt (\d+) tokens \| store had KV (\d+), state (\d+) of (\d+) "
                       r"\(KV hit (\d+)%, state hit (\d+)%\) \| reused (\d+)", out)
    assert [t[0] for t in turns] == ["1", "2", "3"]
    assert turns[0][2:4] == ("0", "0")
    for turn, (_, prompt, kv, state, looked, _, _, reused) in enumerate(turns[1:], start=2):
        # the previous turns' prompts and answers, up to the last generation end
        expected = (turn - 1) * (40 + 8) - 1
        assert (int(kv), int(state), int(reused)) == (expected, expected, expected)
        assert int(looked) == int(prompt) - 1
    assert "KV hit rate" in out and "state hit rate" in out
    assert out.rstrip().endswith("store stopped")


def test_demo_help_documents_every_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "prefixstore", "demo", "--help"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--turns", "--user-tokens", "--answer-tokens", "--block-tokens", "--page-tokens", "--mode",
                 "--replay-fraction", "--interval", "--seed", "--data-dir", "--ram-bytes"):
        assert flag in proc.stdout


def test_demo_rejects_a_bad_value_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--turns", "0"]) == 2
    assert "turns" in capsys.readouterr().err


def test_store_and_client_import_without_torch() -> None:
    code = ("import sys; import prefixstore.store, prefixstore.client, prefixstore.cli; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ttft", "staging_bandwidth", "tail_replay"])
def test_benchmark_quick_run(name: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, (f"{name}.py --quick exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    results = json.loads((out / f"{name}.json").read_text())
    assert results["benchmark"] == name and results["results"]
    assert (out / f"{name}.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("name", ["ttft", "staging_bandwidth", "tail_replay"])
def test_benchmark_help_documents_every_flag(name: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--help"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--out", "--quick", "--reps", "--warmup", "--seed"):
        assert flag in proc.stdout
