"""A DeepSpeed AutoTP checkpoint (per-TP-rank files, tests/dist/ds_autotp_writer.py) loads into
zeroshard at TP 2 and at TP 1 (data parallel over the same ranks), weights and Adam state, and the
run continues equal to an uninterrupted plain-torch run (checkpoint/ds_autotp.py). Runs at 2 ranks;
DeepSpeed's own files: tests/differential/test_autotp_checkpoint.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ds_autotp_writer import write_autotp
from tp_helpers import ROUNDOFF_MARGIN, batches, lm_loss, split_reduction_linear, tiny_llama, tp_config

import zeroshard
from zeroshard.comm import Comm, ProcessGroups

LR, CLIP, SAVE_AT, STEPS = 1e-3, 0.5, 2, 4
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROW = ("o_proj", "down_proj")


def _split(name: str) -> int | None:
    """DeepSpeed 0.19.8's AutoTP split of the tiny Llama (as its files show): columns cut the
    output dim (0), rows the input dim (1); embedding and norms whole."""
    if any(k in name for k in COLUMN):
        return 0
    return 1 if any(k in name for k in ROW) else None


def _reference(data: list[torch.Tensor]) -> tuple[list[float], dict, dict, list]:
    """Plain torch: SAVE_AT steps, the state to save, then the rest (the uninterrupted losses)."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, saved, state = [], {}, {}
    for step, ids in enumerate(data):
        if step == SAVE_AT:
            saved = {n: p.detach().clone() for n, p in model.named_parameters()}
            state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
        opt.zero_grad()
        loss = lm_loss(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]
    return losses, saved, state, groups


@pytest.mark.parametrize("stage, save_dp", [(0, 1), (1, 2), (2, 2)], ids=["zero0-tp2xdp1", "zero1-tp2xdp2",
                                                                          "zero2-tp2xdp2"])
def test_autotp_checkpoint_loads_at_tp2_and_tp1(groups: ProcessGroups, shared_dir: Path, stage: int,
                                                save_dp: int) -> None:
    if groups.world_size != 2:
        pytest.skip("written for 2 ranks (TP 2, and TP 1 x DP 2)")
    data = [torch.cat(step) for step in batches(STEPS, 2)]  # one global batch of 4 rows per step
    want, weights, state, param_groups = _reference(data)
    with split_reduction_linear():  # Note: [tolerances from measured round-off] (tp_helpers.py)
        other = _reference(data)[0]
    tol = ROUNDOFF_MARGIN * max(max(abs(a - b) for a, b in zip(want, other)),
                                torch.finfo(torch.float32).eps * max(map(abs, want)))
    if groups.rank == 0:
        write_autotp(shared_dir, "global_step2", tp=2, dp=save_dp, stage=stage, weights=weights, state=state,
                     param_groups=param_groups, splits={n: _split(n) for n in weights}, global_steps=SAVE_AT)
    Comm(groups).barrier()
    for tp in (2, 1):  # TP 2 x DP 1, then TP 1 x DP 2, each at another ZeRO stage than the save's too
        dp = 2 // tp
        load_stage = (stage + tp) % 3
        cfg = tp_config(tp, load_stage, dp, clip=CLIP, lr=LR, train_batch_size=4,
                        train_micro_batch_size_per_gpu=4 // dp)
        engine, *_ = zeroshard.initialize(model=tiny_llama(), config=cfg)
        path, _ = engine.load_checkpoint(str(shared_dir))
        assert path is not None and engine.global_steps == SAVE_AT
        got = []
        for ids in data[SAVE_AT:]:
            loss = lm_loss(engine, ids.chunk(dp)[groups.rank if dp > 1 else 0])
            engine.backward(loss)
            engine.step()
            mean = torch.tensor([loss.item() / groups.world_size])
            torch.distributed.all_reduce(mean)
            got.append(float(mean))  # TP 2: both ranks hold the batch's loss; DP 2: the mean of the halves
        worst = max(abs(a - b) for a, b in zip(got, want[SAVE_AT:], strict=True))
        assert worst <= tol, (f"TP {tp} x DP {dp} (ZeRO-{load_stage}) after the load: {got} vs {want[SAVE_AT:]} "
                              f"(tolerance {tol:.2e})")
