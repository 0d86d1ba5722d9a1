"""`zeroshard to-fp32` on a 25M-parameter checkpoint saved by 2 ranks: the output equals the
live model's weights exactly, and its peak memory (max RSS of the process, minus that of a
process that only imports torch and zeroshard) stays near one copy of the output for a
torch.save file and well below it when streaming safetensors. The figures are printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_cmd import torchrun

from zeroshard.checkpoint.safetensors_io import read_safetensors

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_big.py"
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


PEAK = ("import sys\n"
        "from zeroshard.cli.main import main\n"
        "import zeroshard.checkpoint.to_fp32  # the baseline imports what a conversion imports\n"
        "rc = main(sys.argv[1:]) if len(sys.argv) > 1 else 0\n"
        "status = open('/proc/self/status').read()\n"
        "print('VMHWM_KB', status.split('VmHWM:')[1].split()[0])\n"
        "sys.exit(rc)\n")


def peak_rss_bytes(args: list[str]) -> int:
    """Run `zeroshard ARGS` (nothing, without args) and return its peak RSS (VmHWM) in bytes.

    Read inside the process: ru_maxrss of a child also counts the parent's memory at fork."""
    proc = subprocess.run([sys.executable, "-c", PEAK, *args], cwd=ROOT, env=_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    if proc.returncode != 0 or "VMHWM_KB" not in proc.stdout:
        raise AssertionError(f"zeroshard {args} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return int(proc.stdout.split("VMHWM_KB")[1].split()[0]) * 1024


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("big")
    proc = subprocess.run(torchrun(2, str(SCRIPT), str(out)), cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return out


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_to_fp32_output_and_peak_memory(checkpoint: Path, tmp_path: Path, fmt: str) -> None:
    baseline = peak_rss_bytes([])  # python + torch + zeroshard.cli, nothing converted
    output = tmp_path / f"model.{fmt}"
    args = ["to-fp32", str(checkpoint), str(output), "--chunk-mb", "16", "--no-progress"]
    peak = peak_rss_bytes(args + (["--safetensors"] if fmt == "safetensors" else []))
    size = output.stat().st_size
    extra = peak - baseline
    print(f"\nto-fp32 {fmt}: output {size / 2**20:.1f} MiB, peak RSS {peak / 2**20:.1f} MiB, import-only "
          f"baseline {baseline / 2**20:.1f} MiB, extra {extra / 2**20:.1f} MiB = {extra / size:.2f}x the output")
    live = torch.load(checkpoint / "live.pt", weights_only=True)
    got = read_safetensors(output) if fmt == "safetensors" else torch.load(output, weights_only=True)
    assert sorted(got) == sorted(live)
    for name, value in live.items():
        assert torch.equal(got[name], value), name
    bound = 1.25 if fmt == "pt" else 0.5
    assert extra <= bound * size, f"peak {extra / size:.2f}x the output > {bound}x"
