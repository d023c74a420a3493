"""The extra-config mapping (no SGLang needed): every key is known, bad values name their knob."""

from __future__ import annotations

import pytest

from prefixstore.client.sglang import BACKEND_CLASS, BACKEND_MODULE, BackendSettings

LOADER = {"backend_name": "prefixstore", "module_path": BACKEND_MODULE, "class_name": BACKEND_CLASS,
          "interface_v1": 1}


def test_client_and_backend_keys_are_split() -> None:
    s = BackendSettings.from_extra_config({**LOADER, "url": "http://store:8077", "timeout_s": 2.5,
                                           "model_id": "m", "tenant": "t", "max_pending_states": 3})
    assert (s.client.url, s.client.timeout_s, s.model_id, s.tenant, s.max_pending_states) == \
        ("http://store:8077", 2.5, "m", "t", 3)


def test_cluster_seeds_from_a_json_list() -> None:
    s = BackendSettings.from_extra_config({**LOADER, "urls": ["http://a:1", "http://b:2"]})
    assert s.client.urls == ("http://a:1", "http://b:2")


@pytest.mark.parametrize(("extra", "knob"), [
    ({"interface_v1": 0}, "interface_v1"),
    ({"urll": "http://x:1"}, "urll"),
    ({"url": "ftp://x"}, "url"),
    ({"max_pending_states": -1}, "max_pending_states"),
    ({"tenant": 3}, "tenant"),
])
def test_a_bad_key_or_value_names_its_knob(extra: dict[str, object], knob: str) -> None:
    with pytest.raises(ValueError, match=knob):
        BackendSettings.from_extra_config({**LOADER, **extra})
