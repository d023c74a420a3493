"""NIXL data path tests: real agents (UCX, DRAM to DRAM over loopback), real stores.

Skipped where nixl is not installed (the ``test`` extra installs it, so CI runs them). The
check looks the package up without importing it: importing nixl with a CPU build of torch
installed costs seconds (it imports torch to look for CUDA); the code under test avoids that.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _installed() -> bool:
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):
        return False


#: Test modules start with ``pytestmark = NEEDS_NIXL``: pytest.importorskip, minus the import.
NEEDS_NIXL = pytest.mark.skipif(not _installed(), reason="nixl is not installed (pip install nixl, or the 'test' extra)")

os.environ.setdefault("UCX_MODULES", "^ib")  # before any agent of this process starts UCX
