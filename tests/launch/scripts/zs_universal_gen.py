"""Launch-test worker: zeroshard checkpoints for `zeroshard to-deepspeed`, and the losses zeroshard
gets continuing from them (plain python for world 1, torchrun otherwise).

    zs_universal_gen.py OUT CASE [CASE ...]     CASE as in ds_ckpt_common (s<stage>-<precision>[-groups])

For each case, the mirror of ds_ckpt_gen.py with zeroshard as the engine: a tiny GPT trains J
steps, saves OUT/CASE (client_state {"case": CASE, "steps": J}), continues STEPS steps; rank 0
writes the global-mean loss of each continued step to OUT/CASE/losses.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ds_ckpt_common import GLOBAL_BATCH, J, batches, ds_config, make_model, model_parameters, step_losses

import zeroshard


def main(out: Path, cases: list[str]) -> None:
    groups = zeroshard.init_distributed()
    rank, world = groups.rank, groups.world_size
    torch.set_num_threads(1)
    data = batches()
    gas = GLOBAL_BATCH // world
    for case in cases:
        model = make_model()
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model_parameters(model, case),
                                               config=ds_config(case, world))
        step_losses(engine, data[:J], rank, world, gas)
        engine.save_checkpoint(str(out / case), client_state={"case": case, "steps": J})
        losses = step_losses(engine, data[J:], rank, world, gas)
        if rank == 0:
            (out / case / "losses.json").write_text(json.dumps({"losses": losses, "global_steps": engine.global_steps,
                                                                 "global_samples": engine.global_samples}))
            print(f"ZS CASE OK {case}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
