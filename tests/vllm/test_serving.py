"""Real `vllm serve` replicas under concurrent multi-turn load (benchmarks/vllm_serving.py --quick):
two OpenAI-compatible vLLM servers of the tests' hybrid LFM2 per side, several conversations in
flight spread round robin over them, greedy decoding.

* store: one prefixstore node; the store serves prefixes (its hit rate, the engines' cached
  tokens) and every request generates vLLM alone's tokens.
* flaky: the store behind a proxy that fails every other load's lookup (benchmarks/_fault_proxy.py):
  to the engines the store changes between lookup and load, again and again. Each failed load
  must become a recompute vLLM accepts: before issue 29's fixes vLLM failed those requests
  (``kv_load_failure_policy=fail``) and the engine core died on the connector's held save
  (``assert req_id in self.requests``), so every later request failed.
* store-killed: the store is SIGKILLed after 40% of the requests; every request completes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: tests/vllm/install_vllm.sh installs its CPU build")

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_serving_replicas_survive_failed_loads_and_a_dead_store(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # load_policy always: on this tiny model most hits recompute faster than they load (costs.py), and
    # this test is about loads and their failures.
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_serving.py"), "--quick", "--sides", "vllm,store,flaky",
                           "--kill-store", "--concurrency", "3", "--conversations", "6", "--out", str(out),
                           "--connector-extra", '{"load_policy": "always"}'],
                          capture_output=True, text=True, timeout=1500, cwd=BENCHMARKS.parent)
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads((out / "vllm_serving.json").read_text())
    assert not report["unavailable"]
    cells = {c["side"]: c for c in report["cells"]}
    assert set(cells) == {"vllm", "store", "flaky", "store-killed"}
    for side, cell in cells.items():
        rep = cell["reps"][0]
        assert rep["requests"] == 18 and rep["failed_requests"] == 0, (side, rep["requests_detail"])
        if side != "vllm":  # every request compared with vLLM alone's greedy tokens
            assert cell["tokens"]["compared"] == 18 and cell["tokens"]["wrong_tokens"] == 0, (side, cell["tokens"])
    alone, store = cells["vllm"]["reps"][0], cells["store"]["reps"][0]
    assert store["store_kv_hit_rate"] > 0 and store["store_state_hit_rate"] > 0
    events = store["connector_events"]  # a healthy store: every load and every save went through
    assert events.get("load_failures", 0) == 0 and events.get("saves_dropped", 0) == 0, events
    assert events.get("saves", 0) > 0 and events.get("lookups", 0) == 18, events
    assert store["prefill_computed_per_request"] < alone["prefill_computed_per_request"]
    for rep in (alone, store):  # where the first token's time went, from each replica's vLLM histograms
        assert set(rep["engine_phases_s"]) == {"queue", "prefill", "engine_ttft"}, rep["engine_phases_s"]
        assert all(v > 0 for v in rep["engine_phases_s"].values()), rep["engine_phases_s"]
    flaky = cells["flaky"]["reps"][0]["connector_events"]
    assert flaky.get("load_failures", 0) >= 1, flaky  # the proxy failed loads, and vLLM recomputed them
    assert cells["store-killed"]["reps"][0]["killed"]
    summary = report["summary"]
    for key in ("ttft_p50_ratio_turn2plus", "tpot_p99_ratio", "throughput_ratio", "wrong_tokens", "failed_requests"):
        assert key in summary
    assert summary["wrong_tokens"] == 0 and summary["failed_requests"] == 0
    assert (out / "vllm_serving.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_vllm_serving_help_documents_every_flag() -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_serving.py"), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=BENCHMARKS.parent)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--out", "--quick", "--reps", "--seed", "--models", "--sides", "--concurrency", "--conversations",
                 "--turns", "--systems", "--system-tokens", "--zipf", "--rate", "--max-user-tokens",
                 "--max-answer-tokens", "--max-model-len", "--kv-cache-tokens", "--max-num-seqs", "--kill-store",
                 "--kill-concurrency", "--tie-logprob", "--device", "--timeout-s", "--connector-extra"):
        assert flag in proc.stdout

