"""The plugin's extra_config mapping (no LMCache needed): keys under its own prefix, each known."""

from __future__ import annotations

import pytest

from prefixstore.client.lmcache import ADAPTER_CLASS, ADAPTER_MODULE, ConnectorSettings

P = "remote_storage_plugin.prefixstore.a."


def test_only_this_plugins_keys_are_read() -> None:
    extra = {P + "module_path": ADAPTER_MODULE, P + "class_name": ADAPTER_CLASS, P + "url": "http://s:8077",
             P + "timeout_s": 1.5, P + "model_id": "m", "remote_storage_plugin.other.url": "ftp://not-ours",
             "save_chunk_meta": False}
    s = ConnectorSettings.from_extra_config(extra, "prefixstore.a")
    assert (s.client.url, s.client.timeout_s, s.model_id) == ("http://s:8077", 1.5, "m")


@pytest.mark.parametrize(("key", "value"), [("urll", "http://x:1"), ("url", "ftp://x"), ("tenant", 3),
                                            ("timeout_s", 0)])
def test_a_bad_key_or_value_names_its_knob(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key):
        ConnectorSettings.from_extra_config({P + key: value}, "prefixstore.a")
