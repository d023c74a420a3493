#!/usr/bin/env bash
# The GPU machine's one prepared run: the NIXL and gpu_staging tests with CUDA tensors (VRAM
# registration, READs into GPU memory, the engine's layer-wise loads on the GPU), then
# benchmarks/nixl_gpu.py. Writes tests.log, bench.log, nixl_gpu.json and nixl_gpu.png to OUTDIR.
#
#   bash benchmarks/gpu_run.sh OUTDIR
#
# On a machine without network, WHEELS=DIR installs nixl, nixl-cu13, lmdb, pytest and
# pytest-asyncio from wheels in DIR first (into /tmp/site). Where the package is not installed,
# it runs from this tree: prefixstore/ gets links to the parts pyproject's package-dir maps into
# it, and the optional native hash loop is built in place (pure Python without a compiler).
set -u
OUT=${1:-benchmarks/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 UCX_MODULES=^ib
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import prefixstore.protocol" 2>/dev/null; then
  for part in protocol transport store client admission gpu_staging; do ln -sfn "../$part" "prefixstore/$part"; done
  python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "no native hash loop (pure Python)"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, nixl._api, pytest; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'pytest', pytest.__version__)" || exit 1
set -o pipefail
timeout 180 python3 -m pytest -q -p no:cacheprovider -ra tests/nixl tests/gpu_staging 2>&1 | tee "$OUT/tests.log"
echo "tests rc=$?"
timeout 150 python3 benchmarks/nixl_gpu.py --reps 7 --out "$OUT" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=$?"
for chunk in 8MiB 0; do  # hashed READs in 8 MiB chunks overlapping the hashing (default), or one READ then hash
  mkdir -p "$OUT/host_chunk_$chunk"
  timeout 120 python3 benchmarks/nixl_transfer.py --reps 5 --prefix-tokens 0 --hash-chunk "$chunk" \
    --out "$OUT/host_chunk_$chunk" 2>&1 | tee "$OUT/host_chunk_$chunk/bench.log"
  echo "host bench (hash chunk $chunk) rc=$?"
done
