#!/usr/bin/env bash
# Install LMCache into a Python environment that already has the CPU torch, without letting pip
# replace that torch or pull LMCache's GPU and cloud dependencies.
#
#   tests/lmcache/install_lmcache.sh [PYTHON]        (default: python)
#
# LMCache's wheel requires cupy-cuda13x, cuda-python, cufile-python, nvtx, the Google Cloud and
# Bigtable clients, gRPC, OpenTelemetry exporters, redis, awscrt ... and numpy<=2.2.6, which the
# installed numpy is not (LMCache's CPU paths here run on it). So:
#   1. lmcache==0.5.6 without its dependencies (its native modules are built for CPU too);
#   2. the modules its storage backends, remote connectors and token database import on CPU:
#        numba (LMCache's CPU torch ops), py-cpuinfo, cachetools, aiofile, pyyaml, msgspec, pyzmq,
#        psutil, safetensors, transformers (prometheus-client comes with prefixstore),
#   all under a constraints file that pins torch==2.13.0.
set -euo pipefail

PYTHON=${1:-python}
LMCACHE_VERSION=${LMCACHE_VERSION:-0.5.6}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "torch==${TORCH_VERSION}" > "$work/constraints.txt"

echo "[install_lmcache] lmcache==${LMCACHE_VERSION} (no deps) into $($PYTHON -c 'import sys; print(sys.prefix)')"
"$PYTHON" -m pip install --no-deps -c "$work/constraints.txt" "lmcache==${LMCACHE_VERSION}"
"$PYTHON" -m pip install -c "$work/constraints.txt" "numba==0.65.1" py-cpuinfo cachetools aiofile pyyaml msgspec \
    pyzmq psutil safetensors "transformers==5.19.0"

"$PYTHON" -W ignore - <<'PY'
import importlib.metadata as md

import torch
from lmcache.v1.storage_backend import CreateStorageBackends  # noqa: F401
from lmcache.v1.storage_backend.connector import ConnectorAdapter  # noqa: F401
from lmcache.v1.token_database import ChunkedTokenDatabase  # noqa: F401

print(f"[install_lmcache] ok: lmcache {md.version('lmcache')}, torch {torch.__version__}")
PY
