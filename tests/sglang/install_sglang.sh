#!/usr/bin/env bash
# Install what the SGLang backend's tests import from SGLang into a Python environment that
# already has the CPU torch, without letting pip replace that torch or pull SGLang's GPU stack.
#
#   tests/sglang/install_sglang.sh [PYTHON]        (default: python)
#
# SGLang's wheel pins torch==2.14.1, flashinfer, sglang-kernel (CUDA), CUDA Python and ~80 more
# packages, most of them GPU kernels or server pieces the storage backend never touches. So:
#   1. sglang==0.5.23 without its dependencies (39 MB; the backend needs only its Python modules);
#   2. the modules the backend's import path reaches (hicache_storage, storage/backend_factory,
#      the host pools pool_host/{mha,mamba}, memory_pool, managers/cache_controller), all under a
#      constraints file that pins torch==2.13.0 so pip can never swap the torch underneath:
#        orjson psutil pybase64 requests msgspec pydantic pyzmq tqdm IPython pillow starlette dill
#        transformers (configs), sentencepiece, compressed-tensors, gguf, apache-tvm-ffi (kernel
#        registries imported at module level)
#   3. two with --no-deps, because `import sglang` needs them and their own pins are wrong here:
#        triton==3.7.0      sglang/srt/utils/common.py imports it unconditionally (no kernel runs
#                           on CPU; 201 MB wheel). There is no import path to HiCacheStorage that
#                           avoids it: `import sglang` itself reaches that module.
#        torchvision==0.16.2  sglang/srt/configs imports torchvision.transforms (InternVL image
#                           preprocessing) when memory_pool loads. PyPI has torchvision only as CUDA
#                           builds, whose C++ ops cannot load against the CPU torch; every release
#                           after 0.16 registers fake kernels for those ops at import time and so
#                           fails to import without them. 0.16.2's pure-Python transforms import,
#                           its ops stay unloaded, and nothing on this path calls them.
# pip's cache is reused between runs: a second run downloads nothing.
set -euo pipefail

PYTHON=${1:-python}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "torch==${TORCH_VERSION}" > "$work/constraints.txt"

echo "[install_sglang] sglang==${SGLANG_VERSION} (no deps) into $($PYTHON -c 'import sys; print(sys.prefix)')"
"$PYTHON" -m pip install --no-deps -c "$work/constraints.txt" "sglang==${SGLANG_VERSION}" "triton==3.7.0" \
    "torchvision==0.16.2"
"$PYTHON" -m pip install -c "$work/constraints.txt" orjson psutil pybase64 requests msgspec pydantic pyzmq tqdm \
    IPython pillow starlette dill "transformers==5.19.0" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf \
    "apache-tvm-ffi==0.1.11"

"$PYTHON" -W ignore - <<'PY'
import importlib.metadata as md

import torch
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: F401
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: F401
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: F401

print(f"[install_sglang] ok: sglang {md.version('sglang')}, torch {torch.__version__}")
PY
