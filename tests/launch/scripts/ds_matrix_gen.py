"""Launch-test worker: real DeepSpeed writes the matrix's checkpoints (ds_matrix_common.py) at this
world size and records the losses of continuing (torchrun, DS_ACCELERATOR=cpu).

    ds_matrix_gen.py OUT CASE [CASE ...]     every CASE's world (-w<W>) must be this run's

For each case: train J steps, save OUT/CASE, continue STEPS steps; rank 0 writes the global-mean
losses to OUT/CASE/losses.json. Prints "DS MATRIX OK <case>" (or "DS MATRIX FAILED <case>: ..."
and goes on: a case DeepSpeed itself cannot run is reported, not hidden).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ds_matrix_common import J, batches, ds_config, make_model, model_parameters, parse, step_losses


def run_case(case: str, out: Path) -> None:
    import deepspeed
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if parse(case)[1] != world:
        raise ValueError(f"{case} is saved at world {parse(case)[1]}, this run has {world} ranks")
    model = make_model(case)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model_parameters(model, case),
                                           config=ds_config(case, world))
    data = batches()
    step_losses(engine, data[:J], rank, world)
    engine.save_checkpoint(str(out / case), client_state={"case": case})
    losses = step_losses(engine, data[J:], rank, world)
    if rank == 0:
        (out / case / "losses.json").write_text(json.dumps({"losses": losses, "global_steps": engine.global_steps}))
    dist.barrier()
    engine.destroy()


def main(out: Path, cases: list[str]) -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed.init_distributed(dist_backend="gloo")
    get_accelerator().is_fp16_supported = lambda: True  # CPU accelerator refuses fp16; this process only
    torch.set_num_threads(1)
    for case in cases:
        try:
            run_case(case, out)
        except Exception as e:
            print(f"DS MATRIX FAILED {case}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  flush=True)
            traceback.print_exc()
            continue
        print(f"DS MATRIX OK {case}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
