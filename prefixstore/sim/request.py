"""One request of a trace, and the error a malformed trace raises: the shared vocabulary of the
synthetic generators (traces.py) and the ShareGPT reader (sharegpt.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

VOCAB = 50_000


@dataclass(frozen=True, slots=True)
class Request:
    session_id: str
    input_tokens: list[int]
    output_tokens: list[int]
    ts: float | None = None

    def to_json(self) -> str:
        d: dict[str, object] = {"session_id": self.session_id, "input_tokens": self.input_tokens,
                                "output_tokens": self.output_tokens}
        if self.ts is not None:
            d["ts"] = self.ts
        return json.dumps(d, separators=(",", ":"))


class TraceError(ValueError):
    pass


__all__ = ["VOCAB", "Request", "TraceError"]
