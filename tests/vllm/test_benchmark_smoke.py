"""benchmarks/vllm_multiturn.py --quick end to end: the real CPU engine, the store in its own
process, both sides; what it reports must hold even where its timings mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: tests/vllm/install_vllm.sh installs its CPU build")

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_vllm_multiturn_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_multiturn.py"), "--quick", "--load-policy", "always",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=BENCHMARKS.parent)
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads((out / "vllm_multiturn.json").read_text())
    assert results["benchmark"] == "vllm_multiturn" and results["same_tokens"]
    turns = results["results"]
    assert [t["store_cached"] for t in turns] == [t["previous_turn_tokens"] for t in turns]  # 0, 115, 171
    assert all(t["store_loaded"] > 0 for t in turns[1:])
    assert results["connector_stats"]["load_failures"] == 0
    assert (out / "vllm_multiturn.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_vllm_multiturn_help_documents_every_flag() -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_multiturn.py"), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=BENCHMARKS.parent)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--out", "--quick", "--reps", "--warmup", "--seed", "--conversations", "--turns", "--first-tokens",
                 "--user-tokens", "--answer-tokens", "--hidden-size", "--layers", "--kv-cache-tokens",
                 "--switch-interval-ms", "--store-block-tokens", "--state-admission", "--omp-bind", "--load-policy"):
        assert flag in proc.stdout
