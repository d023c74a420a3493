"""The optional nixl package, as both ends of the NIXL data path use it (store/nixl_target.py
and client/nixl_path.py): imported lazily with its traps defused, and agents made the one way
this project runs them -- UCX backend, no progress thread, no listener thread.

It lives in transport/ because it is I/O that both ends share, and they may not import each
other (DESIGN §2); it imports nothing of ours and nixl only when called.
"""

from __future__ import annotations

import os
import uuid
from typing import Any


class NixlUnavailable(RuntimeError):
    """The nixl package (or its UCX backend) is not usable here; the message says why."""


def import_nixl() -> Any:
    """The nixl API module, imported lazily (the store never requires nixl).

    UCX reads ``UCX_MODULES`` when the first agent is created; without ``^ib``
    a process that made a UCX backend may crash at exit on machines without
    InfiniBand. Set here, before the import, unless the operator set it. So is
    ``NIXL_LOG_LEVEL=WARN``: nixl logs INFO lines to stdout by default, which is the
    process's own output (a line per agent made), not a log stream."""
    os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        api = _import_api()
    except Exception as err:  # ImportError, or a backend that fails to load
        raise NixlUnavailable(f"nixl is not importable ({type(err).__name__}: {err}); "
                              "install it with `pip install nixl` to serve the NIXL data path") from err
    return api


def _import_api() -> Any:
    """``import nixl._api``, without the seconds nixl spends importing torch to learn there is no CUDA.

    nixl's meta package picks its CUDA wheel (nixl_cu12 / nixl_cu13) from the CUDA version of
    torch. When torch is not imported and its build on disk names no CUDA (a CPU build, or no
    torch at all), its last resort imports all of torch (2-3 s, on every store start) only to get
    None again, and then takes the first wheel installed. Where nothing CUDA is loaded and the
    disk says no CUDA, the answer is known to be None, so it is given without that import: the
    same wheel is chosen, minus the import. Anywhere else nixl decides exactly as it would."""
    import importlib  # noqa: PLC0415
    import sys  # noqa: PLC0415

    if "nixl._api" in sys.modules:
        return sys.modules["nixl._api"]
    meta: Any
    try:
        meta = importlib.import_module("nixl_meta_utils")
    except ImportError:
        meta = None
    cuda_loaded = any(m in sys.modules for m in ("torch", "cuda.bindings", "cupy"))
    if meta is None or cuda_loaded or meta._torch_cuda_version_from_disk() is not None:
        return importlib.import_module("nixl._api")
    original = meta.detect_cuda_major
    meta.detect_cuda_major = lambda: None
    try:
        return importlib.import_module("nixl._api")
    finally:
        meta.detect_cuda_major = original


def make_agent(prefix: str) -> tuple[Any, str]:
    """A UCX agent with neither progress nor listener thread, named uniquely (name reuse across
    restarts would let a client use descriptors of a dead incarnation against a new one)."""
    api = import_nixl()
    name = f"{prefix}-{uuid.uuid4().hex[:16]}"
    try:
        config = api.nixl_agent_config(backends=["UCX"], enable_prog_thread=False, enable_listen_thread=False)
        agent = api.nixl_agent(name, config)
    except Exception as err:
        raise NixlUnavailable(f"cannot create a NIXL agent ({type(err).__name__}: {err})") from err
    if "UCX" not in agent.backends:
        raise NixlUnavailable("the NIXL UCX backend is not available (plugin missing)")
    return agent, name


__all__ = ["NixlUnavailable", "import_nixl", "make_agent"]
