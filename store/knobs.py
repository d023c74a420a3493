"""How a knob's value is read, and the error that names a knob: shared by the configuration tree
(store/config.py) and the files it points at (store/tenants.py), which therefore need not import
each other."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1 << 10, "KI": 1 << 10,
          "M": 1000**2, "MB": 1000**2, "MIB": 1 << 20, "MI": 1 << 20,
          "G": 1000**3, "GB": 1000**3, "GIB": 1 << 30, "GI": 1 << 30,
          "T": 1000**4, "TB": 1000**4, "TIB": 1 << 40, "TI": 1 << 40}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the knob."""


def parse_size(text: str | int, knob: str) -> int:
    """'4GiB', '512MiB', '1.5GB', '65536' -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"{knob}: {text!r} is not a size (examples: 65536, 64KiB, 4GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


__all__ = ["ConfigError", "parse_size"]
