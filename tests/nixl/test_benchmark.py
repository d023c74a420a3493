"""benchmarks/nixl_transfer.py runs end to end with --quick (figures meaningless) and documents its flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..serve_process import clean_env
from .conftest import NEEDS_NIXL

pytestmark = NEEDS_NIXL
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "nixl_transfer.py"


@pytest.mark.slow
def test_quick_run_writes_json_and_png(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--reps", "1", "--warmup", "0",
                           "--payload-sizes", "64KiB", "--batch-bytes", "1MiB", "--prefix-tokens", "1024",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=SCRIPT.parents[1], env=clean_env())
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads((out / "nixl_transfer.json").read_text())
    assert results["benchmark"] == "nixl_transfer" and len(results["results"]) == 1
    for r in results["results"]:
        assert set(r["figures"]) == {"nixl_get", "nixl_get_placed", "nixl_get_nocheck", "nixl_get_placed_nocheck",
                                     "http_get", "raw_read", "nixl_put", "http_put"}
    assert results["prefix_load"]["tokens"] == 1024
    assert (out / "nixl_transfer.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_help_documents_every_flag() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60,
                          cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stderr
    for flag in ("--out", "--quick", "--reps", "--warmup", "--seed", "--payload-sizes", "--batch-bytes",
                 "--prefix-tokens", "--tier", "--hash-chunk", "--python-check"):
        assert flag in proc.stdout


GPU_SCRIPT = SCRIPT.with_name("nixl_gpu.py")


@pytest.mark.slow
def test_gpu_benchmark_runs_with_host_memory_standing_in(tmp_path: Path) -> None:
    """benchmarks/nixl_gpu.py --device cpu: every call of the GPU run, on host memory, bytes checked."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(GPU_SCRIPT), "--quick", "--device", "cpu", "--reps", "1",
                           "--warmup", "0", "--payload-sizes", "64KiB", "--batch-bytes", "1MiB",
                           "--prefix-tokens", "1024", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=GPU_SCRIPT.parents[1], env=clean_env())
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads((out / "nixl_gpu.json").read_text())
    [r] = results["results"]
    assert set(r["figures"]) == {"vram_get", "host_get_h2d", "http_get_h2d", "raw_vram", "raw_host"}
    assert {"vram", "nixl", "http"} <= set(results["prefix"])
    assert (out / "nixl_gpu.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    help_text = subprocess.run([sys.executable, str(GPU_SCRIPT), "--help"], capture_output=True, text=True,
                               timeout=60, cwd=GPU_SCRIPT.parents[1]).stdout
    for flag in ("--out", "--quick", "--reps", "--warmup", "--seed", "--payload-sizes", "--batch-bytes",
                 "--prefix-tokens", "--device"):
        assert flag in help_text
