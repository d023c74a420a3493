"""Typed field readers of msgpack headers, and :class:`WireError`: shared by every message module
(protocol/wire.py, probe.py, nixl_wire.py). Each reader validates type and bounds and raises
``WireError`` naming the field (with ``ctx`` as its prefix, e.g. ``items[3].``)."""

from __future__ import annotations

from .errors import Problem, RequestError
from .hashing import HASH_BYTES, BlockHash
from .keys import ENTRY_KEY_BYTES, Kind


class WireError(RequestError):
    """Malformed or out-of-bounds input: ``field`` names what is wrong, ``problem`` (protocol/errors.py)
    why; the HTTP plane maps the problem to a status."""

    def __init__(self, field: str, message: str, problem: Problem = Problem.INVALID) -> None:
        super().__init__(field, message, problem)


def _get(h: dict[str, object], name: str, ctx: str) -> object:
    if name not in h:
        raise WireError(f"{ctx}{name}", "missing")
    return h[name]


def req_int(h: dict[str, object], name: str, ctx: str = "", lo: int = 0, hi: int = 1 << 62) -> int:
    v = _get(h, name, ctx)
    if not isinstance(v, int) or isinstance(v, bool):
        raise WireError(f"{ctx}{name}", f"expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise WireError(f"{ctx}{name}", f"{v} is outside [{lo}, {hi}]")
    return v


def req_bool(h: dict[str, object], name: str, ctx: str = "", default: bool | None = None) -> bool:
    if name not in h and default is not None:
        return default
    v = _get(h, name, ctx)
    if not isinstance(v, bool):
        raise WireError(f"{ctx}{name}", f"expected a boolean, got {type(v).__name__}")
    return v


def req_bin(h: dict[str, object], name: str, ctx: str = "", size: int | None = None, multiple: int = 1) -> bytes:
    v = _get(h, name, ctx)
    if not isinstance(v, bytes):
        raise WireError(f"{ctx}{name}", f"expected binary, got {type(v).__name__}")
    if size is not None and len(v) != size:
        raise WireError(f"{ctx}{name}", f"expected {size} bytes, got {len(v)}")
    if len(v) % multiple:
        raise WireError(f"{ctx}{name}", f"length {len(v)} is not a multiple of {multiple}")
    return v


def opt_bin(h: dict[str, object], name: str, ctx: str = "", size: int | None = None) -> bytes | None:
    if h.get(name) is None:
        return None
    return req_bin(h, name, ctx, size)


def req_list(h: dict[str, object], name: str, ctx: str, max_len: int) -> list[object]:
    v = _get(h, name, ctx)
    if not isinstance(v, list):
        raise WireError(f"{ctx}{name}", f"expected a list, got {type(v).__name__}")
    if len(v) > max_len:
        raise WireError(f"{ctx}{name}", f"{len(v)} items exceeds the limit of {max_len}", Problem.TOO_LARGE)
    return v


def is_entry_key(v: object) -> bool:
    """17 bytes whose first is a Kind (protocol/keys.py)."""
    return isinstance(v, bytes) and len(v) == ENTRY_KEY_BYTES and v[0] in KIND_BYTES


def req_entry_keys(h: dict[str, object], name: str, max_len: int) -> list[bytes]:
    """A list of entry keys (commit, replica drop, NIXL commit); a bad one is named by its index."""
    keys: list[bytes] = []
    for i, k in enumerate(req_list(h, name, "", max_len)):
        if not is_entry_key(k):
            raise WireError(f"{name}[{i}]", f"expected a {ENTRY_KEY_BYTES}-byte entry key")
        keys.append(k)  # type: ignore[arg-type]  # is_entry_key checked it is bytes
    return keys


KIND_BYTES = frozenset(int(k) for k in Kind)  # the first byte of every valid entry key


def req_map(v: object, ctx: str) -> dict[str, object]:
    if not isinstance(v, dict):
        raise WireError(ctx, f"expected a map, got {type(v).__name__}")
    return v


def req_kind(h: dict[str, object], name: str, ctx: str) -> Kind:
    v = req_int(h, name, ctx, 1, 3)
    return Kind(v)


def split_hashes(packed: bytes) -> list[BlockHash]:
    return [BlockHash(packed[i : i + HASH_BYTES]) for i in range(0, len(packed), HASH_BYTES)]


__all__ = ["KIND_BYTES", "WireError", "is_entry_key", "opt_bin", "req_bin", "req_bool", "req_entry_keys", "req_int", "req_kind",
           "req_list", "req_map", "split_hashes"]
