"""What the three DeepSpeedExamples-style scripts share: the import switch and the loss record.

`DS_EXAMPLE_FRAMEWORK=zeroshard` makes `deepspeed` mean zeroshard (`import zeroshard as deepspeed`);
otherwise the real DeepSpeed is imported. Nothing else in the scripts differs between the two.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def import_deepspeed() -> Any:
    if os.environ.get("DS_EXAMPLE_FRAMEWORK") == "zeroshard":
        import zeroshard as deepspeed
    else:
        import deepspeed  # type: ignore[no-redef]

        # DeepSpeed's CPU accelerator refuses fp16 on processors without AVX512-FP16 kernels; the
        # arithmetic is emulated correctly, so let the reference run (in this process only).
        acc = deepspeed.accelerator.get_accelerator()
        if not acc.is_fp16_supported():
            acc.is_fp16_supported = lambda: True
    return deepspeed


def record_losses(out_dir: str, phase: str, rank: int, losses: list[float]) -> None:
    """Each rank's per-step losses of one phase, as `losses-<phase>-<rank>.json`."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"losses-{phase}-{rank}.json"
    path.write_text(json.dumps(losses))


def check_framework(deepspeed: object) -> None:
    """Fail loudly if a zeroshard run reached the real DeepSpeed (e.g. via `from deepspeed... import`)."""
    import sys

    if os.environ.get("DS_EXAMPLE_FRAMEWORK") == "zeroshard" and "deepspeed" in sys.modules:
        raise AssertionError("the zeroshard run imported the real DeepSpeed")
