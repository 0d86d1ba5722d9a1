"""Launch-test worker: write real DeepSpeed checkpoints, and the losses DeepSpeed gets continuing
from them (run under torchrun with 2 ranks; DS_ACCELERATOR=cpu).

    ds_ckpt_gen.py OUT CASE [CASE ...]     CASE = s<stage>-<fp32|bf16|fp16>[-offload]

For each case: a tiny GPT (tied embeddings, one frozen parameter) trains J steps under
DeepSpeed, saves OUT/CASE (client_state {"case": CASE}), continues STEPS steps; rank 0 writes the
global-mean loss of each continued step to OUT/CASE/losses.json. The global batch (6 samples) is
the same at every world size (micro-batch 1), so zeroshard at 1, 2 or 3 ranks continues the
same computation (ds_ckpt_load.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ds_ckpt_common import GLOBAL_BATCH, J, batches, ds_config, make_model, model_parameters, step_losses


def _allow_fp16_on_cpu() -> None:
    # DeepSpeed's CPU accelerator refuses fp16; patch the live object in this process only.
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    acc.is_fp16_supported = lambda: True  # type: ignore[method-assign]


def run_case(case: str, out: Path, client: dict[str, Any] | None = None) -> None:
    """`client`: more client_state keys (ds_universal_gen.py adds what DeepSpeed's converter needs)."""
    import deepspeed
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    cfg: dict[str, Any] = ds_config(case, world)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model_parameters(model, case), config=cfg)
    data = batches()
    gas = GLOBAL_BATCH // world
    step_losses(engine, data[:J], rank, world, gas)
    engine.save_checkpoint(str(out / case), client_state={"case": case, "steps": J, **(client or {})})
    losses = step_losses(engine, data[J:], rank, world, gas)
    if rank == 0:
        (out / case / "losses.json").write_text(json.dumps({"losses": losses, "global_steps": engine.global_steps,
                                                             "global_samples": engine.global_samples}))
    dist.barrier()
    engine.destroy()


def main(out: Path, cases: list[str]) -> None:
    import deepspeed

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed.init_distributed(dist_backend="gloo")
    if any("fp16" in c for c in cases):
        _allow_fp16_on_cpu()
    torch.set_num_threads(1)
    for case in cases:
        run_case(case, out)
        print(f"DS CASE OK {case}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
