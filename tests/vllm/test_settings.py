"""kv_connector_extra_config -> ConnectorSettings + ClientConfig (no vLLM needed)."""

from __future__ import annotations

import dataclasses

import pytest

from prefixstore.client import ClientConfig
from prefixstore.client.vllm import ConnectorSettings
from prefixstore.client.vllm.settings import SMALL_SAVE_BYTES


def test_client_fields_and_own_keys_are_split() -> None:
    s = ConnectorSettings.from_extra_config({"url": "http://store:8077", "token": "t0k", "timeout_s": 2.5,
                                             "mode": "replay", "block_tokens": 64, "tenant": "acme", "save": False})
    assert s.client == ClientConfig(url="http://store:8077", token="t0k", timeout_s=2.5,
                                    small_save_bytes=SMALL_SAVE_BYTES)  # the connector's default, not the client's
    assert (s.mode, s.block_tokens, s.tenant, s.save, s.load) == ("replay", 64, "acme", False, True)
    assert ConnectorSettings.from_extra_config({"small_save_bytes": 0}).client.small_save_bytes == 0  # unless set


def test_every_client_field_is_accepted() -> None:
    """Knobs the client gains later (data path, member lists) pass through without touching the mapping."""
    defaults = ClientConfig()
    extra = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(ClientConfig)}
    assert ConnectorSettings.from_extra_config(extra).client == defaults


@pytest.mark.parametrize(("extra", "knob"), [
    ({"urll": "http://x"}, "unknown key 'urll'"),
    ({"mode": "fast"}, "mode"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"url": "ftp://x"}, "url"),
    ({"timeout_s": -1}, "timeout_s"),
    ({"save": "yes"}, "save"),
    ({"idle_wait_s": -0.001}, "idle_wait_s"),
    ({"switch_interval_s": 1.0}, "switch_interval_s"),
    ({"switch_interval_s": True}, "switch_interval_s"),
    ({"idle_wait_s": "5ms"}, "idle_wait_s"),
    ({"lookup_block_s": -0.001}, "lookup_block_s"),
    ({"lookup_block_s": True}, "lookup_block_s"),
    ({"url": []}, "url"),
    ({"commit_wait_s": -1}, "commit_wait_s"),
    ({"commit_wait_s": "5"}, "commit_wait_s"),
    ({"keys": "sglang"}, "keys"),
])
def test_bad_values_name_their_knob(extra: dict[str, object], knob: str) -> None:
    with pytest.raises(ValueError, match=knob):
        ConnectorSettings.from_extra_config(extra)


def test_url_list() -> None:
    assert ConnectorSettings.from_extra_config({"url": ["http://a:1"]}).client.url == "http://a:1"
    names = {f.name for f in dataclasses.fields(ClientConfig)}
    if not names & {"seeds", "seed_urls", "urls", "members"}:
        with pytest.raises(ValueError, match="url: this client takes one store address"):
            ConnectorSettings.from_extra_config({"url": ["http://a:1", "http://b:2"]})
    else:
        s = ConnectorSettings.from_extra_config({"url": ["http://a:1", "http://b:2"]})
        assert s.client.url == "http://a:1"
        assert s.client.urls == ("http://a:1", "http://b:2")  # type: ignore[attr-defined]


def test_the_client_thread_runs_off_the_engines_pinned_cores() -> None:
    """vLLM's CPU worker pins its process to the engine's cores; the connector's client thread
    (loads, saves) must not run there, or every load competes with the forward pass for its core."""
    import os
    import threading

    from prefixstore.client.vllm.loop import ClientLoop, transfer_cpus

    assert transfer_cpus({1}, {0, 1, 2, 3}) == {0, 2, 3}
    assert transfer_cpus({0, 1}, {0, 1}) == {0, 1}  # the engine holds every core: share them all
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(os.getppid())) < 2:
        pytest.skip("needs two CPUs and Linux affinity calls")
    first = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    done = threading.Event()
    seen: dict[str, set[int]] = {}

    def engine_thread() -> None:  # stands for vLLM's worker, pinned to one core
        os.sched_setaffinity(0, {first})
        loop = ClientLoop()
        try:
            seen["loop"] = loop.submit(_affinity()).result(timeout=10)
        finally:
            loop.close()
            done.set()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join(30)
    assert done.is_set() and first not in seen["loop"] and seen["loop"]
    assert os.sched_getaffinity(0) == before


async def _affinity() -> set[int]:
    import os

    return os.sched_getaffinity(0)
