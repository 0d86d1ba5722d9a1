"""Launch-test worker: DeepSpeed 0.19.8 saves a legacy-MoE model (tests/differential/moe_worker.py's
model and data, top-1 with dropped routes, 4 experts) at 2 ranks and ep_size 2; zeroshard loads the
checkpoint at another layout and continues as DeepSpeed's uninterrupted run.

    torchrun --nproc-per-node=2 ds_moe_ckpt.py gen ROOT CASE...         (DeepSpeed, 2 ranks, ep 2)
    torchrun --nproc-per-node=W ds_moe_ckpt.py load ROOT EP STAGE CASE... (zeroshard, W ranks)

A case is `s<stage>-<precision>` (s0-fp32, s2-fp32, s2-bf16, ...). `gen` trains 2 steps, saves
ROOT/CASE, trains 2 more steps and writes ROOT/CASE.ref<r>.pt per rank: its per-step losses and its
parameters after step 4 under global expert ids. `load` builds a fresh zeroshard engine at `EP`
and `STAGE`, loads ROOT/CASE with optimizer state, trains steps 3 and 4 on the same samples (a
rank takes the micro-batches of 2 / W saved ranks as accumulation steps), and compares the losses
and the final weights with DeepSpeed's: "DSMOE OK CASE -> world W ep E stage S: ..." or an error.
No gradient clipping: DeepSpeed's fp32 ZeRO-0 norm of an MoE model depends on the layout
(docs/moe.md), so a run at another layout would clip by another norm.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "differential"))

import moe_worker as W

SAVED_WORLD, SAVED_EP, SAVE_AT, STEPS, CASE = 2, 2, 2, 4, "top1_drop"
TOL = {"fp32": (1e-5, 1e-5), "bf16": (2e-3, 1e-2)}
"""Relative deviation allowed in (the first continued step's loss, which depends only on the loaded
weights; later losses and the final weights). bf16: one ulp is 3.9e-3 of a weight, and a run at
another layout sums its bf16 gradients in another order (2.7e-3 to 5.3e-3 measured)."""


def config(stage: int, precision: str, gas: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": W.MICRO, "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_allow_untested_optimizer": True, "steps_per_print": 1000, "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def engine(name: str, ep: int, stage: int, precision: str, gas: int) -> Any:
    if name == "ds":
        import deepspeed
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    else:
        import zeroshard as deepspeed
        from zeroshard.moe.layer import MoE
        from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    model = W.build(MoE, ep, CASE)
    groups = split({"params": list(model.parameters()), "name": "parameters"})
    eng, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config(stage, precision, gas))
    return eng


def global_weights(eng: Any, ep: int) -> dict[str, torch.Tensor]:
    """This rank's parameters, its experts under their global ids (`(rank % ep) * L + j`)."""
    local = W.EXPERTS // ep
    first = (dist.get_rank() % ep) * local
    out = {}
    for n, p in eng.module.named_parameters():
        head, sep, tail = n.partition("deepspeed_experts.")
        if sep:
            j, rest = tail.split(".", 1)
            n = f"{head}{sep}{first + int(j)}.{rest}"
        out[n] = p.detach().float().clone()
    return out


def train(eng: Any, steps: range, ranks: list[int], precision: str) -> list[list[float]]:
    """Per step, the mean loss of each saved rank in `ranks` (this process takes their micro-batches)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rows = []
    for step in steps:
        losses = {r: 0.0 for r in ranks}
        for micro in range(W.GAS):
            for r in ranks:
                loss = eng(*(t.to(dtype) for t in W.data(step, micro, r)))
                eng.backward(loss)
                eng.step()
                losses[r] += loss.item() / W.GAS
        rows.append([losses[r] for r in ranks])
    return rows


def gen(root: Path, cases: list[str]) -> None:
    rank = dist.get_rank()
    for case in cases:
        stage, precision = int(case[1]), case.split("-")[1]
        eng = engine("ds", SAVED_EP, stage, precision, W.GAS)
        train(eng, range(SAVE_AT), [rank], precision)
        eng.save_checkpoint(str(root / case), tag="global_step2")
        losses = train(eng, range(SAVE_AT, STEPS), [rank], precision)
        torch.save({"losses": losses, "weights": global_weights(eng, SAVED_EP)}, root / f"{case}.ref{rank}.pt")
        dist.barrier()
        print(f"DSMOE GEN OK {case}", flush=True)


def load(root: Path, ep: int, stage: int, cases: list[str]) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    per = SAVED_WORLD // world  # saved ranks whose micro-batches this rank takes
    ranks = list(range(rank * per, rank * per + per))
    for case in cases:
        precision = case.split("-")[1]
        refs = [torch.load(root / f"{case}.ref{r}.pt") for r in range(SAVED_WORLD)]
        eng = engine("zs", ep, stage, precision, W.GAS * per)
        eng.load_checkpoint(str(root / case))
        if eng.global_steps != SAVE_AT:
            raise AssertionError(f"{case}: global_steps {eng.global_steps} after the load, saved at {SAVE_AT}")
        losses = train(eng, range(SAVE_AT, STEPS), ranks, precision)
        steps = [max(abs(a - refs[r]["losses"][s][0]) / abs(refs[r]["losses"][s][0])
                     for a, r in zip(row, ranks, strict=True)) for s, row in enumerate(losses)]
        want = {**refs[1]["weights"], **refs[0]["weights"]}  # every expert by global id; dense from rank 0
        ours = global_weights(eng, ep)
        dweight = max(((t - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-3)).item()
                      for n, t in ours.items())
        first, later = TOL[precision]
        what = (f"{case} -> world {world} ep {ep} stage {stage}: rel |dloss| {steps[0]:.1e} then {max(steps):.1e}, "
                f"max rel |dweight| {dweight:.1e}")
        if steps[0] > first or max(steps) > later or dweight > later:
            raise AssertionError(f"{what}: over {first} (first step) or {later}")
        print(f"DSMOE OK {what}", flush=True)
        dist.barrier()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "gen":
        gen(root, sys.argv[3:])
    else:
        load(root, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
