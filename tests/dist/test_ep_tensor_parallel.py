"""Expert parallelism composed with AutoTP (issue 40 item 6): Hugging Face MoE models whose attention
and dense MLPs AutoTP splits over 2 tensor-parallel ranks while AutoEP divides their experts over the
2 data-parallel ranks of each tensor-parallel rank (TP 2 x DP 2 = EP 2 x TP 2, 4 ranks), against
the unmodified model in one process (test_autoep.py's oracle: each data-parallel rank's
micro-batches, SGD with momentum, clipping by the global norm).

What it shows: the expert groups are made of ranks with the same tensor-parallel rank; AutoTP
leaves the experts whole (Note: [experts under tensor parallelism] in moe/prepare.py); every
tensor-parallel rank trains the same experts; the clipping norm counts each split piece, each
replicated weight and each expert once (zero/expert_split.py); ZeRO 0-3; and a checkpoint saved
at TP 2 x EP 2 loads at TP 2 x EP 2 and continues equal to the uninterrupted run; the 3D estimator's
model states at TP 2 x EP 2 match what each rank holds. Runs at 4 ranks only (skipped elsewhere: the
layout needs 2 x 2).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.comm import ProcessGroups
from zeroshard.errors import NotSupportedError
from zeroshard.moe.hf_experts import ExpertParallelBank, expert_banks

transformers = pytest.importorskip("transformers")

from test_autoep import (  # noqa: E402  after importorskip: test_autoep needs transformers too
    EXPERTS,
    RTOL,
    STEPS,
    batches,
    check_losses,
    config,
    train_engine,
    train_oracle,
)

TP = 2
CLIP = 0.05
"""Below every step's gradient norm here: clipping acts, so the norm (each split piece, replicated
weight and expert counted once) decides the update."""


def tiny_tp(kind: str) -> nn.Module:
    """A tiny MoE model whose heads divide over 2 tensor-parallel ranks, the same on every rank.
    Qwen3-MoE's first layer is dense (decoder_sparse_step 2): AutoTP splits its MLP too."""
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=24, num_local_experts=EXPERTS, num_experts_per_tok=2,
                                         **common)
        return transformers.MixtralForCausalLM(cfg)
    cfg = transformers.Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=8, num_experts=EXPERTS,
                                      num_experts_per_tok=2, head_dim=8, norm_topk_prob=True, decoder_sparse_step=2,
                                      **common)
    return transformers.Qwen3MoeForCausalLM(cfg)


def tp_config(stage: int, **zero: Any) -> dict[str, Any]:
    return {**config(stage, 2, zero_optimization=zero or None), "tensor_parallel": {"autotp_size": TP},
            "gradient_clipping": CLIP}


@pytest.fixture(autouse=True)
def _oracle_clips_as_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """test_autoep's oracle clips by its module's CLIP: the same value as the engine's here."""
    import test_autoep

    monkeypatch.setattr(test_autoep, "CLIP", CLIP)


def check_weights_tp(engine: Any, oracle: nn.Module, what: str) -> None:
    """Every parameter this rank holds equals the oracle's, cut as this rank holds it: a split weight
    along its split dimension at this tensor-parallel rank, a bank at its expert rows, the rest whole."""
    want = dict(oracle.named_parameters())
    split = engine.parallel.tp.split
    tp_rank = engine.parallel.tp_rank
    banks = {name: m for name, m in engine.module.named_modules() if isinstance(m, ExpertParallelBank)}
    with zeroshard.zero.GatheredParameters(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            value = want[name].detach()
            owner = name.rsplit(".", 1)[0]
            if name in split:
                value = value.chunk(TP, dim=split[name][0])[tp_rank]
            elif owner in banks:
                value = value[banks[owner].first_expert:banks[owner].first_expert + banks[owner].num_experts]
            assert p.shape == value.shape, (what, name, p.shape, value.shape)
            err = (p.detach() - value).abs().max().item() / max(value.abs().max().item(), 1e-3)
            assert err <= RTOL, f"{what} {name}: relative deviation {err:.2e}"


def _needs_four(groups: ProcessGroups) -> None:
    if groups.world_size != 4:
        pytest.skip("TP 2 x EP 2 needs 4 ranks (dist4)")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_tp2_ep2_equals_the_unmodified_model_in_one_process(groups: ProcessGroups, kind: str, stage: int) -> None:
    _needs_four(groups)
    oracle = tiny_tp(kind)
    model = copy.deepcopy(oracle)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=tp_config(stage))
    dp_rank, tp_rank = engine.parallel.dp.rank, engine.parallel.tp_rank
    assert engine.dims.tp == TP and engine.dims.dp == 2 and engine.dims.ep == 2
    split = set(engine.parallel.tp.split)
    assert any("self_attn.q_proj" in n for n in split) and not any("experts" in n for n in split), split
    if kind == "qwen3_moe":
        assert "model.layers.0.mlp.gate_proj.weight" in split  # the dense layer's MLP is split
    banks = expert_banks(engine.module)
    assert banks and all(b.num_experts == EXPERTS // 2 and b.first_expert == dp_rank * (EXPERTS // 2) for b in banks)
    data = batches(2)
    got = train_engine(engine, data, dp_rank, range(STEPS))
    want = train_oracle(oracle, data, 2, range(STEPS))
    what = f"{kind} TP {TP} x EP 2 stage {stage} (dp {dp_rank}, tp {tp_rank})"
    check_losses(got, want, dp_rank, what)
    check_weights_tp(engine, oracle, what)
    assert engine.get_global_grad_norm() > CLIP  # the clipping acted on the last step


@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_ep2_resumes_from_its_checkpoint(groups: ProcessGroups, shared_dir: Path, stage: int) -> None:
    """Saved after 2 steps at TP 2 x EP 2, loaded into a fresh engine whose weights differ: the third
    step equals the uninterrupted one-process run."""
    _needs_four(groups)
    oracle = tiny_tp("qwen3_moe")
    model = copy.deepcopy(oracle)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=tp_config(stage))
    dp_rank = engine.parallel.dp.rank
    data = batches(2)
    train_engine(engine, data, dp_rank, range(2))
    tag = f"tp2ep2s{stage}"
    engine.save_checkpoint(shared_dir, tag=tag)
    fresh_model = tiny_tp("qwen3_moe")
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.mul_(0.5)
    fresh, *_ = zeroshard.initialize(model=fresh_model, model_parameters=fresh_model.parameters(),
                                     config=tp_config(stage))
    fresh.load_checkpoint(shared_dir, tag=tag)
    assert fresh.global_steps == 2
    got = train_engine(fresh, data, dp_rank, range(2, STEPS))
    want = train_oracle(oracle, data, 2, range(STEPS))
    check_losses(got, want[2:], dp_rank, tag)
    check_weights_tp(fresh, oracle, tag)


def test_expert_tensor_parallelism_is_refused_by_name(groups: ProcessGroups) -> None:
    """DeepSpeed's enable_expert_tensor_parallelism (experts split by tensor parallelism) is not built:
    refused where the layer is made, naming the argument."""
    from zeroshard.moe.layer import MoE

    with pytest.raises(NotSupportedError, match="enable_expert_tensor_parallelism"):
        MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=1, enable_expert_tensor_parallelism=True)


class _Mpu:
    """DeepSpeed's unit-test MPU shape (tests/unit/v1/moe/test_moe_tp.py): tensor-parallel groups of
    consecutive ranks, data-parallel groups strided; the script's model is not split (replicas)."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        self.rank, self.tp = rank, tp
        for first in range(0, world, tp):
            group = dist.new_group(list(range(first, first + tp)))
            if rank in range(first, first + tp):
                self.tp_group = group
        for first in range(tp):
            group = dist.new_group(list(range(first, world, tp)))
            if rank in range(first, world, tp):
                self.dp_group = group
        self.world = world

    def get_model_parallel_rank(self) -> int:
        return self.rank % self.tp

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.tp

    def get_data_parallel_world_size(self) -> int:
        return self.world // self.tp

    def get_data_parallel_group(self) -> Any:
        return self.dp_group


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_legacy_moe_with_an_mpu_equals_one_process(groups: ProcessGroups, stage: int) -> None:
    """DeepSpeed's `MoE` layer with a Megatron-style mpu (TP 2 x DP 2, EP 2 over the data-parallel
    ranks of each tensor-parallel rank, the layout DeepSpeed 0.19.8 builds for it): the mpu's
    data-parallel groups are strided, so the expert groups are made inside each of them (their
    global ranks reported by DeepSpeed's getters), and training equals test_moe.py's one-process
    oracle (clipping by the global norm, experts counted once over the mpu's model-parallel group)."""
    _needs_four(groups)
    import test_moe

    from zeroshard.compat import ds_groups

    case = test_moe.CASES["top1_drop_clip"]
    mpu = _Mpu(TP)
    dp_rank = mpu.get_data_parallel_rank()
    reference = test_moe.new_reference(case)
    model = test_moe.Net(2, **case["moe"])
    model.load_state_dict(test_moe.local_state(reference, dp_rank, 2))
    param_groups = test_moe.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "all"})
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups, mpu=mpu,
                                      config=test_moe.config(stage, case["clip"]))
    me = groups.rank
    assert ds_groups._get_expert_parallel_group_ranks("ep_size_2") == [me % TP, me % TP + TP]
    assert ds_groups._get_expert_data_parallel_group_ranks("ep_size_2") == [me]
    assert ds_groups._get_expert_model_parallel_world_size() == 1
    data = test_moe.batches(2)
    got = test_moe.train_engine(engine, data, dp_rank, range(test_moe.STEPS))
    want = test_moe.train_oracle(reference, data, 2, case["clip"], 1, 2)  # the global norm (1: not fp32 ZeRO 0's rule)
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w[dp_rank]) <= test_moe.RTOL * abs(w[dp_rank]), (stage, step, g, w[dp_rank])
    test_moe.check_weights(engine, reference, dp_rank, 2, f"mpu TP 2 x EP 2 ZeRO {stage}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_equals_what_tp2_ep2_holds(groups: ProcessGroups, frozen_heap: None, stage: int) -> None:
    """The 3D estimator at TP 2 x DP 2 with EP 2 (estimate/parallel.py: the dense share split as AutoTP
    splits it over DP, half of every bank whole on each TP rank over expert-DP 1) against the engine,
    bf16 with fp32 masters and AdamW: the rank's dense and expert elements equal the estimate's;
    `engine.model_state_bytes()` and the live-tensor census (test_memory_census_3d.py's, less the
    staging pool and the buffers) are within that test's 5% of the estimate."""
    _needs_four(groups)
    import gc
    from dataclasses import replace

    from zeroshard.config import load_config
    from zeroshard.estimate import Setup, spec_from_module
    from zeroshard.estimate.expert_states import split_experts
    from zeroshard.estimate.parallel import Layout, estimate_stage
    from zeroshard.moe.utils import is_moe_param
    from zeroshard.runtime.monitor import allocated_bytes

    gc.collect()
    baseline = allocated_bytes(torch.device("cpu"))
    model = tiny_tp("mixtral")
    spec = replace(spec_from_module(model), experts=split_experts(model))  # as the user builds it
    cfg = {**tp_config(stage), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = batches(2)
    train_engine(engine, data, engine.parallel.dp.rank, range(1))
    del data
    measured = allocated_bytes(torch.device("cpu")) - baseline
    setup = Setup.from_config(load_config(cfg, dp_world_size=2), devices_per_node=2)
    est = estimate_stage(spec, setup, Layout.of(tp=TP, dp=2, ep=2), 0)
    local = [p for p in engine.module.parameters() if p.requires_grad]
    experts = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in local if is_moe_param(p))
    dense = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in local if not is_moe_param(p))
    assert (dense, experts) == (est.spec.total_params, est.expert_params), (groups.rank, dense, experts)
    got = [sum(getattr(h, k) for h in engine.model_state_bytes())
           for k in ("params", "grads", "master_params", "optimizer_states")]
    want = [est.rank.device.params, est.rank.device.grads, est.rank.device.master_params,
            est.rank.device.optimizer_states]
    buffers = sum(b.numel() * b.element_size() for b in engine.module.buffers())
    census = measured - engine.transient_bytes() - buffers
    print(f"\n[estimate TP2xEP2] ZeRO-{stage} rank {groups.rank}: model_state_bytes {got} ({sum(got)}), estimate "
          f"{want} ({sum(want)}), census {census} (ratio {census / sum(want):.4f})")
    for g, w in zip(got, want):
        assert abs(g - w) <= 0.05 * w, (stage, groups.rank, got, want)
    assert abs(census - sum(want)) <= 0.05 * sum(want), (stage, groups.rank, census, sum(want))
    del engine, model
    gc.collect()
