"""The control channel's messages: one WebSocket per client and node (``GET /v1/control``) that
carries the calls on an engine's critical path, a lookup or a cluster probe, without an HTTP
request each.

Why: on a loopback round trip a lookup's own work (parse, match, answer) is a fraction of what one
HTTP request through aiohttp's server costs: its request object, the middlewares, the response.
A binary WebSocket message costs a few hundred microseconds less, on both ends, and most where it
matters: a lookup arriving at a CPU that has been idle (docs/benchmarks.md).

Each message is one call or one answer, little-endian::

    call    u32 call id | u8 op | the request frame, exactly as the POST body (protocol/wire.py)
    answer  u32 call id | u16 status | 200: the answer frame as the POST's answer body;
                                       otherwise the POST's error body ({"error", "field"} JSON)

Answers carry the id of their call, so calls may overlap on one channel. The channel is an
optimisation, never a requirement: a client that cannot open it (an older store, a proxy that
does not pass WebSockets) sends the same frames as POSTs, and the answers are the same.
"""

from __future__ import annotations

import struct
from typing import Final

CONTROL_PATH: Final = "/v1/control"
CALL: Final = struct.Struct("<IB")
ANSWER: Final = struct.Struct("<IH")
OPS: Final = {1: "/v1/lookup", 2: "/v1/probe"}
"""The calls the channel carries, by op (numbers are never reused; a store answers an op it does
not know 404 naming ``op``, and the client sends that call as a POST)."""
OP_OF: Final = {path: op for op, path in OPS.items()}


def op_of(path: str) -> int | None:
    """The op of a POST path the channel carries, or None."""
    return OP_OF.get(path)


def path_of(op: int) -> str | None:
    return OPS.get(op)


__all__ = ["ANSWER", "CALL", "CONTROL_PATH", "OPS", "OP_OF", "op_of", "path_of"]
