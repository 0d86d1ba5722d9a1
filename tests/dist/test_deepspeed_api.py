"""DeepSpeed's engine and utility API on zeroshard, at 1/2/3 ranks (the safe_* accessors are in
test_safe_accessors.py): backward(scale_wrt_gas), set_gradient_accumulation_
boundary, no_sync, every load_checkpoint flag, save_checkpoint's named errors, the engine's
queries, ds_* attributes, leaf modules, unwrap_model_for_generation and zeroshard.comm."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    api_config,
    close,
    fresh,
    global_batches,
    init_engine,
    make_config,
    make_model,
    params_of,
    rank_micro_batches,
    train_engine,
)
from torch import nn

import zeroshard
import zeroshard.comm as zcomm
from zeroshard.errors import CheckpointError, ConfigError, NotSupportedError
from zeroshard.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    set_z3_leaf_modules,
    unwrap_model_for_generation,
)
from zeroshard.zero import GatheredParameters, ZeroParamStatus

STAGES = [0, 1, 2, 3]


def test_optimizer_state_is_none_before_the_first_step(groups: Any) -> None:
    engine = fresh(2)
    assert safe_get_full_optimizer_state(params_of(engine)[0], "exp_avg") is None


@pytest.mark.parametrize("stage", [0, 3])
def test_public_model_attributes_pass_through_the_engine(groups: Any, stage: int) -> None:
    # DeepSpeed's engine looks up what it does not have on the wrapped model (its
    # TestZero3ClientModuleID: a client `id` attribute; HF's `generate`).
    model = make_model()
    model.id = 3
    model.describe = lambda: "the model's own method"
    model.global_steps = -5  # a name the engine has: the engine's wins
    engine = init_engine(model, make_config(zero_optimization={"stage": stage}))
    assert engine.id == 3
    assert engine.describe() == "the model's own method"
    assert engine.lm_head is engine.module.lm_head
    assert engine.global_steps == 0, "the engine's own names come first"
    model._private = 1
    with pytest.raises(AttributeError, match="_private"):
        _ = engine._private  # private names are the engine's alone
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = engine.no_such_name
    assert not hasattr(engine, "no_such_name")


# -- backward / accumulation ---------------------------------------------------------------------


def test_backward_returns_loss_over_gas_and_scale_wrt_gas_false(groups: Any) -> None:
    rank, world = groups.rank, groups.world_size
    batches = global_batches(2, 2 * 2 * world)
    plain, manual = fresh(1), fresh(1)
    for batch in batches:
        for x, y in rank_micro_batches(batch, rank, world, 2, 2):
            loss = plain(x, y)
            returned = plain.backward(loss)
            assert torch.allclose(returned.detach(), loss.detach() / 2)
            plain.step()
            loss = manual(x, y)
            returned = manual.backward(loss / 2, scale_wrt_gas=False)
            assert torch.allclose(returned.detach(), loss.detach() / 2), "scale_wrt_gas=False: as given"
            manual.step()
    for a, b in zip(params_of(plain), params_of(manual)):
        close(b, a, 1e-6, "scale_wrt_gas=False on a pre-divided loss")


@pytest.mark.parametrize("stage", STAGES)
def test_set_gradient_accumulation_boundary(groups: Any, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    batches = global_batches(2, 2 * 2 * world)
    counted = fresh(stage)
    want, _ = train_engine(counted, batches, rank, world)
    manual = fresh(stage)
    for batch in batches:
        first, last = rank_micro_batches(batch, rank, world, 2, 2)
        manual.set_gradient_accumulation_boundary(False)
        manual.backward(manual(*first))
        assert not manual.is_gradient_accumulation_boundary()
        manual.step()  # not a boundary: no optimizer step
        manual.set_gradient_accumulation_boundary(True)
        manual.backward(manual(*last))
        manual.step()
    assert manual.global_steps == counted.global_steps == 2
    for a, b in zip(params_of(counted), params_of(manual)):
        close(safe_get_full_fp32_param(b), safe_get_full_fp32_param(a), 1e-6, "manual boundary")


def test_boundary_loop_stepping_once_per_step_can_save(groups: Any, shared_dir: Path) -> None:
    rank, world = groups.rank, groups.world_size
    engine = fresh(2)
    for batch in global_batches(2, 2 * 2 * world):
        first, last = rank_micro_batches(batch, rank, world, 2, 2)
        engine.set_gradient_accumulation_boundary(False)
        engine.backward(engine(*first))
        with pytest.raises(CheckpointError, match="gradient accumulation"):
            engine.save_checkpoint(shared_dir)
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(*last))
        engine.step()  # DeepSpeed's documented pattern: one step() per optimizer step
    assert engine.global_steps == 2
    engine.save_checkpoint(shared_dir)


@pytest.mark.parametrize("stage", STAGES)
def test_no_sync_accumulates_then_reduces(groups: Any, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    batches = global_batches(2, 2 * 2 * world)
    summed = fresh(stage)  # GAS 2, undivided losses: the step uses the sum of both micro-batches
    for batch in batches:
        for x, y in rank_micro_batches(batch, rank, world, 2, 2):
            summed.backward(summed(x, y), scale_wrt_gas=False)
            summed.step()
    synced = fresh(stage, gas=1)
    for batch in batches:
        first, last = rank_micro_batches(batch, rank, world, 2, 2)
        with synced.no_sync():
            synced.backward(synced(*first))
            with pytest.raises(RuntimeError, match="no_sync"):
                synced.step()
        synced.backward(synced(*last))
        synced.step()
    for a, b in zip(params_of(summed), params_of(synced)):
        close(safe_get_full_fp32_param(b), safe_get_full_fp32_param(a), 1e-6, "no_sync")


@pytest.mark.parametrize("stage", STAGES)
def test_coalesce_grad_reduction_reduces_once_at_exit(groups: Any, stage: int) -> None:
    """DeepSpeed 0.19's `coalesce_grad_reduction()`: the step after the block equals plain
    accumulation of the same micro-batches; at stages 0-1 no collective runs inside the block
    and the reduction runs at its exit; step() inside and nesting with no_sync() raise."""
    from zeroshard.comm.divergence import tracker_of

    rank, world = groups.rank, groups.world_size
    batches = global_batches(2, 2 * 3 * world)
    plain = fresh(stage, gas=1)
    for batch in batches:
        parts = rank_micro_batches(batch, rank, world, 2, 3)
        for i, (x, y) in enumerate(parts):
            plain.set_gradient_accumulation_boundary(i == len(parts) - 1)
            plain.backward(plain(x, y))
        plain.step()
    coalesced = fresh(stage, gas=1)
    tracker = tracker_of(coalesced.comm.groups.dp_group) if world > 1 else None
    for batch in batches:
        before = tracker._seq if tracker is not None else 0
        with coalesced.coalesce_grad_reduction():
            for i, (x, y) in enumerate(rank_micro_batches(batch, rank, world, 2, 3)):
                coalesced.set_gradient_accumulation_boundary(i == 2)  # ignored inside: one reduction at exit
                coalesced.backward(coalesced(x, y))
            inside = tracker._seq - before if tracker is not None else 0
            with pytest.raises(RuntimeError, match="coalesce_grad_reduction"):
                coalesced.step()
            with pytest.raises(AssertionError, match="no_sync"):
                with coalesced.no_sync():
                    pass
        if tracker is not None and stage < 2:
            assert inside == 0, f"stage {stage}: {inside} collectives inside the block"
            assert tracker._seq > before + inside, "no reduction at the block's exit"
        assert coalesced.grads_ready
        coalesced.step()
    for a, b in zip(params_of(plain), params_of(coalesced)):
        close(safe_get_full_fp32_param(b), safe_get_full_fp32_param(a), 1e-6, "coalesce_grad_reduction")
    with coalesced.no_sync(), pytest.raises(AssertionError, match="nested"):
        with coalesced.coalesce_grad_reduction():
            pass


@pytest.mark.parametrize("stage", [1, 3])
def test_a_non_scalar_loss_is_refused_by_backward_and_scale(groups: Any, stage: int) -> None:
    """Both name the shape; the error is a ValueError and, as DeepSpeed asserts, an AssertionError."""
    from zeroshard.errors import LossError

    rank, world = groups.rank, groups.world_size
    engine = fresh(stage)
    x, y = rank_micro_batches(global_batches(1, 2 * world)[0], rank, world, 2, 1)[0]
    loss = engine(x, y)
    out = loss * torch.ones(2, 3)  # a non-scalar tensor with a graph
    for call in (engine.scale, engine.backward):
        with pytest.raises(LossError, match=r"scalar tensor.*got shape \(") as err:
            call(out)
        assert isinstance(err.value, ValueError) and isinstance(err.value, AssertionError)
    with pytest.raises(AssertionError, match="scalar tensor with a graph"):
        engine.scale(torch.tensor(1.0))  # a scalar without a graph
    engine.backward(loss)  # the engine is unharmed
    engine.step()
    assert engine.micro_steps == 1


def test_initialize_without_a_model_names_the_mistake(groups: Any) -> None:
    from zeroshard.errors import InitializeArgumentError

    model = make_model()
    with pytest.raises(InitializeArgumentError, match="first positional argument, which is `args`") as err:
        zeroshard.initialize(model, config=make_config())  # DeepSpeed's signature starts with args
    assert isinstance(err.value, TypeError) and isinstance(err.value, AssertionError)
    with pytest.raises(InitializeArgumentError, match="needs model="):
        zeroshard.initialize(model=None, config=make_config())


# -- checkpoints --------------------------------------------------------------------------------


def test_save_checkpoint_refuses_no_directory(groups: Any) -> None:
    engine = fresh(1)
    before = set(os.listdir("."))
    for bad in (None, ""):
        with pytest.raises(CheckpointError, match="save_dir"):
            engine.save_checkpoint(bad)
    assert set(os.listdir(".")) == before


@pytest.mark.parametrize("stage", [1, 3])
def test_load_checkpoint_flags_are_honoured(groups: Any, shared_dir: Path, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}
    engine = fresh(stage, scheduler=sched)
    train_engine(engine, global_batches(3, 2 * 2 * world), rank, world)
    weights = [safe_get_full_fp32_param(p) for p in params_of(engine)]
    engine.save_checkpoint(shared_dir)

    no_opt = fresh(stage, seed=3, scheduler=sched)
    no_opt.load_checkpoint(shared_dir, load_optimizer_states=False)
    assert safe_get_full_optimizer_state(params_of(no_opt)[0], "exp_avg") is None
    assert no_opt.global_steps == 3 and no_opt.get_lr() == engine.get_lr()

    no_sched = fresh(stage, seed=3, scheduler=sched)
    no_sched.load_checkpoint(shared_dir, load_lr_scheduler_states=False)
    assert no_sched.lr_scheduler.last_batch_iteration == fresh(stage, scheduler=sched).lr_scheduler.last_batch_iteration
    assert safe_get_full_optimizer_state(params_of(no_sched)[0], "exp_avg") is not None

    module_only = fresh(stage, seed=3, scheduler=sched)
    module_only.load_checkpoint(shared_dir, load_module_only=True)
    assert module_only.global_steps == 0
    for p, w in zip(params_of(module_only), weights):
        close(safe_get_full_fp32_param(p), w, 1e-7, "module only")

    calls: list[Any] = []

    def custom(src: dict[str, torch.Tensor], dst: nn.Module) -> None:
        calls.append(sorted(src))
        dst.load_state_dict(src, strict=False)

    custom_engine = fresh(stage, seed=3)
    custom_engine.load_checkpoint(shared_dir, custom_load_fn=custom)
    assert calls and "wte.weight" in calls[0]
    for p, w in zip(params_of(custom_engine), weights):
        close(safe_get_full_fp32_param(p), w, 1e-7, "custom_load_fn")


class _Extra(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.gpt = make_model(seed)
        self.head2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.gpt(x, y)


def test_load_module_strict_false_tolerates_missing_names(groups: Any, shared_dir: Path) -> None:
    rank, world = groups.rank, groups.world_size
    small = init_engine(_Extra(0), api_config(1))
    train_engine(small, global_batches(1, 2 * 2 * world), rank, world)
    small.save_checkpoint(shared_dir)
    bigger = nn.Module()
    model = _Extra(4)
    model.head3 = nn.Linear(2, 2)  # a parameter the checkpoint lacks
    bigger = init_engine(model, api_config(1))
    own = model.head3.weight.detach().clone()
    with pytest.raises(CheckpointError, match="head3"):
        bigger.load_checkpoint(shared_dir)
    bigger.load_checkpoint(shared_dir, load_module_strict=False, load_optimizer_states=False)
    assert torch.equal(model.head3.weight.detach(), own)
    close(safe_get_full_fp32_param(model.gpt.wte.weight), safe_get_full_fp32_param(small.module.gpt.wte.weight),
          1e-7, "strict=False load")


# -- queries and initialize ----------------------------------------------------------------------


def test_engine_queries_and_config_dict(groups: Any) -> None:
    world = groups.world_size
    config = api_config(2, "bf16")
    engine, opt, _, _ = zeroshard.initialize(model=make_model(0), config_params=config)
    assert engine.config is config and engine.config.get("bf16") == {"enabled": True}
    assert engine.zs_config.zero_optimization.stage == 2 == engine.zero_optimization_stage()
    assert engine.train_batch_size() == 2 * 2 * world and engine.train_micro_batch_size_per_gpu() == 2
    assert engine.gradient_accumulation_steps() == 2
    assert engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.get_mom() == [g["betas"] for g in opt.param_groups]
    assert engine.local_rank == groups.local_rank and engine.dp_world_size == world
    assert opt.loss_scale == 1.0 and opt.cur_scale == 1.0 and opt.overflow is False
    assert isinstance(opt, torch.optim.Optimizer) and "state" in opt.state_dict()
    assert isinstance(engine, zeroshard.DeepSpeedEngine)
    assert engine.zero_gather_16bit_weights_on_model_save() is False
    engine.destroy()
    with pytest.raises(ValueError, match="initialize"):
        safe_get_full_fp32_param(params_of(engine)[0])


def test_fp16_optimizer_carries_the_loss_scale(groups: Any) -> None:
    rank, world = groups.rank, groups.world_size
    config = api_config(1, "fp16")
    config["fp16"]["hysteresis"] = 1  # the first overflow lowers the scale
    engine, opt, _, _ = zeroshard.initialize(model=make_model(0), config=config)
    assert opt.loss_scale == 256.0 == opt.cur_scale

    def overflow(step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("inf") if step == 0 else loss

    train_engine(engine, global_batches(1, 2 * 2 * world), rank, world, before_backward=overflow)
    assert opt.overflow is True and opt.loss_scale == engine.get_loss_scale() < 256.0


def test_initialize_accepts_deepspeed_arguments(groups: Any, shared_dir: Path, comm: Any) -> None:
    # mpu= is accepted since issue 27 (tests/dist/test_tensor_parallel.py); an object that is not one is refused.
    with pytest.raises(ConfigError, match=r"initialize\(mpu=...\): the object lacks get_model_parallel_rank"):
        zeroshard.initialize(model=make_model(0), config=api_config(0), mpu=object())
    path = shared_dir / "ds_config.json"
    if groups.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(api_config(0)))
    comm.barrier()
    parser = zeroshard.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, _, loader, _ = zeroshard.initialize(args=args, model=make_model(0), dist_init_required=False,
                                                training_data=torch.utils.data.TensorDataset(torch.zeros(8, 2)),
                                                collate_fn=lambda items: torch.stack([i[0] for i in items]) + 1)
    assert engine.config == api_config(0), "a config file is read into engine.config"
    assert torch.equal(next(iter(loader)), torch.ones(2, 2))


def test_consolidated_16bit_state_dict(groups: Any) -> None:
    rank, world = groups.rank, groups.world_size
    engine = fresh(3)
    train_engine(engine, global_batches(1, 2 * 2 * world), rank, world)
    state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        with GatheredParameters(list(engine.module.parameters())):
            want = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        assert state is not None and set(state) == set(want)
        for k in want:
            assert torch.equal(state[k], want[k]), k
    else:
        assert state is None
        with GatheredParameters(list(engine.module.parameters())):
            pass


# -- stage-3 surface -----------------------------------------------------------------------------


def test_ds_attributes_at_stage3(groups: Any, comm: Any) -> None:
    engine = fresh(3)
    ids = set()
    for p in params_of(engine):
        if not hasattr(p, "ds_id"):
            continue
        ids.add(p.ds_id)
        assert p.ds_numel == p.numel() and p.ds_shape == p.shape and p.ds_tensor.dim() == 1
        count = torch.tensor([float(p.ds_tensor.numel())])
        comm.all_reduce(count)
        assert int(count.item()) == p.numel()
    big = engine.module.wte.weight
    assert not big.ds_persist and big.ds_status is ZeroParamStatus.NOT_AVAILABLE
    with GatheredParameters([big]):
        assert big.ds_status is ZeroParamStatus.AVAILABLE
    assert len(ids) == len([p for p in params_of(engine) if hasattr(p, "ds_id")]) > 0
    assert not hasattr(params_of(fresh(2))[0], "ds_id"), "only partitioned parameters carry ds_*"


class _Experts(nn.Module):
    """A mixture-of-experts block: which experts run depends on the data (differs per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.router = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            mask = choice == i
            if mask.any():
                out[mask] = expert(x[mask])
        return out


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.moe = _Experts()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x))).pow(2).mean()


def test_leaf_module_gathered_as_one_unit(groups: Any) -> None:
    rank = groups.rank
    losses = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = _MoE()
        set_z3_leaf_modules(model, [_Experts])
        zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
        config = make_config(zero_optimization=zero)
        engine = init_engine(model, config)
        if stage == 3:
            units = [m for m in engine._strategy._unit_modules if m is not None]
            assert model.moe in units and not any(e in units for e in model.moe.experts)
        g = torch.Generator().manual_seed(10 + rank)
        run = []
        for _ in range(3):
            loss = engine(torch.randn(4, 4, generator=g))
            engine.backward(loss)
            engine.step()
            run.append(loss.item())
        losses[stage] = run
    assert losses[0] == pytest.approx(losses[3], rel=1e-5)


def test_unwrap_model_for_generation(groups: Any) -> None:
    engine = fresh(3)
    weight = engine.module.wte.weight
    with unwrap_model_for_generation(engine) as model:
        assert model is engine.module and weight.ds_status is ZeroParamStatus.AVAILABLE
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE


# -- zeroshard.comm ------------------------------------------------------------------------------


def test_comm_functions(groups: Any) -> None:
    rank, world = groups.rank, groups.world_size
    assert zcomm.get_rank() == rank and zcomm.get_world_size() == world
    assert zcomm.get_local_rank() == groups.local_rank
    assert zcomm.is_initialized() == (world > 1 or groups.dp_group is not None)
    t = torch.tensor([float(rank + 1)])
    zcomm.all_reduce(t)
    assert t.item() == world * (world + 1) / 2
    b = torch.tensor([float(rank)])
    zcomm.broadcast(b, src=world - 1)
    assert b.item() == world - 1
    out = [torch.zeros(1) for _ in range(world)]
    zcomm.all_gather(out, torch.tensor([float(rank)]))
    assert [o.item() for o in out] == list(range(world))
    zcomm.barrier()
    assert zeroshard.init_distributed(dist_backend=groups.backend if groups.backend != "none" else None) is groups


# -- module-path aliases: zero_to_fp32 and the estimators -----------------------------------------


def test_zero_to_fp32_aliases(groups: Any, shared_dir: Path, comm: Any) -> None:
    from zeroshard.utils import zero_to_fp32

    rank, world = groups.rank, groups.world_size
    model = make_model(0)
    model.wpe.weight.requires_grad_(False)
    engine = init_engine(model, api_config(3))
    train_engine(engine, global_batches(1, 2 * 2 * world), rank, world)
    want = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    engine.save_checkpoint(shared_dir)
    comm.barrier()
    if rank == 0:
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(shared_dir)
        for name, value in want.items():
            assert torch.equal(state[name], value), name
        assert "wpe.weight" in state
        lean = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(shared_dir, exclude_frozen_parameters=True)
        assert "wpe.weight" not in lean and "wte.weight" in lean
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(shared_dir, shared_dir / "out")
        saved = torch.load(shared_dir / "out" / "pytorch_model.bin", weights_only=True)
        assert torch.equal(saved["wte.weight"], want["wte.weight"])
        fresh_model = zero_to_fp32.load_state_dict_from_zero_checkpoint(make_model(7), shared_dir)
        assert torch.equal(fresh_model.wte.weight.detach(), want["wte.weight"])
        with pytest.raises(NotSupportedError, match="lazy_mode"):
            zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(shared_dir, lazy_mode=True)
    comm.barrier()


def test_estimator_aliases_print_deepspeeds_tables(groups: Any, capsys: Any) -> None:
    from zeroshard.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from zeroshard.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live

    rows3 = estimate_zero3_model_states_mem_needs_all_cold(total_params=1e9, largest_layer_params=1e8,
                                                            num_gpus_per_node=8)
    rows2 = estimate_zero2_model_states_mem_needs_all_live(make_model(0), num_gpus_per_node=2)
    assert len(rows3) == 6 and len(rows2) >= 2
    assert "offload" in capsys.readouterr().out.lower()


def test_ds_attributes_under_zero_init(groups: Any, comm: Any) -> None:
    import zeroshard.zero as zero

    with zero.Init():
        layer = nn.Linear(64, 64)
    assert layer.weight.ds_numel == 64 * 64 and layer.weight.ds_shape == (64, 64)
    assert layer.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE or groups.world_size == 1
    count = torch.tensor([float(layer.weight.ds_tensor.numel())])
    comm.all_reduce(count)
    assert int(count.item()) >= 64 * 64
    assert layer.weight.ds_id != layer.bias.ds_id
