"""Checkpoints inside one process group (world 1, 2, 3): resume, cross-stage load, weights-only
and module-only loads, frozen parameters, the data loader position, bad input, to-fp32.

Fresh-process resume, other world sizes and crashes mid-save are in tests/launch/test_checkpoint_*.
Every rank runs every test; files live in a directory all ranks share (`shared_dir`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_params_close, global_batches, init_engine, make_config, make_model, train_engine

import zeroshard
from zeroshard.checkpoint import (
    convert_zero_checkpoint_to_fp32_state_dict,
    export_pretrained,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from zeroshard.checkpoint.files import MANIFEST, MODEL_FILE, optim_file
from zeroshard.checkpoint.safetensors_io import read_safetensors
from zeroshard.errors import CheckpointError

STEPS_BEFORE, STEPS_AFTER = 3, 3


def config(stage: int, precision: str = "fp32", offload: bool = False, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:  # the tiny model's tensors are small: partition those above 100 elements
        zero["stage3_param_persistence_threshold"] = 100
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if precision == "bf16":
        extra["bf16"] = {"enabled": True}
    if precision == "fp16":
        extra["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}}
    return make_config(gradient_accumulation_steps=2, gradient_clipping=0.05, zero_optimization=zero,
                       scheduler=sched, **extra)


def batches(world: int, steps: int = STEPS_BEFORE + STEPS_AFTER) -> list[Any]:
    return global_batches(steps, 2 * 2 * world)


def snapshot(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def assert_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: parameter {i} differs by {(a.float() - b.float()).abs().max():.3e}")


@pytest.mark.parametrize("stage,precision,offload", [
    (0, "fp32", False), (1, "fp32", False), (2, "fp32", False), (1, "bf16", True), (2, "fp16", False),
], ids=["s0-fp32", "s1-fp32", "s2-fp32", "s1-bf16-offload", "s2-fp16"])
def test_resume_is_bitwise_exact(groups: Any, shared_dir: Path, stage: int, precision: str, offload: bool) -> None:
    rank, world = groups.rank, groups.world_size
    data = batches(world)
    engine = init_engine(make_model(), config(stage, precision, offload))
    train_engine(engine, data[:STEPS_BEFORE], rank, world)
    path = engine.save_checkpoint(shared_dir, client_state={"note": "hi", "step": 3})
    assert Path(path) == shared_dir / "global_step3"
    want_losses, want = train_engine(engine, data[STEPS_BEFORE:], rank, world)
    resumed = init_engine(make_model(seed=7), config(stage, precision, offload))
    got_path, client = resumed.load_checkpoint(shared_dir, load_rng_state=True)
    assert got_path == path and client == {"note": "hi", "step": 3}
    assert resumed.global_steps == STEPS_BEFORE and resumed.micro_steps == 2 * STEPS_BEFORE
    got_losses, got = train_engine(resumed, data[STEPS_BEFORE:], rank, world)
    assert got_losses == want_losses
    for step in range(STEPS_AFTER):
        assert_equal(got[step], want[step], f"step {STEPS_BEFORE + step}")
    assert resumed.get_lr() == engine.get_lr() and resumed.get_loss_scale() == engine.get_loss_scale()
    assert resumed.skipped_steps == engine.skipped_steps


@pytest.mark.parametrize("target", [0, 1], ids=["to-stage0", "to-stage1"])
def test_load_into_another_stage(groups: Any, shared_dir: Path, target: int) -> None:
    rank, world = groups.rank, groups.world_size
    data = batches(world)
    engine = init_engine(make_model(), config(2))
    train_engine(engine, data[:STEPS_BEFORE], rank, world)
    engine.save_checkpoint(shared_dir)
    _, want = train_engine(engine, data[STEPS_BEFORE:], rank, world)
    other = init_engine(make_model(seed=3), config(target))
    other.load_checkpoint(shared_dir)
    _, got = train_engine(other, data[STEPS_BEFORE:], rank, world)
    # Stages reduce gradients with different collectives (all-reduce vs reduce-scatter), whose
    # sums may round differently on gloo: equal to fp32 round-off, not bitwise.
    for step in range(STEPS_AFTER):
        assert_params_close(got[step], want[step], 1e-6, f"stage 2 -> stage {target}, step {step}")


def test_weights_only_and_module_only(groups: Any, shared_dir: Path) -> None:
    rank, world = groups.rank, groups.world_size
    engine = init_engine(make_model(), config(2, "bf16"))
    train_engine(engine, batches(world, 2), rank, world)
    engine.save_checkpoint(shared_dir)
    engine.save_checkpoint(shared_dir, tag="weights", save_optimizer_states=False, save_latest=False)
    want = snapshot(engine)
    fresh = init_engine(make_model(seed=4), config(1, "bf16"))
    fresh.load_checkpoint(shared_dir, load_optimizer_states=False)
    assert_equal(snapshot(fresh), want, "weights-only load")
    assert not fresh.optimizer.state and fresh.global_steps == 2
    masters = torch.cat([p.detach().reshape(-1) for p in fresh.optimizer.param_groups[0]["params"]])
    assert masters.dtype == torch.float32 and masters.numel() > 0
    module_only = init_engine(make_model(seed=5), config(0, "bf16"))
    path, client = module_only.load_checkpoint(shared_dir, load_module_only=True)
    assert path is not None and client == {} and module_only.global_steps == 0
    assert_equal(snapshot(module_only), want, "module-only load")
    files = os.listdir(shared_dir / "weights")
    assert not any("optim_states" in f for f in files), files
    with pytest.raises(CheckpointError, match="load_optimizer_states=False"):
        init_engine(make_model(), config(2, "bf16")).load_checkpoint(shared_dir, tag="weights")
    plain = init_engine(make_model(seed=6), config(2, "bf16"))
    plain.load_checkpoint(shared_dir, tag="weights", load_optimizer_states=False)
    assert_equal(snapshot(plain), want, "weights-only save")


def test_frozen_parameters_saved_only_when_asked(groups: Any, shared_dir: Path) -> None:
    rank, world = groups.rank, groups.world_size

    def frozen_model(seed: int) -> torch.nn.Module:
        model = make_model(seed)
        model.wpe.weight.requires_grad_(False)
        return model

    engine = init_engine(frozen_model(0), config(2))
    train_engine(engine, batches(world, 2), rank, world)
    engine.save_checkpoint(shared_dir, tag="lean", exclude_frozen_parameters=True)
    engine.save_checkpoint(shared_dir, tag="full")  # DeepSpeed's default: frozen ones saved too
    saved = torch.load(shared_dir / "lean" / MODEL_FILE, weights_only=True)["module"]
    assert "wpe.weight" not in saved and "wte.weight" in saved
    assert "wpe.weight" in torch.load(shared_dir / "full" / MODEL_FILE, weights_only=True)["module"]
    lean = init_engine(frozen_model(9), config(2))
    own_frozen = lean.module.wpe.weight.detach().clone()
    lean.load_checkpoint(shared_dir, tag="lean")
    assert torch.equal(lean.module.wpe.weight, own_frozen), "a frozen parameter not saved keeps its value"
    assert torch.equal(lean.module.wte.weight, engine.module.wte.weight)
    full = init_engine(frozen_model(9), config(2))
    full.load_checkpoint(shared_dir, tag="full")
    assert_equal(snapshot(full), snapshot(engine), "frozen parameters saved")


def test_frozen_parameters_load_at_stage3_bf16(groups: Any, shared_dir: Path) -> None:
    """Stage 3 with a separate master: a saved frozen parameter is loaded (its master range is
    not restored from the checkpoint and must not copy the old value back), and a frozen one left
    out keeps its value (the load target lists every piece the strategy holds)."""
    from engine_helpers import gathered_snapshot

    rank, world = groups.rank, groups.world_size

    def frozen_model(seed: int) -> torch.nn.Module:
        model = make_model(seed)
        model.wpe.weight.requires_grad_(False)
        return model

    engine = init_engine(frozen_model(0), config(3, "bf16"))
    train_engine(engine, batches(world, 2), rank, world)
    engine.save_checkpoint(shared_dir, tag="full", exclude_frozen_parameters=False)
    engine.save_checkpoint(shared_dir, tag="lean", exclude_frozen_parameters=True)
    full = init_engine(frozen_model(9), config(3, "bf16"))
    full.load_checkpoint(shared_dir, tag="full")
    assert_equal(gathered_snapshot(full.module), gathered_snapshot(engine.module), "frozen parameters saved")
    train_engine(full, batches(world, 1), rank, world)
    assert torch.equal(gathered_snapshot(full.module)[1], gathered_snapshot(engine.module)[1]), \
        "a step after the load must not bring back the frozen parameter's old value"
    lean = init_engine(frozen_model(9), config(3, "bf16"))
    own_frozen = gathered_snapshot(lean.module)[1]
    lean.load_checkpoint(shared_dir, tag="lean")
    got = gathered_snapshot(lean.module)
    assert torch.equal(got[1], own_frozen), "a frozen parameter not saved keeps its value"
    assert torch.equal(got[0], gathered_snapshot(engine.module)[0])


def test_data_loader_resumes_sample_order(groups: Any, shared_dir: Path) -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(40).float().unsqueeze(1))

    def start(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        engine, _, loader, _ = zeroshard.initialize(model=torch.nn.Linear(1, 1), training_data=dataset,
                                                    config=make_config(train_micro_batch_size_per_gpu=2))
        return engine, loader

    engine, loader = start(0)
    it = iter(loader)
    head = [next(it)[0] for _ in range(3)]
    engine.save_checkpoint(shared_dir)
    want = [b[0] for b in it] + [b[0] for b in loader]  # rest of epoch 0, then epoch 1
    resumed, resumed_loader = start(1)
    resumed.load_checkpoint(shared_dir, load_rng_state=True)
    got = [b[0] for b in resumed_loader] + [b[0] for b in resumed_loader]
    assert len(head) == 3 and len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_load_leaves_rng_and_loader_alone_unless_asked(groups: Any, shared_dir: Path) -> None:
    """DeepSpeed's load_checkpoint leaves the script's generators and data order alone; zeroshard
    does the same unless load_rng_state=True (the exact resume)."""
    import random

    import numpy as np

    dataset = torch.utils.data.TensorDataset(torch.arange(48).float().unsqueeze(1))

    def start(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        engine, _, loader, _ = zeroshard.initialize(model=torch.nn.Linear(1, 1), training_data=dataset,
                                                    config=make_config(train_micro_batch_size_per_gpu=2))
        return engine, loader

    def draws() -> tuple[float, float, Any]:
        return random.random(), float(np.random.rand()), torch.rand(3)

    engine, loader = start(0)
    it = iter(loader)
    [next(it) for _ in range(3)]
    engine.save_checkpoint(shared_dir)
    saved_draws = draws()

    resumed, resumed_loader = start(1)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    script_draws = draws()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    resumed.load_checkpoint(shared_dir)
    after = draws()
    assert after[:2] == script_draws[:2] and torch.equal(after[2], script_draws[2]), "RNG overwritten"
    first = [b[0] for b in resumed_loader]
    assert len(first) == len(dataset) // (2 * groups.world_size), "loader position restored by default"

    asked, asked_loader = start(1)
    asked.load_checkpoint(shared_dir, load_rng_state=True)
    exact = draws()
    assert exact[:2] == saved_draws[:2] and torch.equal(exact[2], saved_draws[2])
    assert len([b for b in asked_loader]) == len(first) - 3


def _copy_checkpoint(comm: Any, src: Path, dst: Path, mutate: Any) -> None:
    if comm.rank == 0:
        shutil.copytree(src, dst)
        mutate(dst / "global_step2")
    comm.barrier()


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BAD_CASES = {
    "truncated optimizer file": (lambda d: _truncate(d / optim_file(0)), optim_file(0)),
    "foreign model file": (lambda d: (d / MODEL_FILE).write_bytes(os.urandom((d / MODEL_FILE).stat().st_size)),
                           MODEL_FILE),
    "damaged manifest": (lambda d: (d / MANIFEST).write_text("{not json"), MANIFEST),
    "missing file": (lambda d: (d / optim_file(0)).unlink(), optim_file(0)),
    # Only the last rank's file: the other ranks load theirs fine and must still name it.
    "truncated file of the last rank": (lambda d: _truncate(d / optim_file(_last_rank())),
                                        "LAST-RANK-FILE"),
}


def _last_rank() -> int:
    from zeroshard.comm import init_distributed

    return init_distributed().world_size - 1


def test_bad_input_raises_and_loads_nothing(groups: Any, comm: Any, shared_dir: Path) -> None:
    rank, world = groups.rank, groups.world_size
    engine = init_engine(make_model(), config(2))
    train_engine(engine, batches(world, 2), rank, world)
    good = shared_dir / "good"
    engine.save_checkpoint(good)
    target = init_engine(make_model(seed=8), config(1))
    before = snapshot(target)
    with pytest.raises(CheckpointError, match="tag 'nope' not found"):
        target.load_checkpoint(good, tag="nope")
    for i, (name, (mutate, culprit)) in enumerate(BAD_CASES.items()):
        bad = shared_dir / f"bad{i}"
        _copy_checkpoint(comm, good, bad, mutate)
        with pytest.raises(CheckpointError) as info:
            target.load_checkpoint(bad)
        if culprit == "LAST-RANK-FILE":
            culprit = optim_file(world - 1)
        # Every rank's error names the culprit: a failing rank's message is gathered to all.
        assert culprit in str(info.value), (name, str(info.value))
        assert_equal(snapshot(target), before, f"after {name}")
        assert target.global_steps == 0 and not target.optimizer.state
    wide = make_model()
    wide.head = torch.nn.Linear(3, 3)  # a parameter the checkpoint lacks
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: head\.weight, head\.bias"):
        init_engine(wide, config(2)).load_checkpoint(good)
    from zeroshard.examples.gpt import GPT, GPTConfig

    other = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))
    with pytest.raises(CheckpointError, match=r"zeroshard_manifest.json: .*shape mismatch: wte.weight: "
                                              r"checkpoint \[256, 16\], model \[256, 32\]"):
        init_engine(other, config(2)).load_checkpoint(good)


def test_save_rules(groups: Any, shared_dir: Path) -> None:
    engine = init_engine(make_model(), config(2))
    x, y = global_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()  # micro-step 1 of 2
    with pytest.raises(CheckpointError, match="gradient accumulation"):
        engine.save_checkpoint(shared_dir)
    engine.backward(engine(x, y))
    engine.step()
    shared_dir.mkdir(parents=True, exist_ok=True)
    assert engine.load_checkpoint(shared_dir) == (None, None), "nothing saved yet"
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        engine.load_checkpoint(shared_dir / "absent")
    engine.save_checkpoint(shared_dir, tag="same")
    first = snapshot(engine)
    engine.backward(engine(x, y))
    engine.step()
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(shared_dir, tag="same")  # replaces the first save of that tag
    fresh = init_engine(make_model(seed=2), config(2))
    fresh.load_checkpoint(shared_dir)
    assert fresh.global_steps == 2 and not all(torch.equal(a, b) for a, b in zip(snapshot(fresh), first))
    assert sorted(os.listdir(shared_dir)) == ["latest", "same", "zero_to_fp32.py"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_to_fp32_equals_live_weights(groups: Any, comm: Any, shared_dir: Path, precision: str) -> None:
    rank, world = groups.rank, groups.world_size
    engine = init_engine(make_model(), config(2, precision))
    train_engine(engine, batches(world, 2), rank, world)
    engine.save_checkpoint(shared_dir)
    live = engine.module.state_dict()
    if rank == 0:
        sd = get_fp32_state_dict_from_zero_checkpoint(shared_dir)
        assert sorted(sd) == sorted(live) and "lm_head.weight" in sd  # tied alias kept
        for name, value in live.items():
            assert sd[name].dtype == torch.float32
            if precision == "fp32":
                assert torch.equal(sd[name], value), name
            else:  # fp32 masters: cast to bf16 they are the module's weights exactly
                assert torch.equal(sd[name].to(torch.bfloat16), value), name
        if precision == "bf16":
            assert any(not torch.equal(sd[n], v.float()) for n, v in live.items()), "masters keep fp32 bits"
        out = shared_dir / "out.safetensors"
        convert_zero_checkpoint_to_fp32_state_dict(shared_dir, out, safetensors=True, progress=False)
        streamed = read_safetensors(out)
        assert sorted(streamed) == sorted(sd) and all(torch.equal(streamed[k], sd[k]) for k in sd)
        plain = load_state_dict_from_zero_checkpoint(make_model(seed=11), shared_dir)
        assert all(torch.equal(plain.state_dict()[k], sd[k]) for k in sd)
    comm.barrier()


def test_export_transformers_save_pretrained(groups: Any, comm: Any, shared_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")  # the [hf] extra; same answer on every rank
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    engine = init_engine(transformers.GPT2LMHeadModel(cfg), config(2, "bf16"))
    x = global_batches(1, 2 * groups.world_size)[0][0] % 64
    mine = x[2 * groups.rank : 2 * groups.rank + 2]
    for _ in range(2):  # two micro-batches (gradient accumulation 2): one optimizer step
        engine.backward(engine(input_ids=mine, labels=mine).loss)
        engine.step()
    engine.save_checkpoint(shared_dir)
    if groups.rank == 0:
        want = get_fp32_state_dict_from_zero_checkpoint(shared_dir)
        out = export_pretrained(transformers.GPT2LMHeadModel(cfg), shared_dir, shared_dir / "hf")
        assert any(p.suffix == ".safetensors" for p in out.iterdir())
        again = transformers.GPT2LMHeadModel.from_pretrained(out).state_dict()
        for name, value in want.items():
            if name in again:
                assert torch.equal(again[name], value), name
        assert torch.equal(again["transformer.wte.weight"].to(torch.bfloat16),
                           engine.module.state_dict()["transformer.wte.weight"])
    comm.barrier()


@pytest.mark.parametrize("saved,loaded", [(3, 3), (3, 1), (1, 3), (3, 0)])
def test_stage3_save_and_load_across_stages(groups: Any, shared_dir: Path, saved: int, loaded: int) -> None:
    rank, world = groups.rank, groups.world_size
    data = batches(world)
    engine = init_engine(make_model(), config(saved, "bf16"))
    train_engine(engine, data[:STEPS_BEFORE], rank, world)
    engine.save_checkpoint(shared_dir)
    _, want = train_engine(engine, data[STEPS_BEFORE:], rank, world)
    other = init_engine(make_model(seed=3), config(loaded, "bf16"))
    other.load_checkpoint(shared_dir)
    _, got = train_engine(other, data[STEPS_BEFORE:], rank, world)
    for step in range(STEPS_AFTER):
        assert_params_close(got[step], want[step], 1e-6, f"stage {saved} -> stage {loaded}, step {step}")


@pytest.mark.parametrize("differ", ["save_dir", "tag"])
@pytest.mark.parametrize("tag_validation", ["Ignore", "Fail"])
def test_save_dir_or_tag_differing_across_ranks_is_refused_before_writing(
        shared_dir: Path, comm: Any, differ: str, tag_validation: str) -> None:
    # DeepSpeedExamples' HelloDeepSpeed names its directory from each rank's clock: at 2+ ranks the
    # names may differ. Every rank refuses at the call, with each rank's value, and writes nothing;
    # checkpoint.tag_validation (about tags alone, in DeepSpeed) does not relax it.
    if comm.world_size == 1:
        pytest.skip("needs 2 or more ranks: one rank cannot disagree with itself")
    engine = init_engine(make_model(), config(1, checkpoint={"tag_validation": tag_validation}))
    train_engine(engine, batches(comm.world_size, 1), comm.rank, comm.world_size)
    save_dir, tag = shared_dir / "ckpt", "step1"
    if differ == "save_dir":
        save_dir = shared_dir / f"ckpt-{comm.rank}"
    else:
        tag = f"step1-rank{comm.rank}"
    with pytest.raises(CheckpointError) as info:
        engine.save_checkpoint(save_dir, tag=tag)
    first = str(info.value).splitlines()[0]
    assert f"different {differ} on different ranks" in first, first
    for r in range(comm.world_size):
        shown = repr(str(shared_dir / f"ckpt-{r}")) if differ == "save_dir" else repr(f"step1-rank{r}")
        assert f"rank {r}: save_dir=" in first and shown in first, first
    assert "nothing was written" in first and "broadcast" in first, first
    comm.barrier()
    assert not shared_dir.exists() or not any(shared_dir.iterdir()), sorted(shared_dir.rglob("*"))
    # The engine is unharmed: the same save with agreeing arguments goes through.
    path = engine.save_checkpoint(shared_dir / "ckpt", tag="step1")
    assert (Path(path) / MANIFEST).is_file()
