"""`fp8` (runtime/fp8.py) in the engine: ZeRO 0-3, a pipeline, AutoTP, and a loss curve against bf16.

- bf16 + fp8 at every ZeRO stage equals a one-process oracle bit for bit: the same model with the
  same layers converted, bf16 forward/backward per micro-batch, fp32 masters and AdamW
  (engine_helpers.train_bf16_reference). Sums of bf16 gradients in fp32 are exact in any order,
  so this holds at any world size. The float8 layer itself equals an fp32 emulation bit for bit
  (tests/unit/test_fp8_linear.py); together: the engine trains exactly the emulated float8 model.
- fp32 + fp8: stages 1-3 give stage 0's losses (within fp32 round-off of the gradient sum).
- A checkpoint of the converted model resumes bit for bit (stage 1, stage 2 with CPU offload, stage 3).
- Activation checkpointing (torch's, non-reentrant) changes no bit (stage 0; stage 3 with the float8 gather).
- A 40-step run on a learnable sequence: fp8 (both recipes) stays within a stated band of bf16.
- A PipelineModule: the model's first and last linear layers stay high precision whatever the
  stage count, and the losses equal the one-process fp8 reference.
- AutoTP (autotp_size 2, at 2 ranks): the split layers run float8 with scales over their shards.
- `fp8.backend: "torchao"`: refused by name without torchao; with it, the same losses as zeroshard's
  layers (fp32, tensorwise); refused with a pipeline either way.
Runs at world sizes 1 and 2.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import (
    global_batches,
    init_engine,
    make_config,
    make_model,
    train_bf16_reference,
    train_engine,
)
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import zeroshard
from zeroshard.comm import Comm, ProcessGroups
from zeroshard.errors import NotSupportedError
from zeroshard.examples.gpt import GPT, GPTConfig
from zeroshard.pipe import LayerSpec, PipelineModule
from zeroshard.runtime.fp8 import convert_to_fp8, fp8_layers

STEPS = 3


def _zero(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every unit gathered and released by its hooks
    return zero


def _config(stage: int, precision: str, recipe: str | None, **extra: Any) -> dict[str, Any]:
    cfg = make_config(zero_optimization=_zero(stage), **extra)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if recipe is not None:
        cfg["fp8"] = {"enabled": True, "recipe": recipe}
    return cfg


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_fp8_equals_one_process_oracle_bitwise(groups: ProcessGroups, comm: Comm, stage: int,
                                                    recipe: str) -> None:
    rank, world = groups.rank, groups.world_size
    batches = global_batches(STEPS, 2 * world)
    engine = init_engine(make_model(), _config(stage, "bf16", recipe))
    # tiny GPT: blocks.0.attn.qkv is the first linear layer, lm_head the last; the 7 between run float8
    assert fp8_layers(engine.module) == [f"blocks.{i}.{m}" for i in range(2) for m in (
        *(("attn.proj",) if i == 0 else ("attn.qkv", "attn.proj")), "mlp.0", "mlp.2")]
    local, params = train_engine(engine, batches, rank, world)
    losses = _global_mean(comm, local)
    oracle = make_model()
    convert_to_fp8(oracle, recipe)
    want_losses, want_params = train_bf16_reference(oracle, batches)
    plain_losses, _ = train_bf16_reference(make_model(), batches)
    assert losses == want_losses, f"stage {stage} {recipe}: {losses} != oracle {want_losses}"
    for i, (got, want) in enumerate(zip(params[-1], want_params[-1], strict=True)):
        assert torch.equal(got, want), f"param {i}: max |diff| {(got - want).abs().max().item()}"
    assert losses[1:] != plain_losses[1:], "fp8 changed nothing: the float8 layers did not run"
    # the layers hold bf16 weights; the optimizer steps fp32 masters with fp32 state
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            assert p.dtype == torch.float32 and engine.optimizer.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("stage,offload", [(1, False), (2, True), (3, False)], ids=["s1", "s2-offload", "s3"])
def test_resume_is_bitwise_exact(groups: ProcessGroups, shared_dir: Path, stage: int, offload: bool) -> None:
    """A converted model saves and loads under the same keys (the layers are converted in place)."""
    rank, world = groups.rank, groups.world_size
    data = global_batches(6, 2 * world)
    cfg = _config(stage, "bf16", "rowwise")
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine = init_engine(make_model(), cfg)
    train_engine(engine, data[:3], rank, world)
    engine.save_checkpoint(shared_dir)
    want_losses, want = train_engine(engine, data[3:], rank, world)
    resumed = init_engine(make_model(seed=7), cfg)
    resumed.load_checkpoint(shared_dir, load_rng_state=True)
    got_losses, got = train_engine(resumed, data[3:], rank, world)
    assert got_losses == want_losses
    for step, (a_list, b_list) in enumerate(zip(got, want, strict=True)):
        for i, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
            assert torch.equal(a, b), f"step {step} parameter {i} differs"


def _global_mean(comm: Comm, losses: list[float]) -> list[float]:
    """Per step, the mean of the ranks' losses (in float64: the oracle's sum in Python floats)."""
    t = torch.tensor(losses, dtype=torch.float64)
    comm.all_reduce(t)
    return [v / comm.world_size for v in t.tolist()]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_float8_all_gather_is_bitwise_the_same_training(groups: ProcessGroups, comm: Comm, precision: str) -> None:
    """Stage 3 with `fp8.float8_all_gather`: the float8 weights travel as e4m3 codes, with one amax
    all-reduce per step, and the losses and weights are those of the exact gather, bit for bit."""
    rank, world = groups.rank, groups.world_size
    batches = global_batches(STEPS, 2 * world)
    exact = init_engine(make_model(), _config(3, precision, "tensorwise"))
    want, want_params = train_engine(exact, batches, rank, world)
    cfg = _config(3, precision, "tensorwise")
    cfg["fp8"]["float8_all_gather"] = True
    engine = init_engine(make_model(), cfg)
    gather = engine.strategy._shards._training
    assert type(gather).__name__ == "Float8Gather"
    got, got_params = train_engine(engine, batches, rank, world)
    assert got == want, f"{got} != exact gather's {want}"
    for i, (a, b) in enumerate(zip(got_params[-1], want_params[-1], strict=True)):
        assert torch.equal(a, b), f"param {i}: max |diff| {(a - b).abs().max().item()}"
    assert gather.amax_reductions == STEPS  # one per step (the first at the first gather)
    sent = sum(gather.wire_bytes(u) for u in range(len(gather._layouts)) if gather._layouts[u].segments)
    plain = sum(gather._chunk(u).numel() * gather._chunk(u).element_size()
                for u in range(len(gather._layouts)) if gather._layouts[u].segments)
    if rank == 0:
        print(f"\nfloat8 all-gather ({precision}, {world} rank(s)): {sent} bytes per rank per gather of the "
              f"units holding float8 weights, against {plain} exact")
    # The tiny GPT's units also hold norms, biases and the high-precision first qkv, padded to the largest
    # rank's count, which weighs more as the ranks' slices shrink: measured bf16 0.67 / 0.79 / 0.91 and fp32
    # 0.42 / 0.54 / 0.66 of the exact bytes at 1 / 2 / 3 ranks.
    bound = {"bf16": {1: 0.7, 2: 0.8, 3: 0.92}, "fp32": {1: 0.45, 2: 0.55, 3: 0.67}}[precision].get(world, 1.0)
    assert sent < bound * plain


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_fp8_stages_agree_with_stage0(groups: ProcessGroups, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    batches = global_batches(STEPS, 2 * world)
    want, _ = train_engine(init_engine(make_model(), _config(0, "fp32", "tensorwise")), batches, rank, world)
    got, _ = train_engine(init_engine(make_model(), _config(stage, "fp32", "tensorwise")), batches, rank, world)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), f"stage {stage} step {step}: {a} != stage 0's {b}"


class _CheckpointedGPT(GPT):
    """The example GPT whose blocks run under torch's non-reentrant activation checkpointing."""

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        assert targets is not None
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


@pytest.mark.parametrize("stage", [0, 3])
def test_activation_checkpointing_recomputes_the_same_float8(groups: ProcessGroups, stage: int) -> None:
    """The recompute in backward quantises the same inputs with the same dynamic scales (at stage 3
    after a float8 re-gather), so checkpointing changes no bit."""
    rank, world = groups.rank, groups.world_size
    batches = global_batches(STEPS, 2 * world)
    cfg = _config(stage, "bf16", "tensorwise")
    if stage == 3:
        cfg["fp8"]["float8_all_gather"] = True
    want, want_params = train_engine(init_engine(make_model(), cfg), batches, rank, world)
    reference = make_model()
    model = _CheckpointedGPT(reference.config)
    model.load_state_dict(reference.state_dict())
    got, got_params = train_engine(init_engine(model, cfg), batches, rank, world)
    assert got == want, f"stage {stage}: {got} != {want}"
    for i, (a, b) in enumerate(zip(got_params[-1], want_params[-1], strict=True)):
        assert torch.equal(a, b), f"param {i}"


# -- a loss curve against bf16 --------------------------------------------------------------------

CURVE = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, tie_weights=False)
CURVE_STEPS = 50
BAND, FINAL_BAND = 0.05, 0.03
"""fp8's per-step loss within 5% of bf16's (relative), and the mean of the last 5 steps within 3%.
Measured at world size 1 (loss 4.18 -> 1.80 in bf16): largest per-step gap 2.3% (tensorwise) and
1.1% (rowwise), final step 1.6% and 0.07%; docs/precision.md has both world sizes."""


def _learnable_batches(steps: int, batch: int) -> list[tuple[Tensor, Tensor]]:
    """Sequences where each next token is (5 t + 3) mod V with probability 0.75, else random: a
    loss that falls from ln V towards the noise floor, which a broken float8 GEMM would not follow."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        t = torch.randint(0, CURVE.vocab_size, (batch, CURVE.block_size + 1), generator=g)
        keep = torch.rand(batch, CURVE.block_size, generator=g) < 0.75
        for i in range(CURVE.block_size):
            t[:, i + 1] = torch.where(keep[:, i], (5 * t[:, i] + 3) % CURVE.vocab_size, t[:, i + 1])
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _curve(groups: ProcessGroups, recipe: str | None) -> list[float]:
    torch.manual_seed(0)
    model = GPT(CURVE)
    cfg = _config(0, "bf16", recipe, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    cfg["optimizer"]["params"]["lr"] = 1e-2
    engine = init_engine(model, cfg)
    losses, _ = train_engine(engine, _learnable_batches(CURVE_STEPS, 4 * groups.world_size),
                             groups.rank, groups.world_size)
    return losses


def test_loss_curve_within_band_of_bf16(groups: ProcessGroups) -> None:
    bf16 = _curve(groups, None)
    assert bf16[-1] < 0.6 * bf16[0], f"the bf16 run did not learn: {bf16[0]:.3f} -> {bf16[-1]:.3f}"
    for recipe in ("tensorwise", "rowwise"):
        fp8 = _curve(groups, recipe)
        gaps = [abs(a - b) / b for a, b in zip(fp8, bf16, strict=True)]
        tail, tail_bf16 = sum(fp8[-5:]) / 5, sum(bf16[-5:]) / 5
        if groups.rank == 0:
            print(f"\nfp8 {recipe} vs bf16 over {CURVE_STEPS} steps: max per-step gap {max(gaps):.4f}, "
                  f"last 5 steps {tail:.4f} vs {tail_bf16:.4f}, first/last bf16 {bf16[0]:.4f}/{bf16[-1]:.4f}")
        assert fp8 != bf16, f"{recipe}: identical to bf16, the float8 layers did not run"
        assert max(gaps) <= BAND, f"{recipe}: per-step gap {max(gaps):.4f} > {BAND} (step {gaps.index(max(gaps))})"
        assert abs(tail - tail_bf16) <= FINAL_BAND * tail_bf16, f"{recipe}: last 5 steps {tail} vs bf16 {tail_bf16}"


# -- a pipeline -------------------------------------------------------------------------------------

VOCAB, DIM, SEQ, MICRO, GAS = 32, 16, 8, 2, 2


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.inp = nn.Linear(DIM, DIM)

    def forward(self, ids: Tensor) -> Tensor:
        return self.inp(self.emb(ids))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


def _loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _pipe_specs() -> list[LayerSpec]:
    return [LayerSpec(_Embed), *[LayerSpec(_Block) for _ in range(4)], LayerSpec(_Head)]


def _pipe_data(steps: int, dp: int) -> list[list[list[tuple[Tensor, Tensor]]]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        t = torch.randint(0, VOCAB, (dp, GAS, MICRO, SEQ + 1), generator=g)
        out.append([[(t[d, m, :, :-1], t[d, m, :, 1:]) for m in range(GAS)] for d in range(dp)])
    return out


def _pipe_reference(steps: int, dp: int, recipe: str) -> list[float]:
    """The same layers (same seeds) in one process, converted as a whole model."""
    layers = []
    for idx, spec in enumerate(_pipe_specs()):
        torch.manual_seed(1234 + idx)
        layers.append(spec.build())
    model = nn.Sequential(*layers)
    convert_to_fp8(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for batch in _pipe_data(steps, dp):
        total = 0.0
        for rank_batches in batch:
            for ids, labels in rank_batches:
                loss = _loss(model(ids), labels)
                (loss / (GAS * dp)).backward()
                total += loss.item() / (GAS * dp)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_pipeline_keeps_the_models_first_and_last_layers(groups: ProcessGroups, recipe: str) -> None:
    world = groups.world_size
    # At most 2 data-parallel ranks: a sum of two fp32 gradients is exact in either order, three are not
    # (gloo's order differs from the reference's), and float8 rounding turns a last-bit weight
    # difference into a 1e-3 loss one (measured at PP 1 x DP 3: 1.4e-3 relative at step 2).
    stages = 3 if world == 3 else (2 if world % 2 == 0 else 1)
    dp = world // stages
    net = PipelineModule(_pipe_specs(), num_stages=stages, loss_fn=_loss, seed_layers=True, base_seed=1234)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "steps_per_print": 1000,
           "zero_optimization": {"stage": 1}, "fp8": {"enabled": True, "recipe": recipe}}
    if stages > GAS:  # 1F1B needs as many micro-batches as stages; GPipe does not
        cfg["pipeline"] = {"schedule": "GPipe"}
    engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)
    stage = engine.module.stage_id
    names = {n for n, m in engine.module.named_modules() if isinstance(m, nn.Linear)}
    converted = set(fp8_layers(engine.module))
    kept = names - converted
    want_kept = ({n for n in names if n.endswith(".inp")} if stage == 0 else set()) | (
        {n for n in names if n.endswith(".out")} if stage == stages - 1 else set())
    assert kept == want_kept, (stage, sorted(kept), sorted(want_kept))
    losses = [float(engine.train_batch(iter(batch[groups.rank % dp]))) for batch in _pipe_data(STEPS, dp)]
    want = _pipe_reference(STEPS, dp, recipe)
    for step, (a, b) in enumerate(zip(losses, want, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), f"step {step}: pipeline {a} != one process {b}"


# -- AutoTP -----------------------------------------------------------------------------------------


def test_autotp_layers_run_float8(groups: ProcessGroups) -> None:
    if groups.world_size != 2:
        pytest.skip("AutoTP with autotp_size 2 needs 2 ranks")
    from tp_helpers import lm_loss, tiny_llama

    def run(recipe: str | None) -> tuple[Any, list[float]]:
        cfg = _config(1, "fp32", recipe, train_micro_batch_size_per_gpu=2, tensor_parallel={"autotp_size": 2})
        engine = init_engine(tiny_llama(hidden=64), cfg)
        g = torch.Generator().manual_seed(1)
        losses = []
        for ids in [torch.randint(0, 96, (2, 8), generator=g) for _ in range(STEPS)]:
            loss = lm_loss(engine, ids)  # both ranks hold the same batch: one data-parallel rank
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return engine, losses

    engine, fp8_tp = run("tensorwise")
    split = [n for n, m in engine.module.named_modules() if callable(getattr(m, "linear_fn", None))]
    assert len(split) == 15 and split[0].endswith("layers.0.self_attn.q_proj") and split[-1] == "lm_head"
    assert fp8_layers(engine.module) == split[1:-1]  # the model's first and last linear layers stay
    _, plain_tp = run(None)
    assert fp8_tp != plain_tp
    for a, b in zip(fp8_tp, plain_tp, strict=True):
        assert abs(a - b) <= 0.02 * b, (fp8_tp, plain_tp)


# -- torchao as the backend ---------------------------------------------------------------------------

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def test_torchao_backend(groups: ProcessGroups) -> None:
    """Without torchao (zeroshard does not depend on it) the backend is refused by name; with it
    (checked by hand with torchao 0.18 on PYTHONPATH, docs/precision.md), torchao's Float8Linear
    replaces the same layers and trains to zeroshard's losses (fp32, tensorwise: equal at 1 rank,
    within 1e-7 relative at 2 ranks, from the third step: a rounding difference whose source was not
    traced)."""
    rank, world = groups.rank, groups.world_size
    cfg = _config(1, "fp32", "tensorwise")
    cfg["fp8"]["backend"] = "torchao"
    if not HAS_TORCHAO:
        with pytest.raises(NotSupportedError, match='fp8.backend "torchao": torchao cannot be imported'):
            init_engine(make_model(), cfg)
        return
    batches = global_batches(STEPS, 2 * world)
    engine = init_engine(make_model(), cfg)
    layers = fp8_layers(engine.module)
    assert len(layers) == 7 and all(type(engine.module.get_submodule(n)).__module__.startswith("torchao")
                                    for n in layers)
    got, _ = train_engine(engine, batches, rank, world)
    want, _ = train_engine(init_engine(make_model(), _config(1, "fp32", "tensorwise")), batches, rank, world)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):  # measured: equal at 1 rank, 9e-8 apart at 2
        assert math.isclose(a, b, rel_tol=1e-6), f"step {step}: torchao {a} != zeroshard {b}"


def test_torchao_backend_with_a_pipeline_is_refused(groups: ProcessGroups) -> None:
    stages = 2 if groups.world_size % 2 == 0 else 1
    net = PipelineModule(_pipe_specs(), num_stages=stages, loss_fn=_loss, seed_layers=True, base_seed=1234)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1},
           "fp8": {"enabled": True, "backend": "torchao"}}
    with pytest.raises(NotSupportedError, match='fp8.backend "torchao" with a PipelineModule'):
        zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)
