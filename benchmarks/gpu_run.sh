#!/usr/bin/env bash
# The GPU machine's one prepared run: the NIXL and gpu_staging tests with CUDA tensors (VRAM
# registration, READs into GPU memory, the engine's layer-wise loads on the GPU), then
# benchmarks/nixl_gpu.py. Writes tests.log, bench.log, nixl_gpu.json and nixl_gpu.png to OUTDIR.
#
#   bash benchmarks/gpu_run.sh OUTDIR
#
# On a machine without network, WHEELS=DIR installs nixl, nixl-cu13, lmdb, pytest and
# pytest-asyncio from wheels in DIR first (into /tmp/site). The package itself is installed
# editable into the running python3 (as the CI does in its venv).
set -u
OUT=${1:-benchmarks/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 UCX_MODULES=^ib
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, nixl._api, pytest; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'pytest', pytest.__version__)" || exit 1
set -o pipefail
timeout 300 python3 -m pytest -q -p no:cacheprovider -ra tests/nixl tests/gpu_staging 2>&1 | tee "$OUT/tests.log"
echo "tests rc=$?"
timeout 240 python3 benchmarks/nixl_gpu.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=$?"
