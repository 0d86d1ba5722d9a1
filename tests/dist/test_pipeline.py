"""Pipeline parallelism against the same layers trained in one process without a pipeline.

World 1: one stage (no schedule). World 2: 2 stages. World 3: 3 stages. World 4 (tests/run.py's
dist4 stage): 2 stages x data parallel 2, and 4 stages. fp32; per-step losses and final weights
agree within ~1e-6 relative at every ZeRO stage and schedule. bf16 and fp16 (dynamic loss scale,
an overflow in one stage skipping the step everywhere): the same losses, weights within an ulp.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zeroshard
from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zeroshard.checkpoint.manifest import read_manifest
from zeroshard.checkpoint.pipe_files import MultiReader, pipeline_sources, read_pipe_layout, stage_dir
from zeroshard.comm import Comm, ProcessGroups
from zeroshard.errors import CheckpointError
from zeroshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zeroshard.pipe.module import PipelineError, SequentialLayers
from zeroshard.runtime.engine import ZeroEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ds_pipe_writer import write_ds_pipeline
from tiny_layers import Block, Embed, Head

VOCAB, DIM, SEQ = 16, 8, 6
MICRO, GAS = 2, 4
BASE_SEED = 1234


def tied_head(embed: Embed, x: Tensor) -> Tensor:
    return F.layer_norm(x, (DIM,)) @ embed.weight.t()


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def specs(blocks: int, tied: bool) -> list[Any]:
    first = TiedLayerSpec("embed", Embed, VOCAB, DIM) if tied else LayerSpec(Embed, VOCAB, DIM)
    last = (TiedLayerSpec("embed", Embed, VOCAB, DIM, forward_fn=tied_head) if tied
            else LayerSpec(Head, DIM, VOCAB))
    return [first, *[LayerSpec(Block, DIM) for _ in range(blocks)], last]


def reference_model(blocks: int, tied: bool) -> nn.ModuleDict:
    """The same layers, built with the same seeds, in one process (tied: built once, at layer 0)."""
    layers = nn.ModuleDict()
    for idx, spec in enumerate(specs(blocks, tied)):
        torch.manual_seed(BASE_SEED + idx)
        if isinstance(spec, TiedLayerSpec):
            if "tied_modules" not in layers:
                layers["tied_modules"] = nn.ModuleDict({spec.key: spec.build()})
            continue
        layers[str(idx)] = spec.build()
    return layers


def reference_forward(model: nn.ModuleDict, blocks: int, tied: bool, ids: Tensor) -> Tensor:
    x = ids
    for idx in range(blocks + 2):
        if tied and idx == 0:
            x = model["tied_modules"]["embed"](x)
        elif tied and idx == blocks + 1:
            x = tied_head(model["tied_modules"]["embed"], x)
        else:
            x = model[str(idx)](x)
    return x


def data(steps: int, dp: int) -> list[list[list[tuple[Tensor, Tensor]]]]:
    """[step][dp rank][micro-batch] -> (ids, labels)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (dp, GAS, MICRO, SEQ + 1), generator=g)
        out.append([[(tokens[d, m, :, :-1], tokens[d, m, :, 1:]) for m in range(GAS)] for d in range(dp)])
    return out


def train_reference(blocks: int, tied: bool, steps: int, dp: int, clip: float, lr: float = 1e-2,
                    norms: list[float] | None = None) -> tuple[list[float], dict[str, Tensor]]:
    """Per-step losses and the final weights in one process (with `norms`: each step's global
    gradient norm before clipping appended to it)."""
    model = reference_model(blocks, tied)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for batch in data(steps, dp):
        total = 0.0
        for rank_batches in batch:
            for ids, labels in rank_batches:
                loss = loss_fn(reference_forward(model, blocks, tied, ids), labels)
                (loss / (GAS * dp)).backward()
                total += loss.item() / (GAS * dp)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
        if norms is not None:
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().float() for k, v in model.state_dict().items()}


def pipe_config(stage: int, clip: float, **pipeline: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": clip, "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64},
    }
    if pipeline:
        cfg["pipeline"] = pipeline
    return cfg


def train_pipeline(groups: ProcessGroups, stages: int, blocks: int, tied: bool, steps: int, cfg: dict[str, Any],
                   **module_kwargs: Any) -> tuple[Any, list[float]]:
    net = PipelineModule(specs(blocks, tied), num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                         base_seed=BASE_SEED, **module_kwargs)
    engine, *_ = zeroshard.initialize(model=net, model_parameters=[p for p in net.parameters()], config=cfg)
    dp = groups.world_size // stages
    dp_rank = groups.rank % dp
    losses = []
    for batch in data(steps, dp):
        losses.append(float(engine.train_batch(iter(batch[dp_rank]))))
    return engine, losses


def check_against_reference(engine: Any, losses: list[float], blocks: int, tied: bool, steps: int, dp: int,
                            clip: float, rtol: float = 2e-6) -> None:
    want_losses, want = train_reference(blocks, tied, steps, dp, clip)
    for step, (a, b) in enumerate(zip(losses, want_losses, strict=True)):
        assert math.isclose(a, b, rel_tol=rtol), f"step {step}: loss {a} != reference {b}"
    names = dict(engine.module.named_parameters())
    assert names, "this stage holds no parameters"
    for name, p in names.items():
        ref = want[name]
        err = (p.detach().float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        assert err < 20 * rtol, f"{name}: max relative deviation {err:.2e} from the no-pipeline run"


def stage_layouts(world: int) -> list[int]:
    """Pipeline stage counts to test at this world size."""
    return {1: [1], 2: [2], 3: [3], 4: [2, 4]}.get(world, [world])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_matches_single_process(groups: ProcessGroups, zero: int, tied: bool) -> None:
    for stages in stage_layouts(groups.world_size):
        blocks = max(2, 2 * stages - 2)
        cfg = pipe_config(zero, clip=0.0)
        engine, losses = train_pipeline(groups, stages, blocks, tied, 3, cfg)
        check_against_reference(engine, losses, blocks, tied, 3, groups.world_size // stages, clip=0.0)


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("interleaved_1f1b", 2),
                                               ("interleaved_zero_bubble", 2)])
def test_every_schedule_trains_the_same_numbers(groups: ProcessGroups, schedule: str, virtual: int) -> None:
    stages = stage_layouts(groups.world_size)[0]
    blocks = 2 * stages * virtual - 2
    cfg = pipe_config(1, clip=0.0, schedule=schedule)
    engine, losses = train_pipeline(groups, stages, blocks, True, 3, cfg, virtual_stages=virtual)
    check_against_reference(engine, losses, blocks, True, 3, groups.world_size // stages, clip=0.0)


@pytest.mark.parametrize("zero", [0, 1])
def test_clipping_uses_the_global_norm_over_every_stage(groups: ProcessGroups, zero: int) -> None:
    stages = stage_layouts(groups.world_size)[0]
    blocks = 2 * stages
    cfg = pipe_config(zero, clip=0.05)
    engine, losses = train_pipeline(groups, stages, blocks, True, 3, cfg)
    check_against_reference(engine, losses, blocks, True, 3, groups.world_size // stages, clip=0.05)
    # The clip was active: the unclipped run differs.
    unclipped, _ = train_reference(blocks, True, 3, groups.world_size // stages, clip=0.0)
    assert abs(unclipped[-1] - losses[-1]) > 1e-4
    assert engine.get_global_grad_norm() > 0.05


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_global_norm_counts_tied_weights_once(groups: ProcessGroups, zero: int) -> None:
    """The norm every rank reports is one process's, step by step: the tied embedding, summed over
    the two stages holding it, counted once (Note: [norm groups] in zero/strategy.py)."""
    stages = stage_layouts(groups.world_size)[0]
    blocks, dp = 2 * stages, groups.world_size // stages
    net = PipelineModule(specs(blocks, True), num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                         base_seed=BASE_SEED)
    engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()),
                                      config=pipe_config(zero, clip=0.05))
    got = []
    for batch in data(3, dp):
        engine.train_batch(iter(batch[groups.rank % dp]))
        got.append(float(engine.get_global_grad_norm()))
    want: list[float] = []
    train_reference(blocks, True, 3, dp, clip=0.05, norms=want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-6), f"step {step}: global norm {a} != one process {b}"
    assert min(want) > 0.05  # clipped every step: the norm decided each update
    # The last stage holds the tied head and leaves it out of the norm; the first counts it.
    assert bool(net.tied_duplicates()) == (stages > 1 and net.stage_id == stages - 1)


def test_a_batch_counts_its_micro_batches_and_samples(groups: ProcessGroups) -> None:
    """train_batch ends gradient_accumulation_steps micro-batches in one optimizer step: the
    counters and the throughput's sample count say so (the pipeline once counted one micro-batch
    of samples per batch towards samples/s)."""
    stages = stage_layouts(groups.world_size)[0]
    engine, _ = train_pipeline(groups, stages, 2 * stages, False, 3, pipe_config(1, clip=0.0))
    dp = groups.world_size // stages
    assert (engine.global_steps, engine.micro_steps) == (3, 3 * GAS)
    assert engine.global_samples == 3 * GAS * MICRO * dp == 3 * engine.train_batch_size()
    summary = engine.summary()
    assert math.isclose(summary["samples_per_s"] * summary["elapsed_s"], summary["samples"], rel_tol=1e-9)
    assert engine.is_gradient_accumulation_boundary() is False  # no boundary left set after the batch


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_by_interval(groups: ProcessGroups, reentrant: bool) -> None:
    stages = stage_layouts(groups.world_size)[0]
    blocks = 2 * stages
    cfg = pipe_config(0, clip=0.0, activation_checkpoint_interval=1, use_reentrant=reentrant)
    engine, losses = train_pipeline(groups, stages, blocks, True, 2, cfg)
    assert engine.module.activation_checkpoint_interval == 1
    check_against_reference(engine, losses, blocks, True, 2, groups.world_size // stages, clip=0.0)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_cpu_offload_with_a_pipeline(groups: ProcessGroups, zero: int) -> None:
    stages = stage_layouts(groups.world_size)[0]
    blocks = 2 * stages
    cfg = pipe_config(zero, clip=0.5)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if zero == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, losses = train_pipeline(groups, stages, blocks, True, 2, cfg)
    check_against_reference(engine, losses, blocks, True, 2, groups.world_size // stages, clip=0.5)


@pytest.mark.parametrize("zero,zero_after", [(1, 1), (1, 2), (3, 0)])
def test_checkpoint_save_fresh_engine_load_continue(groups: ProcessGroups, shared_dir: Any, zero: int,
                                                    zero_after: int) -> None:
    """2 steps, save, a fresh engine (possibly another ZeRO stage) loads and trains 2 more: the
    losses and weights of the uninterrupted 4-step run."""
    stages = stage_layouts(groups.world_size)[0]
    blocks, dp = 2 * stages, groups.world_size // stages
    batches = data(4, dp)
    whole, whole_losses = train_pipeline(groups, stages, blocks, True, 4, pipe_config(zero, clip=0.5))

    def engine_for(stage: int) -> Any:
        net = PipelineModule(specs(blocks, True), num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                             base_seed=BASE_SEED + 99)  # other initial values: the load must replace them
        return zeroshard.initialize(model=net, model_parameters=list(net.parameters()),
                                    config=pipe_config(stage, clip=0.5))[0]

    first, losses = train_pipeline(groups, stages, blocks, True, 2, pipe_config(zero, clip=0.5))
    path = first.save_checkpoint(shared_dir)
    layer_files = sorted(p.name for p in Path(path).glob("layer_*-model_states.pt"))
    assert layer_files == [f"layer_{i:02d}-model_states.pt" for i in range(blocks + 1)]  # the tied head has none
    second = engine_for(zero_after)
    loaded, _ = second.load_checkpoint(shared_dir)
    assert loaded == path and second.global_steps == 2
    losses += [float(second.train_batch(iter(b[groups.rank % dp]))) for b in batches[2:]]
    for step, (a, b) in enumerate(zip(losses, whole_losses, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-6), f"step {step}: resumed loss {a} != uninterrupted {b}"
    want = dict(whole.module.named_parameters())
    for name, p in second.module.named_parameters():
        assert torch.allclose(p.detach().float(), want[name].detach().float(), rtol=1e-5, atol=1e-7), name


def test_checkpoint_of_other_layers_is_refused(groups: ProcessGroups, shared_dir: Any) -> None:
    stages = stage_layouts(groups.world_size)[0]
    engine, _ = train_pipeline(groups, stages, 2 * stages, False, 1, pipe_config(0, clip=0.0))
    engine.save_checkpoint(shared_dir, tag="t")
    other, _ = train_pipeline(groups, stages, 2 * stages + 1, False, 0, pipe_config(0, clip=0.0))
    with pytest.raises(CheckpointError, match="layers"):
        other.load_checkpoint(shared_dir, tag="t")


# -- resharding: another pipeline degree, data-parallel degree, ZeRO stage, or no pipeline --------

PLAIN = 0
"""A layout's stage count 0: the same layers without a pipeline (`PipelineModule.to_sequential()`)."""

RESHARD = {  # world -> ((stages, zero) saved, (stages, zero) loaded)
    1: [((1, 1), (PLAIN, 0)), ((PLAIN, 1), (1, 2))],
    2: [((2, 1), (1, 2)), ((2, 0), (PLAIN, 1)), ((PLAIN, 3), (2, 1))],
    3: [((3, 1), (PLAIN, 2)), ((1, 0), (3, 1))],
    4: [((2, 1), (4, 0)), ((4, 1), (1, 3)), ((2, 2), (PLAIN, 1)), ((PLAIN, 1), (2, 3))],
}
RESHARD_BLOCKS = 6


def _total_micro(world: int) -> int:
    return 4 if world <= 2 else world


def _global_batches(steps: int, world: int) -> list[list[tuple[Tensor, Tensor]]]:
    """[step][micro-batch] of one global batch per step, the same whatever the layout."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (_total_micro(world), MICRO, SEQ + 1), generator=g)
        out.append([(t[:, :-1], t[:, 1:]) for t in tokens])
    return out


class _Run:
    """One layout's engine over the global batches: its data-parallel share of each step."""

    def __init__(self, groups: ProcessGroups, stages: int, zero: int, seed: int) -> None:
        world = groups.world_size
        dp = world // max(stages, 1)
        self.gas = _total_micro(world) // dp
        cfg = pipe_config(zero, clip=0.5)
        cfg["gradient_accumulation_steps"] = self.gas
        net = PipelineModule(specs(RESHARD_BLOCKS, True), num_stages=max(stages, 1), loss_fn=loss_fn,
                             seed_layers=True, base_seed=seed)
        self.plain = stages == PLAIN
        model = net.to_sequential() if self.plain else net
        self.engine = zeroshard.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)[0]
        self.dp_rank, self.world = groups.rank % dp, world

    def step(self, batch: list[tuple[Tensor, Tensor]]) -> float:
        mine = batch[self.dp_rank * self.gas : (self.dp_rank + 1) * self.gas]
        if not self.plain:
            return float(self.engine.train_batch(iter(mine)))
        total = torch.zeros(1)
        for ids, labels in mine:
            loss = loss_fn(self.engine(ids), labels)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach() / self.gas
        if self.world > 1:
            torch.distributed.all_reduce(total)
        return float(total[0]) / self.world


def _name(stages: int, zero: int, world: int) -> str:
    return f"{'plain' if stages == PLAIN else f'pp{stages}'}xdp{world // max(stages, 1)}-z{zero}"


@pytest.mark.parametrize("case", range(4))
def test_checkpoint_reshards_across_pipeline_dp_and_stage(groups: ProcessGroups, shared_dir: Any, case: int) -> None:
    """Save at one layout after 2 steps, load into another (stage count, data-parallel degree, ZeRO
    stage, or no pipeline) with its optimizer state, train 2 more: the uninterrupted run's losses."""
    cases = RESHARD.get(groups.world_size, [])
    if case >= len(cases):
        pytest.skip(f"{len(cases)} reshard cases at world size {groups.world_size}")
    (a, za), (b, zb) = cases[case]
    batches = _global_batches(4, groups.world_size)
    first = _Run(groups, a, za, BASE_SEED)
    whole = [first.step(batches[s]) for s in range(2)]
    first.engine.save_checkpoint(shared_dir, tag="r")
    whole += [first.step(batches[s]) for s in range(2, 4)]
    second = _Run(groups, b, zb, BASE_SEED + 99)  # other initial values: the load must replace them
    path, _ = second.engine.load_checkpoint(shared_dir, tag="r")
    assert path is not None and second.engine.global_steps == 2
    resumed = [second.step(batches[s]) for s in range(2, 4)]
    worst = max(abs(x - y) for x, y in zip(resumed, whole[2:], strict=True))
    print(f"\nreshard {_name(a, za, groups.world_size)} -> {_name(b, zb, groups.world_size)}: max |dloss| {worst:.2e}")
    assert worst <= 1e-6, f"resumed losses {resumed} != uninterrupted {whole[2:]}"


def _to_deepspeed(zs_ckpt: Path, ds_ckpt: Path, zero: int, dp: int, param_group: dict[str, Any]) -> None:
    """Rewrite zeroshard pipeline checkpoint `zs_ckpt` in DeepSpeed's pipeline layout (ds_pipe_writer.py)."""
    layout = read_pipe_layout(zs_ckpt)
    assert layout is not None
    multi = MultiReader(pipeline_sources(zs_ckpt, layout, lambda n: n), 0, zs_ckpt)
    index = multi.master_index()
    params = {}
    for p in multi.manifest.params:
        master, state = multi.masters(index, p.name, 0, p.numel)
        params[p.name] = (master.view(p.shape), {"step": state["step"], "exp_avg": state["exp_avg"].view(p.shape),
                                                 "exp_avg_sq": state["exp_avg_sq"].view(p.shape)})
    stages = [[p.name for p in read_manifest(zs_ckpt / stage_dir(s)).params] for s in range(layout.num_stages)]
    layers = {int(f.name[6:8]): torch.load(f) for f in zs_ckpt.glob("layer_*-model_states.pt")}
    write_ds_pipeline(ds_ckpt, stages, params, layers, zero=zero, dp=dp, global_steps=2, param_group=param_group)


@pytest.mark.parametrize("zero", [0, 1])
def test_deepspeed_pipeline_checkpoint_loads_at_another_layout(groups: ProcessGroups, shared_dir: Any,
                                                               zero: int) -> None:
    """DeepSpeed's pipeline file layout (2 stages, written by ds_pipe_writer.py from a zeroshard run)
    loads at 2 stages and at another stage count and continues with the uninterrupted run's losses."""
    world = groups.world_size
    if world % 2:
        pytest.skip("the DeepSpeed checkpoint here has 2 stages")
    batches = _global_batches(4, world)
    first = _Run(groups, 2, 1, BASE_SEED)
    whole = [first.step(batches[s]) for s in range(2)]
    first.engine.save_checkpoint(shared_dir / "zs", tag="r")
    whole += [first.step(batches[s]) for s in range(2, 4)]
    if groups.rank == 0:
        group = {k: v for k, v in first.engine.optimizer.param_groups[0].items() if k != "params"}
        _to_deepspeed(shared_dir / "zs" / "r", shared_dir / "ds" / "global_step2", zero, world // 2, group)
        # to-fp32 of both: the model without a pipeline's names (to_sequential), the same values
        plain = SequentialLayers(specs(RESHARD_BLOCKS, True))  # what PipelineModule.to_sequential() builds
        want = {n for n, _ in plain.named_parameters()}
        zs = get_fp32_state_dict_from_zero_checkpoint(shared_dir / "zs", tag="r")
        ds = get_fp32_state_dict_from_zero_checkpoint(shared_dir / "ds")
        assert set(zs) == want and set(ds) == want, (sorted(zs), sorted(ds), sorted(want))
        for n in want:
            assert torch.equal(zs[n], ds[n]), n
    if world > 1:
        torch.distributed.barrier()
    assert sorted(p.name for p in (shared_dir / "ds" / "global_step2").iterdir() if "mp_rank" in p.name) == sorted(
        [f"mp_rank_{s:02d}_model_states.pt" for s in range(2)]
        + ([f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for s in range(2) for d in range(world // 2)]
           if zero else []))
    for stages in (2, 1 if world == 2 else 4):
        second = _Run(groups, stages, zero, BASE_SEED + 99)
        path, _ = second.engine.load_checkpoint(shared_dir / "ds")
        assert path is not None and second.engine.global_steps == 2
        resumed = [second.step(batches[s]) for s in range(2, 4)]
        worst = max(abs(x - y) for x, y in zip(resumed, whole[2:], strict=True))
        print(f"\nDeepSpeed-layout pp2xdp{world // 2}-z{zero} -> pp{stages}xdp{world // stages}-z{zero}: "
              f"max |dloss| {worst:.2e}")
        assert worst <= 1e-6, f"resumed losses {resumed} != uninterrupted {whole[2:]}"


@pytest.mark.parametrize("zero", [1, 3])
def test_save_16bit_model_writes_every_stage_once(groups: ProcessGroups, shared_dir: Any, zero: int) -> None:
    """save_16bit_model of a pipeline: one file on rank 0 with every stage's weights (the tied module
    once), equal to the stages' own values (DeepSpeed's pipeline engine cannot export at all)."""
    stages = stage_layouts(groups.world_size)[-1]
    cfg = pipe_config(zero, 0.0)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, _ = train_pipeline(groups, stages, 3, True, 1, cfg)
    assert engine.save_16bit_model(shared_dir, "whole.bin")
    mine = ZeroEngine._zero3_consolidated_16bit_state_dict(engine)  # this stage's own, on its first rank
    Comm(groups).barrier()
    saved = torch.load(shared_dir / "whole.bin", weights_only=True)
    want_names = set(reference_model(3, True).state_dict())
    assert set(saved) == want_names, f"saved {sorted(saved)} != the whole model's {sorted(want_names)}"
    for name, value in (mine or {}).items():
        assert torch.equal(saved[name], value), f"{name} differs from stage {engine.stage_id}'s own"


def test_tied_weights_stay_equal_across_stages(groups: ProcessGroups) -> None:
    stages = stage_layouts(groups.world_size)[0]
    engine, _ = train_pipeline(groups, stages, 2 * stages, True, 2, pipe_config(1, clip=0.0))
    module = engine.module
    holds = engine.is_first_stage() or engine.is_last_stage()  # the embedding and the tied head
    assert ("tied_modules.embed.weight" in dict(module.named_parameters())) == holds
    w = module.tied_parameters("embed")[0].detach().clone() if holds else torch.zeros(VOCAB, DIM)
    mine = torch.cat([w.reshape(-1), torch.tensor([1.0 if holds else 0.0])])
    everyone = [torch.zeros_like(mine) for _ in range(groups.world_size)]
    if groups.world_size > 1:
        torch.distributed.all_gather(everyone, mine)
    else:
        everyone = [mine]
    held = [t[:-1] for t in everyone if t[-1] == 1.0]
    assert len(held) >= min(2, groups.world_size)
    for other in held:
        assert torch.equal(other, held[0]), "the tied embedding differs between stages after training"


def test_eval_batch_and_refused_calls(groups: ProcessGroups) -> None:
    stages = stage_layouts(groups.world_size)[0]
    blocks = 2 * stages
    engine, _ = train_pipeline(groups, stages, blocks, False, 1, pipe_config(0, clip=0.0))
    dp = groups.world_size // stages
    batch = data(1, dp)[0][groups.rank % dp]
    loss = engine.eval_batch(iter(batch))
    assert torch.is_tensor(loss) and loss.numel() == 1 and math.isfinite(float(loss))
    with pytest.raises(PipelineError, match="train_batch"):
        engine.step()
    assert engine.is_first_stage() == (engine.stage_id == 0)
    assert engine.is_last_stage() == (engine.stage_id == stages - 1)
    assert engine.micro_batches == GAS and engine.num_stages == stages


def train_reference_mixed(dtype: torch.dtype, steps: int, dp: int, scale: float = 1.0, skip: int = -1,
                          accum: torch.dtype = torch.float32) -> tuple[list[float], dict[str, Tensor]]:
    """The same layers without a pipeline in zeroshard's mixed precision: `dtype` weights and
    activations, each micro-batch's gradient summed in `accum`, fp32 master weights stepped by
    AdamW (untied layers: autograd would sum a tied weight's two uses in the weight's dtype, the
    pipeline sums them in fp32 across stages); `skip`: the step whose gradients overflowed (no
    update, the scale halved after it)."""
    model = reference_model(2, False).to(dtype)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.01)
    losses = []
    for step, batch in enumerate(data(steps, dp)):
        acc = [torch.zeros_like(m, dtype=accum) for m in master]
        total = 0.0
        for rank_batches in batch:  # each data-parallel rank sums its micro-batches, then the ranks' sums add
            mine = [torch.zeros_like(m, dtype=accum) for m in master]
            for ids, labels in rank_batches:
                loss = loss_fn(reference_forward(model, 2, False, ids), labels)
                (loss.float() * (scale / GAS)).backward()
                total += loss.item() / (GAS * dp)
                for a, p in zip(mine, params):
                    a += p.grad.to(accum)
                    p.grad = None
            for a, m in zip(acc, mine):
                a += m
        losses.append(total)
        if step == skip:
            scale /= 2
            continue
        for m, a in zip(master, acc):
            m.grad = a.float() / (scale * dp)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    return losses, {k: v.detach().float() for k, v in model.state_dict().items()}


def mixed_config(precision: str, **extra: Any) -> dict[str, Any]:
    cfg = pipe_config(1, clip=0.0)
    cfg[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {}), **extra}
    return cfg


def deviations(engine: Any, losses: list[float], want_losses: list[float], want: dict[str, Tensor]
               ) -> tuple[float, float]:
    """(max relative loss deviation, max weight deviation in units of the weight's dtype epsilon)."""
    loss_dev = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses, strict=True))
    ulps = 0.0
    for name, p in engine.module.named_parameters():
        eps = torch.finfo(p.dtype).eps
        ulps = max(ulps, ((p.detach().float() - want[name]).abs() / (want[name].abs() * eps + 1e-30)).max().item())
    return loss_dev, ulps


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_pipeline_matches_single_process(groups: ProcessGroups, precision: str) -> None:
    """bf16 / fp16 (dynamic loss scale 2**8, no overflow): micro-batch gradients summed in fp32
    (Note: [exact gradient handover]), the same losses and weights as without a pipeline."""
    stages = stage_layouts(groups.world_size)[0]
    dp = groups.world_size // stages
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    engine, losses = train_pipeline(groups, stages, 2, False, 3, mixed_config(precision))
    assert next(engine.module.parameters()).dtype == dtype
    want_losses, want = train_reference_mixed(dtype, 3, dp, scale=256.0 if precision == "fp16" else 1.0)
    loss_dev, ulps = deviations(engine, losses, want_losses, want)
    assert loss_dev < 1e-5 and ulps <= 2.0, f"{precision}: loss deviation {loss_dev:.1e}, weights {ulps:.1f} ulp"


def test_bf16_gradients_accumulate_in_fp32_unless_configured(groups: ProcessGroups) -> None:
    """data_types.grad_accum_dtype: "bf16" sums in bf16 (the reference doing so), the default in fp32."""
    stages = stage_layouts(groups.world_size)[0]
    dp = groups.world_size // stages
    cfg = mixed_config("bf16")
    cfg["data_types"] = {"grad_accum_dtype": "bf16"}
    engine, losses = train_pipeline(groups, stages, 2, False, 3, cfg)
    want_losses, want = train_reference_mixed(torch.bfloat16, 3, dp, accum=torch.bfloat16)
    loss_dev, ulps = deviations(engine, losses, want_losses, want)
    assert loss_dev < 1e-5 and ulps <= 2.0, f"bf16 accumulation: loss deviation {loss_dev:.1e}, {ulps:.1f} ulp"
    fp32_ulps = deviations(engine, losses, *train_reference_mixed(torch.bfloat16, 3, dp))[1]
    assert fp32_ulps > 4.0, f"the fp32-summing reference is {fp32_ulps:.1f} ulp away too: the test sees no difference"


def test_fp16_overflow_in_one_stage_skips_the_step_on_every_stage(groups: ProcessGroups) -> None:
    """An inf in one rank's last-stage gradient at step 2: every rank skips that step and halves
    the loss scale (hysteresis 1); the run equals the same layers without a pipeline skipping step 2."""
    stages = stage_layouts(groups.world_size)[0]
    dp = groups.world_size // stages
    net = PipelineModule(specs(2, False), num_stages=stages, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED)
    engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()),
                                      config=mixed_config("fp16", hysteresis=1))
    poisoned = groups.rank == groups.world_size - 1  # the last stage of the last data-parallel replica
    losses, scales, unchanged = [], [], []
    for step, batch in enumerate(data(4, dp)):
        hook = None
        if step == 1 and poisoned:
            hook = next(engine.module.parameters()).register_hook(lambda g: g * float("inf"))
        before = [p.detach().clone() for p in engine.module.parameters()]
        losses.append(float(engine.train_batch(iter(batch[groups.rank % dp]))))
        unchanged.append(all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters())))
        scales.append(engine.get_loss_scale())
        if hook is not None:
            hook.remove()
    assert unchanged == [False, True, False, False], f"rank {groups.rank}: steps that left the weights: {unchanged}"
    assert scales == [256.0, 128.0, 128.0, 128.0], scales
    want_losses, want = train_reference_mixed(torch.float16, 4, dp, scale=256.0, skip=1)
    loss_dev, ulps = deviations(engine, losses, want_losses, want)
    assert loss_dev < 1e-5 and ulps <= 2.0, f"loss deviation {loss_dev:.1e}, weights {ulps:.1f} ulp"
