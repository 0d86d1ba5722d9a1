"""examples/deepspeed_port/train.py under zeroshard and under DeepSpeed 0.19 (import swapped):
the same per-step losses at world size 1 and 2 (fp32, 1e-5 relative), including the steps
after save_checkpoint -> load_checkpoint, and the same fp32 master weight norm.

Skipped only when DeepSpeed is not installed. DeepSpeed runs on CPU (`DS_ACCELERATOR=cpu`);
its ops JIT-build once into `TORCH_EXTENSIONS_DIR` (default: `.ds_build/` in the checkout).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest
from torchrun_cmd import torchrun

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "deepspeed_port"
IMPORT_LINE = "import zeroshard as deepspeed\n"
RTOL = 1e-5

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is not installed (pip install deepspeed)")


def deepspeed_copy(tmp: Path) -> Path:
    """The example with its one import line swapped; nothing else may differ."""
    source = (EXAMPLE / "train.py").read_text()
    if source.count(IMPORT_LINE) != 1:
        raise AssertionError(f"expected the example to contain {IMPORT_LINE!r} exactly once")
    ported = source.replace(IMPORT_LINE, "import deepspeed\n")
    changed = [(a, b) for a, b in zip(source.splitlines(), ported.splitlines()) if a != b]
    assert changed == [("import zeroshard as deepspeed", "import deepspeed")]
    path = tmp / "train_deepspeed.py"
    path.write_text(ported)
    return path


def run(script: Path, world: int, tmp: Path, tag: str) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".ds_build"))
    cmd = torchrun(world, str(script), "--deepspeed", "--deepspeed_config", str(EXAMPLE / "ds_config.json"),
                   "--checkpoint_dir", str(tmp / f"ckpt-{tag}"))
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{tag} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    lines = [ln for ln in done.stdout.splitlines() if re.match(r"^(step \d+ loss|resumed|fc2\.weight)", ln)]
    print(f"--- {tag}\n" + "\n".join(lines))
    return lines


def numbers(lines: list[str]) -> list[float]:
    return [float(x) for ln in lines for x in re.findall(r"(?:loss|lr|norm) ([-\d.e]+)", ln)]


def shape(lines: list[str]) -> list[str]:
    return [re.sub(r"(loss|lr|norm) [-\d.e]+", r"\1 #", ln) for ln in lines]


@pytest.mark.parametrize("world", [1, 2])
def test_example_gives_deepspeeds_losses(tmp_path: Path, world: int) -> None:
    ours = run(EXAMPLE / "train.py", world, tmp_path, f"zeroshard-{world}")
    theirs = run(deepspeed_copy(tmp_path), world, tmp_path, f"deepspeed-{world}")
    assert len(ours) == len(theirs) == 9 + 1 + 3 + 1, (ours, theirs)
    assert shape(ours) == shape(theirs)
    for a, b, line in zip(numbers(ours), numbers(theirs), ours):
        assert abs(a - b) <= RTOL * abs(b), f"{line}: zeroshard {a} vs DeepSpeed {b}"
    resumed = [ln for ln in ours if ln.startswith("step")]
    assert resumed[6:9] == resumed[9:12], "steps after load_checkpoint repeat the ones after the save"
