"""Launch-test worker: real DeepSpeed resumes from universal checkpoints `zeroshard to-deepspeed`
wrote, and must continue as zeroshard did (run under torchrun; DS_ACCELERATOR=cpu).

    ds_universal_load.py DIR STAGES CASE-uc [CASE-uc ...]    STAGES: DeepSpeed ZeRO stages, e.g. "1,3"

DIR/<case> is zeroshard's save with the losses of continuing (zs_universal_gen.py), DIR/<case>-uc
its conversion. DeepSpeed 0.19.8 with `"checkpoint": {"load_universal": true}` loads DIR/<case>-uc
into each stage at this world size, continues the same global batches and must get zeroshard's
losses (fp32 1e-5, bf16 2e-3) and client state. Prints "DSUC OK <case> -> stage <s> world <w>:
max |dloss| <x>".
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ds_ckpt_common import GLOBAL_BATCH, J, batches, ds_config, make_model, model_parameters, parse_case, step_losses

TOL = {"fp32": 1e-5, "bf16": 2e-3}


def main(root: Path, stages: str, cases: list[str]) -> None:
    import deepspeed
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches()
    for case in cases:
        base = case.removesuffix("-uc")
        _, precision, _ = parse_case(base)
        want = json.loads((root / base / "losses.json").read_text())
        for stage in [int(s) for s in stages.split(",")]:
            # DeepSpeed's universal load restores only what its optimizer holds: frozen parameters
            # keep the values the model was built with (zeroshard restores them from the
            # checkpoint; docs/deepspeed-differences.md). So the model is built as the saved run
            # built it; the trained parameters, 3 steps away from that, must come from the file.
            model = make_model(seed=0)
            cfg = ds_config(base, world, stage) | {"checkpoint": {"load_universal": True}}
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model_parameters(model, base),
                                                   config=cfg)
            path, client = engine.load_checkpoint(str(root / case))
            if path is None or client.get("case") != base or client.get("steps") != J:
                raise AssertionError(f"{case}: DeepSpeed's load returned {path!r}, client_state {client!r}")
            if engine.global_steps != J or engine.global_samples != J * GLOBAL_BATCH:
                raise AssertionError(f"{case}: global_steps {engine.global_steps}, global_samples "
                                     f"{engine.global_samples}; expected {J}, {J * GLOBAL_BATCH}")
            got = step_losses(engine, data[J:], rank, world, GLOBAL_BATCH // world)
            dev = max(abs(a - b) for a, b in zip(got, want["losses"], strict=True))
            if not dev <= TOL[precision]:
                raise AssertionError(f"{case} -> DeepSpeed stage {stage} at world {world}: losses {got}, zeroshard "
                                     f"{want['losses']}: max deviation {dev:.3e} > {TOL[precision]}")
            if rank == 0:
                print(f"DSUC OK {case} -> stage {stage} world {world}: max |dloss| {dev:.3e}", flush=True)
            engine.destroy()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
