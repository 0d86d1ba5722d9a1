"""Launch-test worker: load DeepSpeed checkpoints (ds_ckpt_gen.py) into zeroshard at this world
size and continue; the losses must be DeepSpeed's continued losses (plain python for world 1,
torchrun otherwise).

    ds_ckpt_load.py DIR STAGES CASE [CASE ...]    STAGES: zeroshard stages, e.g. "0,3" ("same": the saved one)

Prints one line per (case, stage): "DSLOAD OK <case> -> stage <s> world <w>: max |dloss| <x>"; a
deviation over the precision's tolerance, or wrong counters/client_state, raises.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zeroshard  # noqa: E402
from ds_ckpt_common import GLOBAL_BATCH, J, batches, ds_config, make_model, parse_case, step_losses  # noqa: E402

TOL = {"fp32": 1e-5, "bf16": 2e-3, "fp16": 2e-2}


def main(root: Path, stages: str, cases: list[str]) -> None:
    groups = zeroshard.init_distributed()
    rank, world = groups.rank, groups.world_size
    torch.set_num_threads(1)
    data = batches()
    for case in cases:
        saved_stage, precision, _ = parse_case(case)
        want = json.loads((root / case / "losses.json").read_text())
        for stage in ([saved_stage] if stages == "same" else [int(s) for s in stages.split(",")]):
            engine, _, _, _ = zeroshard.initialize(model=make_model(seed=7), config=ds_config(case, world, stage))
            path, client = engine.load_checkpoint(root / case)
            if path is None or client is None or client.get("case") != case or client.get("steps") != J:
                raise AssertionError(f"{case}: load returned {path!r}, client_state {client!r}")
            if engine.global_steps != J or engine.global_samples != J * GLOBAL_BATCH:
                raise AssertionError(f"{case}: global_steps {engine.global_steps}, global_samples "
                                     f"{engine.global_samples}; expected {J}, {J * GLOBAL_BATCH}")
            got = step_losses(engine, data[J:], rank, world, GLOBAL_BATCH // world)
            dev = max(abs(a - b) for a, b in zip(got, want["losses"], strict=True))
            if not dev <= TOL[precision]:
                raise AssertionError(f"{case} -> zeroshard stage {stage} at world {world}: losses {got}, "
                                     f"DeepSpeed {want['losses']}: max deviation {dev:.3e} > {TOL[precision]}")
            if engine.global_steps != want["global_steps"]:
                raise AssertionError(f"{case}: continued to step {engine.global_steps}, DeepSpeed {want['global_steps']}")
            if rank == 0:
                print(f"DSLOAD OK {case} -> stage {stage} world {world}: max |dloss| {dev:.3e}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
