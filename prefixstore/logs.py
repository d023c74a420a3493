"""How ``prefixstore serve`` writes its log: the one place a handler is installed (library code only
logs through ``logging.getLogger(__name__)``).

``log_format = text``: one readable line a record. ``json``: one JSON object a line, for log
collectors (Loki, Fluent Bit, Cloud Logging), with ``ts`` (RFC 3339, UTC), ``level``, ``logger``
and ``message``; an access line (store/http.py, logger ``prefixstore.access``) also carries its
fields (method, endpoint, tenant, status, bytes_in, bytes_out, ms, peer) as keys of their own, so a
query can filter on ``status >= 500`` without parsing the message.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def handler(log_format: str, stream: TextIO | None = None) -> logging.Handler:
    h = logging.StreamHandler(stream or sys.stderr)
    h.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    return h


def configure(level: str, log_format: str, stream: TextIO | None = None) -> None:
    """The root logger at ``level`` (a name of store.config.LOG_LEVELS), writing ``log_format``."""
    logging.basicConfig(level=level.upper(), handlers=[handler(log_format, stream)], force=True)


__all__ = ["JsonFormatter", "TEXT_FORMAT", "configure", "handler"]
