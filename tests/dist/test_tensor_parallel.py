"""AutoTP (tensor_parallel.autotp_size) with ZeRO over the data-parallel ranks, against one plain-torch
process: per-step losses and final whole weights (fp32), at TP = 2 (2 ranks: TP2 x DP1; 4 ranks:
TP2 x DP2) and TP = 3 (3 ranks), ZeRO 0-3, CPU offload, clipping, save/resume, 16-bit export."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from tp_helpers import VOCAB, batches, lm_loss, reference, tiny_llama, tp_config

import zeroshard
from zeroshard.comm import Comm, ProcessGroups
from zeroshard.tensor_parallel import ColumnParallelLinear, RowParallelLinear

STEPS, LR, CLIP = 4, 1e-3, 0.5
# Tolerances: each test's reference(...) measures them (Note: [tolerances from measured round-off]).


def _tp(world: int) -> int:
    return {2: 2, 3: 3, 4: 2}.get(world, 0)


def _model(world: int) -> torch.nn.Module:
    # 6 heads / 3 kv heads split over 3 ranks; 4 / 2 over 2.
    return tiny_llama(heads=6, kv_heads=3, hidden=48) if _tp(world) == 3 else tiny_llama()


@pytest.fixture(autouse=True)
def _needs_tp(groups: ProcessGroups) -> None:
    if not _tp(groups.world_size):
        pytest.skip(f"tensor parallelism needs 2, 3 or 4 ranks (this run has {groups.world_size})")


def _train(engine: Any, data: list[list[torch.Tensor]], dp_rank: int) -> list[float]:
    out = []
    for step in data:
        loss = lm_loss(engine, step[dp_rank])
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _whole(engine: Any) -> dict[str, torch.Tensor]:
    """The whole weights on every rank (the consolidated state_dict is rank 0's)."""
    sd = engine._zero3_consolidated_16bit_state_dict()
    box = [sd]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _check(groups: ProcessGroups, cfg: dict[str, Any], data: list[list[torch.Tensor]],
           build: Any = None, make: Any = _model) -> Any:
    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    ref = reference(lambda: make(groups.world_size), data, lr=LR, clip=CLIP)
    want_losses, want = ref.losses, ref.weights
    model = build() if build is not None else make(groups.world_size)
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    dp_rank = engine.parallel.dp.rank
    assert engine.dp_world_size == dp and engine.parallel.mesh.topology.tp == tp
    got = _train(engine, data, dp_rank)
    for step, (g, w) in enumerate(zip(got, want_losses)):
        assert abs(g - w[dp_rank]) <= ref.loss_tol, (step, g, w[dp_rank], ref.loss_tol)
    whole = _whole(engine)
    assert set(whole) == set(want)
    for name, value in want.items():
        assert whole[name].shape == value.shape, name
        err = (whole[name] - value).abs().max().item()
        assert err <= ref.weight_tol, (name, err, ref.weight_tol)
    return engine


def test_layers_are_split(groups: ProcessGroups) -> None:
    tp = _tp(groups.world_size)
    engine, *_ = zeroshard.initialize(model=_model(groups.world_size),
                                      config=tp_config(tp, 0, groups.world_size // tp))
    layer = engine.module.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, ColumnParallelLinear)
    assert isinstance(layer.self_attn.o_proj, RowParallelLinear)
    assert isinstance(layer.mlp.down_proj, RowParallelLinear)
    assert isinstance(engine.module.lm_head, ColumnParallelLinear) and engine.module.lm_head.gather_output
    assert engine.mp_world_size == tp
    hidden = engine.module.config.hidden_size
    assert layer.mlp.up_proj.weight.shape == (2 * hidden // tp, hidden)
    assert layer.mlp.down_proj.weight.shape == (hidden, 2 * hidden // tp)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_one_process(groups: ProcessGroups, stage: int) -> None:
    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    _check(groups, tp_config(tp, stage, dp, clip=CLIP, lr=LR), batches(STEPS, dp))


def _qwen3(world: int) -> torch.nn.Module:
    """A 2-layer Qwen3 from its config: RMSNorms over each head's queries and keys (q_norm, k_norm),
    which the HF plan marks replicated_with_grad_allreduce."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads, kv = (6, 3) if _tp(world) == 3 else (4, 2)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=16 * heads, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():  # ones at the start: other values, so that a wrong gradient shows in the weights too
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("stage", [1, 3])
def test_qwen3_head_norms_sum_their_gradients_over_tp(groups: ProcessGroups, stage: int) -> None:
    """Qwen3's q_norm / k_norm stay whole on every tensor-parallel rank but see only that rank's heads:
    their gradients are summed over the tensor-parallel group (HF's replicated_with_grad_allreduce, as
    DeepSpeed 0.19.8 does), and training equals one process."""
    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    engine = _check(groups, tp_config(tp, stage, dp, clip=CLIP, lr=LR), batches(STEPS, dp), make=_qwen3)
    summed = engine.parallel.tp.grad_summed
    assert {n for n in summed if n.endswith(("q_norm.weight", "k_norm.weight"))} == summed and len(summed) == 4


def test_zero_init_matches_one_process(groups: ProcessGroups) -> None:
    """A model built under zero.Init(config_dict_or_path=<AutoTP config>) is cut over ZeRO's
    data-parallel ranks (world / tp, decided from the config by resolve_dims, not by groups an
    earlier engine left), gathered back whole for AutoTP's split, then trained at ZeRO 3 equal to one
    process (Note: [zero.Init under AutoTP] in tensor_parallel/setup.py)."""
    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    cfg = tp_config(tp, 3, dp, clip=CLIP, lr=LR)

    def build() -> torch.nn.Module:
        with zeroshard.zero.Init(config_dict_or_path=cfg):
            model = _model(groups.world_size)
        for p in model.parameters():
            assert p._zs.init_shard.numel() == -(-p.numel() // dp), p._zs.name  # cut over dp ranks, not tp x dp
        return model

    _check(groups, cfg, batches(STEPS, dp), build=build)


@pytest.mark.parametrize("stage", [1, 3])
def test_cpu_offload_matches_one_process(groups: ProcessGroups, stage: int) -> None:
    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    _check(groups, tp_config(tp, stage, dp, clip=CLIP, lr=LR, zero_optimization=zero), batches(STEPS, dp))


def test_grad_norm_is_the_whole_models(groups: ProcessGroups) -> None:
    """The reported norm is the norm of the whole model's gradient (split pieces summed, whole
    parameters once), at every stage alike."""
    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    data = batches(1, dp)
    ref = _model(groups.world_size)
    for ids in data[0]:
        (lm_loss(ref, ids) / dp).backward()
    want = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters())).item()
    for stage in (0, 2, 3):
        engine, *_ = zeroshard.initialize(model=_model(groups.world_size), config=tp_config(tp, stage, dp, clip=0.0))
        _train(engine, data, engine.parallel.dp.rank)
        assert abs(engine.get_global_grad_norm() - want) <= 1e-5 * want, (stage, engine.get_global_grad_norm(), want)


def test_fp16_overflow_on_one_rank_skips_everywhere(groups: ProcessGroups) -> None:
    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    cfg = tp_config(tp, 1, dp, fp16={"enabled": True, "initial_scale_power": 8})
    engine, *_ = zeroshard.initialize(model=_model(groups.world_size), config=cfg)
    ids = batches(1, dp)[0][engine.parallel.dp.rank]
    if groups.rank == groups.world_size - 1:  # the last tensor-parallel rank; a replicated weight's gradient
        engine.module.model.norm.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    loss = lm_loss(engine, ids)
    engine.backward(loss)
    engine.step()
    assert engine.skipped_steps == 1 and not engine.was_step_applied()


def test_save_resume_and_16bit_export(groups: ProcessGroups, shared_dir: Path) -> None:
    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    cfg = tp_config(tp, 2, dp, clip=CLIP, lr=LR)
    data = batches(STEPS, dp)
    ref = reference(lambda: _model(groups.world_size), data, lr=LR, clip=CLIP)
    want = ref.weights
    engine, *_ = zeroshard.initialize(model=_model(groups.world_size), config=cfg)
    r = engine.parallel.dp.rank
    _train(engine, data[:2], r)
    engine.save_checkpoint(str(shared_dir))
    resumed, *_ = zeroshard.initialize(model=_model(groups.world_size), config=copy.deepcopy(cfg))
    path, _ = resumed.load_checkpoint(str(shared_dir))
    assert path is not None and resumed.global_steps == 2
    _train(resumed, data[2:], r)
    whole = _whole(resumed)
    for name, value in want.items():
        assert (whole[name] - value).abs().max().item() <= ref.weight_tol, name
    resumed.save_16bit_model(str(shared_dir / "export"))
    if groups.rank == 0:
        saved = torch.load(shared_dir / "export" / "pytorch_model.bin", weights_only=True)
        for name, value in want.items():  # the whole weights, not rank 0's pieces (DeepSpeed's)
            assert saved[name].shape == value.shape and torch.allclose(saved[name], value, atol=ref.weight_tol), name
    Comm(groups).barrier()


def test_mpu_drives_the_groups(groups: ProcessGroups) -> None:
    """A Megatron-style mpu: ZeRO over its data-parallel group, the norm over its model-parallel one."""
    from zeroshard.comm.groups import subgroup
    from zeroshard.comm.topology import Topology
    from zeroshard.config import load_config
    from zeroshard.tensor_parallel import Plan, resolve_plan, shard_model

    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    top = Topology.for_world(groups.world_size, tp=tp)
    mp_g, dp_g = subgroup(groups, top.axis_groups("tp")), subgroup(groups, top.axis_groups("dp"))

    class Mpu:
        def get_model_parallel_rank(self) -> int: return mp_g.rank
        def get_model_parallel_world_size(self) -> int: return mp_g.world_size
        def get_model_parallel_group(self) -> Any: return mp_g.dp_group
        def get_data_parallel_rank(self) -> int: return dp_g.rank
        def get_data_parallel_world_size(self) -> int: return dp_g.world_size
        def get_data_parallel_group(self) -> Any: return dp_g.dp_group

    model = _model(groups.world_size)
    plan: Plan = resolve_plan(model, load_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": tp}},
                                                 dp_world_size=1).tensor_parallel)
    state = shard_model(model, plan, Comm(mp_g))
    for name, p in model.named_parameters():  # Megatron marks the parameters it split
        p.tensor_model_parallel = name in state.split
    data = batches(STEPS, dp)
    ref = reference(lambda: _model(groups.world_size), data, lr=LR, clip=CLIP)
    cfg = tp_config(tp, 2, dp, clip=CLIP, lr=LR)
    del cfg["tensor_parallel"]
    engine, *_ = zeroshard.initialize(model=model, config=cfg, mpu=Mpu())
    assert engine.dp_world_size == dp
    got = _train(engine, data, dp_g.rank)
    for g, w in zip(got, ref.losses):
        assert abs(g - w[dp_g.rank]) <= ref.loss_tol, (g, w[dp_g.rank], ref.loss_tol)


def test_tp_model_init_records_the_size(groups: ProcessGroups) -> None:
    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    # As Transformers' Trainer calls it (integrations/deepspeed.py): keywords, the ds_config as a dict.
    model = zeroshard.tp_model_init(model=_model(groups.world_size), tp_size=tp, dtype=torch.float32,
                                    config=tp_config(tp, 0, dp))
    cfg = tp_config(tp, 0, dp)
    del cfg["tensor_parallel"]
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    assert isinstance(engine.module.model.layers[0].self_attn.q_proj, ColumnParallelLinear)
    assert engine.dp_world_size == dp


GLOBAL_BATCH = 12  # divisible by every data-parallel size below
RESHARD = {2: [(2, 1), (1, 2), (2, 3)], 3: [(3, 2), (1, 1), (3, 0)], 4: [(2, 2), (1, 3), (4, 1)]}
"""World size -> the (tp, ZeRO stage) of each leg; each leg trains 2 steps, saves, the next resumes."""


def _reshard_model(world: int) -> torch.nn.Module:
    return tiny_llama(heads=6, kv_heads=3, hidden=48) if world == 3 else tiny_llama(heads=4, kv_heads=4)


def test_checkpoint_reshards_across_tp_degrees(groups: ProcessGroups, shared_dir: Path) -> None:
    """TP 2 -> 1 -> 2 (2 ranks), 3 -> 1 -> 3 (3 ranks), 2 -> 1 -> 4 (4 ranks), changing the ZeRO stage
    too; the weights equal one process's after all steps, and to-fp32 of the first TP checkpoint
    equals one process's weights at that point."""
    from zeroshard.checkpoint.to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    world = groups.world_size
    legs = RESHARD[world]
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 96, (GLOBAL_BATCH, 8), generator=g) for _ in range(2 * len(legs))]
    first = reference(lambda: _reshard_model(world), [[d] for d in data[:2]], lr=LR, clip=CLIP)
    ref = reference(lambda: _reshard_model(world), [[d] for d in data], lr=LR, clip=CLIP)
    want_first, want = first.weights, ref.weights
    for i, (tp, stage) in enumerate(legs):
        dp = world // tp
        cfg = tp_config(tp, stage, dp, clip=CLIP, lr=LR, train_batch_size=GLOBAL_BATCH,
                        train_micro_batch_size_per_gpu=GLOBAL_BATCH // dp)
        engine, *_ = zeroshard.initialize(model=_reshard_model(world), config=cfg)
        if i:
            path, _ = engine.load_checkpoint(str(shared_dir / f"leg{i - 1}"))
            assert path is not None and engine.global_steps == 2 * i
        r = engine.parallel.dp.rank
        _train(engine, [[d.chunk(dp)[r]] for d in data[2 * i : 2 * i + 2]], 0)
        engine.save_checkpoint(str(shared_dir / f"leg{i}"))
    whole = _whole(engine)
    for name, value in want.items():
        assert (whole[name] - value).abs().max().item() <= ref.weight_tol, name
    if groups.rank == 0:
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(shared_dir / "leg0"))
        for name, value in want_first.items():
            assert fp32[name].shape == value.shape and (fp32[name] - value).abs().max().item() <= first.weight_tol, name
    Comm(groups).barrier()


def _saved_activation_bytes(engine: Any, ids: torch.Tensor) -> int:
    """Bytes autograd keeps for backward in one forward, the parameters' own storage left out."""
    params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(engine, ids)
    engine.backward(loss)
    engine.step()
    return sum(seen.values())


def test_sequence_parallel_matches_one_process_and_saves_activations(groups: ProcessGroups) -> None:
    """tp_model_init(..., sequence_parallel=True): equal to one process; the activations kept for
    backward shrink (norms and residuals hold 1/tp of the sequence)."""
    tp = _tp(groups.world_size)
    dp = groups.world_size // tp
    g = torch.Generator().manual_seed(5)
    data = [[torch.randint(0, 96, (2, 24), generator=g) for _ in range(dp)] for _ in range(STEPS)]
    ref = reference(lambda: _model(groups.world_size), data, lr=LR, clip=CLIP)
    want_losses, want = ref.losses, ref.weights
    cfg = tp_config(tp, 2, dp, clip=CLIP, lr=LR)
    engine, *_ = zeroshard.initialize(model=zeroshard.tp_model_init(_model(groups.world_size), tp, torch.float32,
                                                                    sequence_parallel=True), config=cfg)
    assert engine.parallel.tp.sequence_parallel
    r = engine.parallel.dp.rank
    got = _train(engine, data, r)
    for g_, w in zip(got, want_losses):
        assert abs(g_ - w[r]) <= ref.loss_tol, (g_, w[r], ref.loss_tol)
    whole = _whole(engine)
    for name, value in want.items():
        assert (whole[name] - value).abs().max().item() <= ref.weight_tol, name
    plain, *_ = zeroshard.initialize(model=_model(groups.world_size), config=cfg)
    ids = data[0][r]
    with_sp, without = _saved_activation_bytes(engine, ids), _saved_activation_bytes(plain, ids)
    print(f"\nsequence parallelism at TP {tp}: {with_sp} B kept for backward vs {without} B without "
          f"({with_sp / without:.2f}x)")
    assert with_sp < without


def test_measured_roundoff_bounds_still_see_a_defect(groups: ProcessGroups) -> None:
    """The derived tolerances (Note: [tolerances from measured round-off]) are far below what a real
    defect does: the same run with its gradient clipping forgotten lands outside them."""
    from tp_helpers import reference_run

    data = batches(STEPS, groups.world_size // _tp(groups.world_size))
    ref = reference(lambda: _model(groups.world_size), data, lr=LR, clip=CLIP)
    unclipped_losses, unclipped = reference_run(_model(groups.world_size), data, lr=LR, clip=0.0)
    assert max((unclipped[k] - v).abs().max().item() for k, v in ref.weights.items()) > 10 * ref.weight_tol
    assert max(abs(a - b) for x, y in zip(unclipped_losses, ref.losses) for a, b in zip(x, y)) > ref.loss_tol


def test_gather_replaced_layer_params_gives_whole_weights(groups: ProcessGroups) -> None:
    """OpenRLHF (TP > 1) reads whole weights inside DeepSpeed's `GatherReplacedLayerParams`:
    inside, each split parameter is the unsplit model's; after, the shards are back, and an edit
    made inside on every rank lands in each rank's slice."""
    from zeroshard.tensor_parallel.gathered import GatheredSplitParameters

    tp = _tp(groups.world_size)
    whole_model = _model(groups.world_size)
    engine, *_ = zeroshard.initialize(model=copy.deepcopy(whole_model),
                                      config=tp_config(tp, 1, groups.world_size // tp))
    attn, mlp = engine.module.model.layers[0].self_attn, engine.module.model.layers[0].mlp
    want = whole_model.model.layers[0]
    params = [attn.q_proj.weight, attn.o_proj.weight, mlp.down_proj.weight, engine.module.model.norm.weight]
    shards = [p.detach().clone() for p in params]
    with GatheredSplitParameters(params, engine.module):
        assert torch.equal(attn.q_proj.weight, want.self_attn.q_proj.weight)
        assert torch.equal(attn.o_proj.weight, want.self_attn.o_proj.weight)
        assert torch.equal(mlp.down_proj.weight, want.mlp.down_proj.weight)
        assert torch.equal(engine.module.model.norm.weight, shards[3])  # not split: left alone
        mlp.down_proj.weight.data[:, -1] = 7.0  # the last column lives on the last TP rank
    for p, before in zip(params, shards):
        assert p.shape == before.shape
    tp_rank = mlp.down_proj.comm.rank
    edited = mlp.down_proj.weight[:, -1]
    assert torch.equal(edited, torch.full_like(edited, 7.0)) == (tp_rank == tp - 1)
    with GatheredSplitParameters(params, engine.module, enabled=False):
        assert attn.q_proj.weight.shape == shards[0].shape
