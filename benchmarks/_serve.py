"""Child-process servers for the benchmarks' ``--server subprocess`` mode (not run by hand).

Prints ``LISTENING <port>`` once it accepts connections and runs until
SIGTERM. See ``_harness.py`` for the kinds (store, echo, bulk).
"""

from __future__ import annotations

import asyncio
import sys

from _harness import child_main

if __name__ == "__main__":
    asyncio.run(child_main(sys.argv[1:]))
