"""Sequence parallelism trained through the engine (issue 41 item 2) against one process on the full
sequence: SP 2 and 4 (and SP 2 x DP 2 at 4 ranks) at ZeRO 0, 1, 2, 3 and with CPU offload, masked
labels (one rank's slice of a sample entirely masked), gradient accumulation and clipping.

The model is a tiny causal LM whose attention is DeepSpeed-Ulysses' `DistributedAttention`; each rank
feeds its slice of each sample (global positions) and backpropagates its share of the token-weighted
loss (`token_weighted_loss`). The oracle is the same model in one process: for every data-parallel
rank and micro-batch, the masked mean over the whole micro-batch; the mean of those over ranks and
micro-batches is the step's loss; torch SGD with momentum and the same clipping. SGD (not Adam), unclipped
where the factor is the point, so that a gradient off by a constant factor (sp: an average where a sum
belongs) shows in the weights.
Cases that need more ranks than the run has are skipped (the same on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zeroshard
from zeroshard.comm import ProcessGroups
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.sequence import DistributedAttention, create_sequence_groups, parallel_state, token_weighted_loss
from zeroshard.sequence.ring import RingAttention, UlyssesRingAttention, shard_positions, ulysses_ring_groups

VOCAB, HEADS, HEAD_DIM, LAYERS, LOCAL = 29, 4, 4, 2, 4
HIDDEN = HEADS * HEAD_DIM
MICRO, GAS, STEPS, LR, MOMENTUM, CLIP = 2, 2, 3, 0.5, 0.9, 0.3
RTOL = 1e-6
"""fp32: the one-process oracle and the sharded run sum in different orders."""


class CausalSDPA(nn.Module):
    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [b, s, h, d]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


class Ulysses(nn.Module):
    def __init__(self, group: Any) -> None:
        super().__init__()
        self.inner = DistributedAttention(CausalSDPA(), group)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.inner(q, k, v, 0)


class Block(nn.Module):
    def __init__(self, attention: Callable[[], nn.Module], kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * kv_heads) * HEAD_DIM)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.attn = attention()

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (-1, HEAD_DIM)).split(
            [HEADS, self.kv_heads, self.kv_heads], dim=2)
        x = x + self.proj(self.attn(q, k, v).flatten(2))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A causal LM over a slice of each sample: `offset` (an int: the first of consecutive positions)
    or a tensor of the slice's global positions.

    `group`: the sequence-parallel group (a torch process group) the loss is weighted over and, by
    default, Ulysses' attention exchanges over; `attention` builds another attention module."""

    def __init__(self, group: Any = None, seed: int = 0, attention: Callable[[], nn.Module] | None = None,
                 kv_heads: int = HEADS, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.group, self.checkpointed = group, checkpointed
        if attention is None:
            attention = (lambda: Ulysses(group)) if group is not None else CausalSDPA
        self.emb, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(64, HIDDEN)
        self.blocks = nn.ModuleList(Block(attention, kv_heads) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: Tensor, labels: Tensor, offset: int | Tensor = 0) -> Tensor:
        positions = torch.arange(offset, offset + ids.shape[1]) if isinstance(offset, int) else offset
        x = self.emb(ids) + self.pos(positions)
        for block in self.blocks:  # DeepSpeed's reentrant checkpoint: the recompute runs the all-to-alls again
            x = zeroshard.checkpointing.checkpoint(block, x) if self.checkpointed else block(x)
        logits = self.head(x)
        count = (labels != -100).sum()
        local = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                reduction="sum") / count.clamp(min=1)
        return token_weighted_loss(local, count, self.group) if self.group is not None else local


def samples(steps: int, dp: int, sp: int, seed: int = 7) -> tuple[Tensor, Tensor]:
    """[steps * GAS * dp * MICRO, LOCAL * sp] token ids and next-token labels; ~30% of labels masked,
    and the first slice of sample 0 masked whole (a rank with nothing to count)."""
    gen = torch.Generator().manual_seed(seed)
    n, seq = steps * GAS * dp * MICRO, LOCAL * sp
    ids = torch.randint(0, VOCAB, (n, seq), generator=gen)
    labels = torch.cat((ids[:, 1:], torch.full((n, 1), -100)), dim=1)
    labels[torch.rand(n, seq, generator=gen) < 0.3] = -100
    labels[0, :LOCAL] = -100
    return ids, labels


def micro_batch(data: tuple[Tensor, Tensor], step: int, micro: int, dp_rank: int, dp: int) -> tuple[Tensor, Tensor]:
    start = ((step * GAS + micro) * dp + dp_rank) * MICRO
    return data[0][start:start + MICRO], data[1][start:start + MICRO]


def oracle(dp: int, sp: int, clip: float, kv_heads: int = HEADS) -> tuple[list[float], list[Tensor], list[float]]:
    """(per-step loss, final weights, per-step gradient norm) of one process on the full sequences."""
    model = TinyLM(kv_heads=kv_heads)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data, losses, norms = samples(STEPS, dp, sp), [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for micro in range(GAS):
            for d in range(dp):
                loss = model(*micro_batch(data, step, micro, d, dp)) / (GAS * dp)
                loss.backward()
                total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        opt.step()
        losses.append(total)
    return losses, [p.detach().clone() for p in model.parameters()], norms


def config(stage: int, offload: bool, sp: int, clip: float, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 200}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
            "gradient_clipping": clip, "steps_per_print": 1000, "zero_optimization": zero,
            "sequence_parallel_size": sp, **extra}


def train(engine: Any, groups: ProcessGroups, dp: int, sp: int, steps: range,
          norms: list[float] | None = None, positions: Tensor | None = None) -> list[float]:
    """Steps `steps` of the run: this rank's slice of its data-parallel rank's micro-batches (the
    global `positions` it holds; default its contiguous slice); each step's gradient norm appended to
    `norms`."""
    dp_rank, sp_rank = groups.rank // sp, groups.rank % sp
    data, losses = samples(STEPS, dp, sp), []
    if positions is None:
        positions = torch.arange(sp_rank * LOCAL, (sp_rank + 1) * LOCAL)
    for step in steps:
        total = torch.zeros(())
        for micro in range(GAS):
            ids, labels = micro_batch(data, step, micro, dp_rank, dp)
            loss = engine(ids[:, positions], labels[:, positions], offset=positions)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / GAS
        losses.append(total)
        if norms is not None:
            norms.append(engine.get_global_grad_norm())
    # the step's loss: the sequence ranks agree on theirs; average over the data-parallel ranks
    out = torch.stack(losses)
    torch.distributed.all_reduce(out, group=engine.seq_data_parallel_group)
    return (out / (dp * sp)).tolist()


def full_weights(engine: Any, stage: int) -> list[Tensor]:
    params = list(engine.module.parameters())
    if stage != 3:
        return [p.detach().clone() for p in params]
    with zeroshard.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def assert_matches(losses: list[float], weights: list[Tensor], want: tuple[list[float], list[Tensor], Any]) -> None:
    want_losses, want_weights, _ = want
    for step, (got, exp) in enumerate(zip(losses, want_losses)):
        assert abs(got - exp) <= RTOL * abs(exp), f"step {step + 1}: loss {got!r} != one process's {exp!r}"
    for i, (got, exp) in enumerate(zip(weights, want_weights)):
        rel = float((got - exp).norm() / exp.norm())
        assert rel <= RTOL, f"parameter {i}: relative difference {rel:.2e} from one process"


def _layout(groups: ProcessGroups, sp: int) -> int:
    if groups.world_size < 2 or groups.world_size % sp:
        pytest.skip(f"sequence parallelism of {sp} needs a multiple of {sp} ranks (>= 2); this run has "
                    f"{groups.world_size}")
    return groups.world_size // sp


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)])
def test_sequence_parallel_equals_one_process(groups: ProcessGroups, sp: int, stage: int, offload: bool) -> None:
    """Unclipped without offload (a gradient off by a factor moves SGD's weights), clipped with it (the
    clip factor needs the gradient norm over the dp x sp ranks, compared step by step)."""
    dp = _layout(groups, sp)
    clip = CLIP if offload else 0.0
    seq = create_sequence_groups(groups, sp)
    engine, *_ = zeroshard.initialize(model=TinyLM(seq.sp.dp_group), config=config(stage, offload, sp, clip))
    assert (engine.sequence_parallel_size, engine.dp_world_size, engine.seq_dp_world_size) == (sp, dp, dp * sp)
    norms: list[float] = []
    losses = train(engine, groups, dp, sp, range(STEPS), norms)
    want = oracle(dp, sp, clip)
    assert_matches(losses, full_weights(engine, stage), want)
    for step, (got, exp) in enumerate(zip(norms, want[2])):
        assert abs(got - exp) <= RTOL * exp, f"step {step + 1}: gradient norm {got!r} != one process's {exp!r}"
    assert not clip or min(want[2]) > clip, "the clipped cases must clip"


def test_without_the_sum_over_sequence_ranks_the_weights_differ(groups: ProcessGroups) -> None:
    """The check above can fail: training with the factor forced to 1 (ZeRO's plain mean over dp x sp,
    DeepSpeed 0.19.8's ZeRO-3 behaviour) leaves the weights off by far more than the tolerance."""
    dp = _layout(groups, 2)
    seq = create_sequence_groups(groups, 2)
    engine, *_ = zeroshard.initialize(model=TinyLM(seq.sp.dp_group), config=config(3, False, 2, 0.0))
    engine._sequence_factor = lambda: 1.0  # what a mean over all dp x sp ranks would give
    train(engine, groups, dp, 2, range(STEPS))
    with pytest.raises(AssertionError, match="relative difference"):
        assert_matches([], full_weights(engine, 3), ([], oracle(dp, 2, 0.0)[1], None))


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("stage", [1, 3])
def test_activation_checkpointing_in_cpu_memory_equals_one_process(groups: ProcessGroups, sp: int, stage: int) -> None:
    """Every block checkpointed (DeepSpeed's reentrant `checkpointing.checkpoint`) with the config's
    `activation_checkpointing.cpu_checkpointing`: each block's attention runs twice per micro-batch, the
    recompute's all-to-alls in the backward on every sequence rank alike, and training equals one process
    (on a CPU the inputs are in CPU memory already; on a GPU the same path copies them out and back)."""
    dp = _layout(groups, sp)
    seq = create_sequence_groups(groups, sp)
    model = TinyLM(seq.sp.dp_group, checkpointed=True)
    calls = [0]
    for block in model.blocks:
        block.attn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    cfg = config(stage, False, sp, 0.0, activation_checkpointing={"cpu_checkpointing": True})
    try:
        engine, *_ = zeroshard.initialize(model=model, config=cfg)
        assert zeroshard.checkpointing.settings().cpu_checkpointing
        losses = train(engine, groups, dp, sp, range(STEPS))
    finally:
        zeroshard.checkpointing.configure(None)  # the settings are process-wide: DeepSpeed's defaults again
    assert calls[0] == 2 * LAYERS * GAS * STEPS, "each block's forward once and its recompute once per micro-batch"
    assert_matches(losses, full_weights(engine, stage), oracle(dp, sp, 0.0))


@pytest.mark.parametrize("route", ["mpu", "mesh_param"])
def test_alst_mpu_and_mesh_param_routes(groups: ProcessGroups, route: str) -> None:
    """DeepSpeed's other ways in: ALST's mpu (`parallel_state_sp`, set up before initialize) and
    `initialize(mesh_param=(dp, sp))`, with no size in the config: the same groups and numbers."""
    dp = _layout(groups, 2)
    if route == "mpu":
        parallel_state.initialize_sequence_parallel(2)
        group = parallel_state.get_sequence_parallel_group()
        extra: dict[str, Any] = {"mpu": parallel_state}
    else:
        group = create_sequence_groups(groups, 2).sp.dp_group
        extra = {"mesh_param": (dp, 2)}
    cfg = config(2, False, 1, 0.0)
    del cfg["sequence_parallel_size"]
    engine, *_ = zeroshard.initialize(model=TinyLM(group), config=cfg, **extra)
    assert engine.seq_parallel_group is group and engine.sequence_parallel_size == 2
    assert_matches(train(engine, groups, dp, 2, range(STEPS)), full_weights(engine, 2), oracle(dp, 2, 0.0))


@pytest.mark.parametrize("sp, kind, ulysses, kv_heads", [
    (2, "ring", 1, 1), (4, "ring", 1, 1), (2, "ring-zigzag", 1, 1), (4, "ring-zigzag", 1, 2),
    (4, "ulysses-ring", 2, 2), (4, "ulysses-ring-zigzag", 2, 2)])
def test_ring_attention_trains_past_the_head_limit(groups: ProcessGroups, sp: int, kind: str, ulysses: int,
                                                   kv_heads: int) -> None:
    """Fewer K/V heads than sequence ranks (1 at SP 2 and 4; 2 at SP 4), which Ulysses cannot split:
    the ring (zeroshard/sequence/ring.py), contiguous or zigzag (causal load balance), alone or inside a
    2D layout (Ulysses over 2 ranks x the ring over 2), at ZeRO 2, equals one process."""
    dp = _layout(groups, sp)
    seq = create_sequence_groups(groups, sp)
    layout = "zigzag" if kind.endswith("zigzag") else "contiguous"
    if ulysses > 1:
        uly, ring = ulysses_ring_groups(seq.sp, ulysses)
        attention: Callable[[], nn.Module] = partial(UlyssesRingAttention, uly, ring, causal=True, layout=layout)
    else:
        attention = partial(RingAttention, seq.sp, causal=True, layout=layout)
    model = TinyLM(seq.sp.dp_group, attention=attention, kv_heads=kv_heads)
    engine, *_ = zeroshard.initialize(model=model, config=config(2, False, sp, 0.0))
    positions = shard_positions(LOCAL * sp, groups.rank % sp, sp, layout=layout, ulysses_size=ulysses)
    losses = train(engine, groups, dp, sp, range(STEPS), positions=positions)
    assert_matches(losses, full_weights(engine, 2), oracle(dp, sp, 0.0, kv_heads=kv_heads))


def test_a_checkpoint_saved_at_sp2_resumes_without_sequence_parallelism(groups: ProcessGroups,
                                                                        shared_dir: Path) -> None:
    """Checkpoints carry no sequence-parallel layout: two steps at SP 2, saved, loaded into the same
    model at SP 1 (every rank whole sequences of its own samples, one micro-batch each: the same
    global batch), one more step: the weights equal three steps of one process."""
    dp = _layout(groups, 2)
    seq = create_sequence_groups(groups, 2)
    engine, *_ = zeroshard.initialize(model=TinyLM(seq.sp.dp_group), config=config(2, False, 2, 0.0))
    first = train(engine, groups, dp, 2, range(2))
    engine.save_checkpoint(str(shared_dir), tag="sp2")
    plain, *_ = zeroshard.initialize(model=TinyLM(), config={**config(2, False, 1, 0.0),
                                                             "gradient_accumulation_steps": 1})
    plain.load_checkpoint(str(shared_dir), tag="sp2")
    assert plain.global_steps == 2 and plain.sequence_parallel_size == 1 and plain.dp_world_size == groups.world_size
    data = samples(STEPS, dp, 2)
    step3 = [micro_batch(data, 2, m, d, dp) for m in range(GAS) for d in range(dp)]  # GAS x dp = world
    plain.backward(plain(*step3[groups.rank]))
    plain.step()
    want = oracle(dp, 2, 0.0)
    assert_matches(first, full_weights(plain, 2), (want[0][:2], want[1], None))


def test_a_checkpoint_saved_at_sp4_resumes_at_sp2_times_dp2(groups: ProcessGroups, shared_dir: Path) -> None:
    """SP 4 (one data-parallel rank, two micro-batches) for two steps, saved; loaded at SP 2 x DP 2
    with one micro-batch per rank (the same global batch: data-parallel rank d takes micro-batch d,
    each sequence rank half of its tokens), one more step: the weights equal three steps of one
    process, momentum included (4 ranks only)."""
    if groups.world_size != 4:
        pytest.skip(f"SP 4 -> SP 2 x DP 2 needs 4 ranks; this run has {groups.world_size}")
    seq = create_sequence_groups(groups, 4)
    engine, *_ = zeroshard.initialize(model=TinyLM(seq.sp.dp_group), config=config(2, False, 4, 0.0))
    first = train(engine, groups, 1, 4, range(2))
    engine.save_checkpoint(str(shared_dir), tag="sp4")
    seq = create_sequence_groups(groups, 2)
    resumed, *_ = zeroshard.initialize(model=TinyLM(seq.sp.dp_group, seed=5),
                                       config={**config(2, False, 2, 0.0), "gradient_accumulation_steps": 1})
    resumed.load_checkpoint(str(shared_dir), tag="sp4")
    assert (resumed.global_steps, resumed.sequence_parallel_size, resumed.dp_world_size) == (2, 2, 2)
    dp_rank, sp_rank = groups.rank // 2, groups.rank % 2
    ids, labels = micro_batch(samples(STEPS, 1, 4), 2, dp_rank, 0, 1)
    positions = torch.arange(sp_rank * 2 * LOCAL, (sp_rank + 1) * 2 * LOCAL)
    resumed.backward(resumed(ids[:, positions], labels[:, positions], offset=positions))
    resumed.step()
    want = oracle(1, 4, 0.0)
    assert_matches(first, full_weights(resumed, 2), (want[0][:2], want[1], None))


def test_a_checkpoint_saved_at_sp2_times_dp2_resumes_at_sp4(groups: ProcessGroups, shared_dir: Path) -> None:
    """The other way: SP 2 x DP 2 for two steps, saved; loaded at SP 4 (one data-parallel rank, four
    micro-batches: the same global batch, each rank a quarter of every sample's tokens), one more step:
    the weights equal three steps of one process, momentum included (4 ranks only)."""
    if groups.world_size != 4:
        pytest.skip(f"SP 2 x DP 2 -> SP 4 needs 4 ranks; this run has {groups.world_size}")
    seq = create_sequence_groups(groups, 2)
    engine, *_ = zeroshard.initialize(model=TinyLM(seq.sp.dp_group), config=config(2, False, 2, 0.0))
    first = train(engine, groups, 2, 2, range(2))
    engine.save_checkpoint(str(shared_dir), tag="sp2dp2")
    seq = create_sequence_groups(groups, 4)
    resumed, *_ = zeroshard.initialize(model=TinyLM(seq.sp.dp_group, seed=5),
                                       config={**config(2, False, 4, 0.0), "gradient_accumulation_steps": 2 * GAS})
    resumed.load_checkpoint(str(shared_dir), tag="sp2dp2")
    assert (resumed.global_steps, resumed.sequence_parallel_size, resumed.dp_world_size) == (2, 4, 1)
    data = samples(STEPS, 2, 2)
    positions = torch.arange(groups.rank * LOCAL // 2, (groups.rank + 1) * LOCAL // 2)
    for micro in range(GAS):
        for d in range(2):  # the SP 2 x DP 2 run's third step, micro-batch by micro-batch
            ids, labels = micro_batch(data, 2, micro, d, 2)
            resumed.backward(resumed(ids[:, positions], labels[:, positions], offset=positions))
            resumed.step()
    assert resumed.global_steps == 3
    want = oracle(2, 2, 0.0)
    assert_matches(first, full_weights(resumed, 2), (want[0][:2], want[1], None))


def test_the_data_position_survives_a_change_of_sequence_parallel_size(groups: ProcessGroups,
                                                                      shared_dir: Path) -> None:
    """The engine's data loader (training_data=) splits samples over data-parallel ranks only, so the
    ranks of a sequence group read the same samples; a checkpoint saved at SP 2 records the global
    position, and the same job resumed at SP 1 (every rank its own samples) reads on exactly where
    the SP 2 run would have: the next two micro-batches of SP 2 are what the two SP 1 ranks read."""
    dp = _layout(groups, 2)
    if dp != 1:
        pytest.skip("SP 2 -> SP 1 at 2 ranks")
    ids, labels = samples(4, 1, 2)
    data = list(zip(ids, labels))
    seq = create_sequence_groups(groups, 2)
    engine, _, loader, _ = zeroshard.initialize(model=TinyLM(seq.sp.dp_group), training_data=data,
                                                config=config(2, False, 2, 0.0))
    batches = iter(loader)
    cut = slice((groups.rank % 2) * LOCAL, (groups.rank % 2 + 1) * LOCAL)
    for _ in range(2 * GAS):
        x, y = next(batches)
        engine.backward(engine(x[:, cut], y[:, cut], offset=(groups.rank % 2) * LOCAL))
        engine.step()
    engine.save_checkpoint(str(shared_dir), tag="sp2")
    would_read = torch.cat([next(batches)[0] for _ in range(2)])  # the SP 2 run's next two micro-batches
    cfg = {**config(2, False, 1, 0.0), "gradient_accumulation_steps": 1}
    plain, _, plain_loader, _ = zeroshard.initialize(model=TinyLM(), training_data=data, config=cfg)
    plain.load_checkpoint(str(shared_dir), tag="sp2", load_rng_state=True)  # with the data position
    mine = next(iter(plain_loader))[0]
    both = [torch.empty_like(mine) for _ in range(groups.world_size)]
    torch.distributed.all_gather(both, mine)
    assert sorted(map(tuple, torch.cat(both).tolist())) == sorted(map(tuple, would_read.tolist()))


@pytest.mark.parametrize("extra, error, match", [
    ({"sequence_parallel_size": 3}, ConfigError, r"cannot hold sequence-parallel size 3"),
    ({"data_parallel_size": 7}, ConfigError, r"data_parallel_size is 7, but"),
    ({"tensor_parallel": {"autotp_size": 2}}, NotSupportedError,
     r"sequence_parallel_size 2 together with tensor parallelism is not implemented"),
])
def test_layouts_not_built_are_refused_by_name(groups: ProcessGroups, extra: dict, error: type, match: str) -> None:
    if groups.world_size != 4:
        pytest.skip("the layouts refused here are 4-rank layouts")
    cfg = {**config(1, False, 2, 0.0), **extra}
    with pytest.raises(error, match=match):
        zeroshard.initialize(model=TinyLM(), config=cfg)


def test_a_second_engine_without_sequence_parallelism_keeps_the_groups(groups: ProcessGroups) -> None:
    """TRL builds a reference model's engine beside the trained one: an engine without SP leaves the
    process's sequence groups (and DeepSpeed's getters, which Transformers' loss calls) alone."""
    from zeroshard.compat import ds_groups

    _layout(groups, 2)
    seq = create_sequence_groups(groups, 2)
    trained, *_ = zeroshard.initialize(model=TinyLM(seq.sp.dp_group), config=config(1, False, 2, 0.0))
    zeroshard.initialize(model=TinyLM(), config=config(1, False, 1, 0.0))
    assert ds_groups._get_sequence_parallel_world_size() == 2
    assert ds_groups._get_sequence_parallel_group() is seq.sp.dp_group is trained.seq_parallel_group


def test_a_pipeline_with_sequence_parallelism_is_refused_by_name(groups: ProcessGroups) -> None:
    """PP 2 x SP 2 at 4 ranks: not built, refused at initialize before any group is made."""
    if groups.world_size != 4:
        pytest.skip("PP 2 x SP 2 needs 4 ranks")
    from zeroshard.pipe import LayerSpec, PipelineModule

    net = PipelineModule([LayerSpec(nn.Linear, HIDDEN, HIDDEN) for _ in range(2)], num_stages=2,
                         loss_fn=nn.MSELoss())
    with pytest.raises(NotSupportedError, match="sequence_parallel_size 2 together with a PipelineModule"):
        zeroshard.initialize(model=net, config={**config(1, False, 2, 0.0), "gradient_accumulation_steps": 2})


def test_a_model_built_for_sequence_parallelism_needs_the_size(groups: ProcessGroups) -> None:
    """A model whose attention exchanges over a sequence group, trained without sequence_parallel_size
    (every rank would read different samples and average), or with another size, is refused."""
    _layout(groups, 2)
    seq = create_sequence_groups(groups, 2)
    for sp, match in ((1, r"group is none \(sequence_parallel_size 1\); set sequence_parallel_size to 2"),
                      (groups.world_size if groups.world_size > 2 else None, r"sequence_parallel_size 4\); set")):
        if sp is None:
            continue
        with pytest.raises(ConfigError, match=match):
            zeroshard.initialize(model=TinyLM(seq.sp.dp_group), config=config(1, False, sp, 0.0))


@pytest.mark.parametrize("extra, want", [({"communication_data_type": "bf16"}, "fp32"),
                                         ({"seq_parallel_communication_data_type": "bf16"}, "bf16")])
def test_seq_parallel_communication_data_type_replaces_communication_data_type(groups: ProcessGroups,
                                                                            extra: dict, want: str) -> None:
    """DeepSpeed's engine: with sequence parallelism the gradients are reduced in
    `seq_parallel_communication_data_type` (default fp32), whatever `communication_data_type` says."""
    dp = _layout(groups, 2)
    seq = create_sequence_groups(groups, 2)
    cfg = config(2, False, 2, 0.0, comms_logger={"enabled": True, "prof_ops": ["reduce_scatter"]}, **extra)
    engine, *_ = zeroshard.initialize(model=TinyLM(seq.sp.dp_group), config=cfg)
    assert engine.zs_config.communication_data_type == want
    engine._comm.log.reset()
    losses = train(engine, groups, dp, 2, range(1))
    assert all(torch.isfinite(torch.tensor(losses)))
    records = [r for r in engine._comm.log.records if r.op == "reduce_scatter"]
    elements = sum(p.numel() for p in engine.module.parameters())
    itemsize = {"fp32": 4, "bf16": 2}[want]
    # every gradient element crosses once per micro-batch in the communication dtype (padding aside)
    sent = sum(r.bytes for r in records)
    assert GAS * elements * itemsize <= sent < GAS * elements * itemsize * 1.5, (sent, elements, want)
