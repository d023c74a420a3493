"""TP=1 <-> TP=2 with vLLM's CPU engine (issue 32): the same tokens as a full recompute.

Three engines in turn, the tests' LFM2 (float32, attention beside short conv) on one store:

1. TP=1 runs prompt X (saved: prompt + answer, and the state after them) and, salted, a reference
   of the conversation's next turn.
2. TP=2 (two worker processes, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) takes that next turn: loads
   X's turn -- each rank its own KV head and conv channels -- and generates what TP=1's
   recompute generated; then runs prompt Y and saves it (each rank's slice gathered to rank 0,
   which writes the canonical entries).
3. TP=1 again takes Y's next turn, loading what TP=2 saved, and generates what its own recompute
   of that turn generates.

The connector-level tests of the same (byte for byte, both directions) are in test_cross_tp.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: tests/vllm/install_vllm.sh installs its CPU build")

from ..serve_process import ServeProcess  # noqa: E402
from .models import NATIVE_ROPE, lfm2  # noqa: E402
from .test_engine_e2e import assert_same_generation  # noqa: E402

pytestmark = pytest.mark.slow

X = [(i * 41 + 7) % 500 for i in range(150)]
Y = [(i * 43 + 3) % 500 for i in range(101)]  # ends mid-block


@contextlib.contextmanager
def engine(model: str, store: ServeProcess, tp: int) -> Iterator[Any]:
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    transfer = KVTransferConfig(kv_connector="PrefixStoreConnector", kv_role="kv_both",
                                kv_connector_module_path="prefixstore.client.vllm.connector",
                                kv_connector_extra_config={"url": store.url, "model_id": "cross-tp-lfm2"})
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    kw: dict[str, Any] = {"tensor_parallel_size": tp}
    if tp > 1:
        kw["distributed_executor_backend"] = "mp"
    llm = LLM(model=model, skip_tokenizer_init=True, max_model_len=512, block_size=32, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, kv_transfer_config=transfer, dtype="float32",
              mamba_cache_mode="align", enable_prefix_caching=True, compilation_config=NATIVE_ROPE, **kw)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        ensure_kv_transfer_shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def generate(llm: Any, prompt: list[int], salt: str | None = None) -> Any:
    from vllm import SamplingParams

    request: dict[str, Any] = {"prompt_token_ids": prompt}
    if salt:
        request["cache_salt"] = salt
    return llm.generate([request], SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, logprobs=1))[0]


def settle(llm: Any) -> None:
    """Step the idle engine until its workers reported every planned save ended (the TP=2 engine's
    workers are other processes: their reports ride the steps' outputs)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()
    deadline = time.monotonic() + 120
    while scheduler.saves_in_flight and time.monotonic() < deadline:
        llm.llm_engine.step()
    assert scheduler.saves_in_flight == 0


def test_cross_tp_engines_tp1_to_tp2_and_back(store: ServeProcess, tmp_path: Path) -> None:
    """Each engine takes up the next turn of a conversation the other size ran: the store holds the
    previous turn's prompt + answer with the state after it (exact reuse needs a snapshot there)."""
    model = lfm2(tmp_path / "lfm2")
    with engine(model, store, 1) as one:
        x1 = generate(one, X)
        x_next = X + list(x1.outputs[0].token_ids) + [5, 6, 7]
        reference_x = generate(one, x_next, salt="reference")  # TP=1 computing the next turn itself
        assert x1.num_cached_tokens == 0
        settle(one)
    with engine(model, store, 2) as two:
        x2 = generate(two, x_next)  # each rank reads its head and channels of what TP=1 saved
        assert x2.num_cached_tokens == len(X) + 8 - 1  # the previous turn less its last sampled token
        assert_same_generation(x2, reference_x)
        y1 = generate(two, Y)
        assert y1.num_cached_tokens == 0
        settle(two)
    with engine(model, store, 1) as again:
        y_next = Y + list(y1.outputs[0].token_ids) + [8, 9]
        reference_y = generate(again, y_next, salt="reference")
        y2 = generate(again, y_next)  # what TP=2 saved: the whole entry, from both ranks
        assert y2.num_cached_tokens == len(Y) + 8 - 1
        assert_same_generation(y2, reference_y)
