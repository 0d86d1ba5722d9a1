"""Pipeline parallelism against the same layers trained in one process without a pipeline.

World 1: one stage (no schedule). World 2: 2 stages. World 3: 3 stages. World 4 (tests/run.py's
dist4 stage): 2 stages x data parallel 2, and 4 stages. fp32; per-step losses and final weights
agree within ~1e-6 relative at every ZeRO stage and schedule. bf16 and fp16 (dynamic loss scale,
an overflow in one stage skipping the step everywhere): the same losses, weights within an ulp.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zeroshard
from zeroshard.comm import ProcessGroups
from zeroshard.errors import CheckpointError
from zeroshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zeroshard.pipe.module import PipelineError

VOCAB, DIM, SEQ = 16, 8, 6
MICRO, GAS = 2, 4
BASE_SEED = 1234


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.5)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


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


def train_reference(blocks: int, tied: bool, steps: int, dp: int, clip: float, lr: float = 1e-2
                    ) -> tuple[list[float], dict[str, Tensor]]:
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
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
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


def test_checkpoint_into_another_stage_layout_is_refused(groups: ProcessGroups, shared_dir: Any) -> None:
    stages = stage_layouts(groups.world_size)[0]
    engine, _ = train_pipeline(groups, stages, 2 * stages, False, 1, pipe_config(0, clip=0.0))
    engine.save_checkpoint(shared_dir, tag="t")
    other, _ = train_pipeline(groups, stages, 2 * stages, False, 0, pipe_config(0, clip=0.0),
                              partition_method="uniform")
    if other.module.parts == engine.module.parts:
        other.module.parts = [*engine.module.parts[:-1], engine.module.parts[-1] + 1]  # a layout that differs
    with pytest.raises(CheckpointError, match="another pipeline layout"):
        other.load_checkpoint(shared_dir, tag="t")


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
