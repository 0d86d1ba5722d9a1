"""Launch-test worker: zeroshard loads the matrix's DeepSpeed checkpoints (ds_matrix_gen.py) at this
world size into each of STAGES and continues; the losses must be DeepSpeed's continued losses.

    ds_matrix_load.py DIR STAGES CASE [CASE ...]     STAGES e.g. "0,1,2,3"

Prints "DSMATRIX OK <case> -> stage <s> world <w>: max |dloss| <x>" per (case, stage), or
"DSMATRIX FAILED <case> -> stage <s> world <w>: <first line>" and goes on with the next one.
Cases whose DeepSpeed run did not write losses.json are skipped with "DSMATRIX NOCKPT <case>".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ds_matrix_common import J, batches, ds_config, make_model, model_parameters, parse, step_losses

import zeroshard

TOL = {"fp32": 1e-5, "bf16": 2e-3, "fp16": 2e-3}


def check(root: Path, case: str, stage: int, rank: int, world: int) -> float:
    _, _, _, precision, _ = parse(case)
    want = json.loads((root / case / "losses.json").read_text())
    model = make_model(case, seed=7)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model_parameters(model, case),
                                           config=ds_config(case, world, stage))
    path, client = engine.load_checkpoint(root / case)
    if path is None or (client or {}).get("case") != case or engine.global_steps != J:
        raise AssertionError(f"load returned {path!r}, client_state {client!r}, global_steps {engine.global_steps}")
    got = step_losses(engine, batches()[J:], rank, world)
    dev = max(abs(a - b) for a, b in zip(got, want["losses"], strict=True))
    if not abs(got[0] - want["losses"][0]) <= 1e-4:
        raise AssertionError(f"first continued loss {got[0]}, DeepSpeed {want['losses'][0]}: the loaded weights differ")
    if not dev <= TOL[precision]:
        raise AssertionError(f"losses {got}, DeepSpeed {want['losses']}: max deviation {dev:.3e} > {TOL[precision]}")
    return dev


def main(root: Path, stages: str, cases: list[str]) -> None:
    groups = zeroshard.init_distributed()
    rank, world = groups.rank, groups.world_size
    torch.set_num_threads(1)
    for case in cases:
        if not (root / case / "losses.json").is_file():
            if rank == 0:
                print(f"DSMATRIX NOCKPT {case}", flush=True)
            continue
        for stage in [int(s) for s in stages.split(",")]:
            try:
                dev = check(root, case, stage, rank, world)
            except Exception as e:
                if rank == 0:
                    first = str(e).splitlines()[0] if str(e) else ""
                    print(f"DSMATRIX FAILED {case} -> stage {stage} world {world}: {type(e).__name__}: {first}",
                          flush=True)
                continue
            if rank == 0:
                print(f"DSMATRIX OK {case} -> stage {stage} world {world}: max |dloss| {dev:.3e}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
