"""Launch-test worker: real DeepSpeed checkpoints converted by DeepSpeed's own `ds_to_universal`,
and the losses DeepSpeed gets continuing from the original (run under torchrun with 2 ranks;
DS_ACCELERATOR=cpu).

    ds_universal_gen.py OUT CASE [CASE ...]     CASE as in ds_ckpt_common (s<stage>-<precision>[-groups])

For each case: ds_ckpt_gen.run_case writes OUT/CASE (a native save after J steps, and the
losses of continuing STEPS steps in OUT/CASE/losses.json); rank 0 then converts OUT/CASE/<tag>
with deepspeed.checkpoint.ds_to_universal into OUT/CASE-uc/<tag> (which writes
OUT/CASE-uc/latest_universal), as a user converts before resuming at another size.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ds_ckpt_gen import run_case


def convert(src: Path, dst: Path) -> None:
    """DeepSpeed's converter, called as its command line does (its defaults, fewer workers)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tag = (src / "latest").read_text().strip()
    args = argparse.Namespace(input_folder=str(src / tag), output_folder=str(dst / tag), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    ds_to_universal(args)


def main(out: Path, cases: list[str]) -> None:
    import deepspeed
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    for case in cases:
        # DeepSpeed's converter refuses a save without this key (its own tests pass it the same way).
        run_case(case, out, client={"universal_checkpoint_info": {}})
        if dist.get_rank() == 0:
            convert(out / case, out / f"{case}-uc")
        dist.barrier()
        print(f"DS UC OK {case}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
