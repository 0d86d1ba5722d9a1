"""AutoEP: Hugging Face MoE models (transformers 5 expert banks) trained expert-parallel with no
model edits, against the unmodified model in one process.

The models are tiny and built from their configs: Mixtral (softmax top-2), Qwen3-MoE (normalised
top-2), DeepSeek-V3 (sigmoid scores with a correction bias, group-limited routing, routed scaling,
a shared expert, a dense first layer) and GPT-OSS (biased experts, clamped interleaved SwiGLU).
The oracle is the same model in one process fed each rank's micro-batches separately, the loss
the mean over ranks and micro-batches, torch SGD with momentum (a constant gradient factor
shows), clipping by the global norm. A bank parameter with no routed token gets a zero gradient
as every ZeRO flat buffer gives it; the oracle does the same. Each rank's bank holds experts
`e*L .. e*L+L-1` of the oracle's bank (e: its expert-parallel rank). Runs at 1, 2 and 4 ranks (EP
= world size; at 4 also EP 2 x expert-data-parallel 2); 3 ranks do not divide 4 experts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import zeroshard
from zeroshard.comm import Comm, ProcessGroups
from zeroshard.errors import ConfigError
from zeroshard.moe.hf_experts import ExpertParallelBank, expert_banks, is_expert_bank
from zeroshard.moe.utils import is_moe_param

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, MICRO, GAS, STEPS, EXPERTS = 64, 8, 2, 2, 3, 4
LR, MOMENTUM, CLIP = 0.05, 0.9, 1.0
RTOL = 2e-6
"""fp32 round-off of other summation orders (the gradient mean over ranks, each token's expert
outputs summed over k instead of accumulated expert by expert)."""


def tiny(kind: str) -> nn.Module:
    """A tiny model of `kind`, built from its config (nothing downloaded)."""
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=64)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=24, num_key_value_heads=1, num_local_experts=EXPERTS,
                                         num_experts_per_tok=2, **common)
        return transformers.MixtralForCausalLM(cfg)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=8, num_key_value_heads=1,
                                          num_experts=EXPERTS, num_experts_per_tok=2, head_dim=8,
                                          norm_topk_prob=True, **common)
        return transformers.Qwen3MoeForCausalLM(cfg)
    if kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            intermediate_size=24, moe_intermediate_size=8, num_key_value_heads=2, n_routed_experts=EXPERTS,
            n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, **common)
        model = transformers.DeepseekV3ForCausalLM(cfg)
        with torch.no_grad():  # a non-zero correction bias, so that it takes part in the choice
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.linspace(-0.05, 0.05, b.numel()))
        return model
    if kind == "gpt_oss":
        cfg = transformers.GptOssConfig(intermediate_size=8, num_key_value_heads=1, num_local_experts=EXPERTS,
                                        num_experts_per_tok=2, head_dim=8,
                                        layer_types=["full_attention", "full_attention"], **common)
        return transformers.GptOssForCausalLM(cfg)
    raise AssertionError(kind)


KINDS = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]


def reference(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = tiny(kind)
    with torch.no_grad():  # GPT-OSS leaves its expert biases at zero: give them values
        for name, p in model.named_parameters():
            if name.endswith("_bias") and p.dim() == 2:
                p.normal_(0, 0.02)
    return model


def config(stage: int, ep: int, zero_optimization: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300,
                            **(zero_optimization or {})}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=200)
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
            "gradient_clipping": CLIP, "steps_per_print": 1000, "zero_optimization": zero,
            "expert_parallel": {"enabled": True, "autoep_size": ep}, **extra}


def batches(world: int, seed: int = 5) -> list[list[list[Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [[[torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(world)] for _ in range(GAS)]
            for _ in range(STEPS)]


def train_engine(engine: Any, data: list[Any], rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(GAS):
            x = data[step][micro][rank]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / GAS
        losses.append(total)
    return losses


def clip_oracle(model: nn.Module, stage: int, world: int, ep: int) -> None:
    """DeepSpeed's clipping: the global norm, but at fp32 ZeRO 0 the mean over ranks of each rank's
    norm of the dense parameters and its own experts (Note: [expert gradients] in zero/expert_split.py)."""
    if stage > 0 or ep == 1:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        return
    banks = {name for name, m in model.named_modules() if name.endswith("mlp.experts")}
    dense = sum(p.grad.double().pow(2).sum() for n, p in model.named_parameters() if n.rsplit(".", 1)[0] not in banks)
    local = EXPERTS // ep
    norms = []
    for rank in range(world):
        first = (rank % ep) * local
        mine = sum(p.grad[first:first + local].double().pow(2).sum() for n, p in model.named_parameters()
                   if n.rsplit(".", 1)[0] in banks)
        norms.append(float((dense + mine).sqrt()))
    coef = min(1.0, CLIP / (sum(norms) / world + 1e-6))
    for p in model.parameters():
        p.grad.mul_(coef)


def train_oracle(model: nn.Module, data: list[Any], world: int, steps: range, stage: int = 1,
                 ep: int = 1, after_step: Any = None) -> list[list[float]]:
    """Losses per step and rank of the unmodified model on every rank's micro-batches; `after_step()`
    runs after each optimizer step (test_expert_balance.py's bias update)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = []
    for step in steps:
        per_rank = [0.0] * world
        for micro in range(GAS):
            for rank in range(world):
                x = data[step][micro][rank]
                loss = model(input_ids=x, labels=x).loss
                (loss / (world * GAS)).backward()
                per_rank[rank] += loss.item() / GAS
        for p in model.parameters():  # ZeRO's flat buffers give an unrouted expert a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        clip_oracle(model, stage, world, ep)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        out.append(per_rank)
    return out


def local_view(engine: Any, oracle: nn.Module) -> dict[str, Tensor]:
    """The oracle's parameters cut as this rank's engine holds them (banks: its experts' rows)."""
    want = dict(oracle.named_parameters())
    out = {}
    banks = {name: m for name, m in engine.module.named_modules() if isinstance(m, ExpertParallelBank)}
    for name, _ in engine.module.named_parameters():
        owner = name.rsplit(".", 1)[0]
        value = want[name].detach()
        if owner in banks:
            bank = banks[owner]
            value = value[bank.first_expert:bank.first_expert + bank.num_experts]
        out[name] = value
    return out


def check_weights(engine: Any, oracle: nn.Module, what: str) -> None:
    want = local_view(engine, oracle)
    with zeroshard.zero.GatheredParameters(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            got = p.detach()
            err = (got - want[name]).abs().max().item() / max(want[name].abs().max().item(), 1e-3)
            assert err <= RTOL, f"{what} {name}: relative deviation {err:.2e}"


def check_losses(got: list[float], want: list[list[float]], rank: int, what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w[rank]) <= RTOL * abs(w[rank]), f"{what} step {step}: {g} vs {w[rank]}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ep_kind", ["world", "half"])
def test_equals_the_unmodified_model_in_one_process(groups: ProcessGroups, kind: str, stage: int,
                                                     ep_kind: str) -> None:
    world, rank = groups.world_size, groups.rank
    ep = world if ep_kind == "world" else world // 2
    if ep_kind == "half" and world < 4:
        pytest.skip("EP x expert-data-parallel needs 4 ranks (dist4)")
    if world == 1 and stage == 3:
        pytest.skip("one rank: nothing to partition")
    oracle = reference(kind)
    model = copy.deepcopy(oracle)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(stage, ep))
    banks = expert_banks(engine.module)
    if ep > 1:
        assert banks and all(b.num_experts == EXPERTS // ep and b.first_expert == (rank % ep) * (EXPERTS // ep)
                             for b in banks)
        assert all(is_moe_param(p) for b in banks for p in b.parameters())
    data = batches(world)
    got = train_engine(engine, data, rank, range(STEPS))
    want = train_oracle(oracle, data, world, range(STEPS), stage, ep)
    check_losses(got, want, rank, f"{kind} ep {ep} stage {stage}")
    check_weights(engine, oracle, f"{kind} ep {ep} stage {stage}")


@pytest.mark.parametrize("kind", KINDS)
def test_bank_dispatch_with_starved_ranks_equals_the_whole_bank(groups: ProcessGroups, kind: str) -> None:
    """Routes chosen by hand, in fp64: every token to the first rank's experts (the others receive
    no token, their experts get no gradient), then random routes; output and gradients (hidden
    states, routing weights, each rank's expert rows) equal the whole bank's."""
    world = groups.world_size
    torch.manual_seed(1)
    whole = tiny(kind).model.layers[-1].mlp.experts.double()
    whole.config._experts_implementation = "eager"  # torch._grouped_mm takes no fp64
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_(0, 0.3)
    ep_model = nn.ModuleDict({"experts": copy.deepcopy(whole)})
    from zeroshard.config.schema_ep import ExpertParallelConfig
    from zeroshard.moe.ep_groups import create_expert_groups
    from zeroshard.moe.hf_experts import mark_expert_banks, shard_expert_bank

    if world == 1:
        pytest.skip("one rank: the bank is not cut")
    (bank,) = mark_expert_banks(ep_model, ExpertParallelConfig(enabled=True, autoep_size=world))
    comm = Comm(groups)
    shard_expert_bank(bank, create_expert_groups(groups, world, comm).ep_comm, comm)
    g = torch.Generator().manual_seed(2 + groups.rank)
    for starve in (True, False):
        tokens = 5 + groups.rank  # uneven token counts per rank
        hidden = torch.randn(tokens, 16, dtype=torch.float64, generator=g)
        index = (torch.randint(0, EXPERTS // world, (tokens, 2), generator=g) if starve
                 else torch.randint(0, EXPERTS, (tokens, 2), generator=g))
        weights = torch.rand(tokens, 2, dtype=torch.float64, generator=g)
        h1, w1 = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        h2, w2 = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = bank(h1, index, w1)
        ref = whole(h2, index, w2)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        upstream = torch.randn(out.shape, dtype=torch.float64, generator=g)
        (out * upstream).sum().backward()
        (ref * upstream).sum().backward()
        torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-12, atol=1e-12)
        # The whole bank's gradient summed over ranks (each rank's tokens), cut to this rank's rows.
        for p, q in zip(bank.parameters(), whole.parameters()):
            full = q.grad.clone()
            dist.all_reduce(full, group=groups.dp_group)
            mine = full[bank.first_expert:bank.first_expert + bank.num_experts]
            got = p.grad if p.grad is not None else torch.zeros_like(mine)
            assert starve or p.grad is not None
            torch.testing.assert_close(got, mine, rtol=1e-10, atol=1e-12)
            p.grad, q.grad = None, None


@pytest.mark.parametrize("save_ep, save_stage, load_ep, load_stage",
                         [("world", 2, "world", 2), ("world", 2, 1, 1), (1, 1, "world", 2), ("world", 3, 1, 2),
                          ("world", 2, "world", 3), ("half", 3, "world", 2), ("world", 1, "half", 3)])
def test_checkpoint_reshards_banks_across_ep(groups: ProcessGroups, shared_dir: Path, save_ep: Any, save_stage: int,
                                             load_ep: Any, load_stage: int) -> None:
    """Saved at one autoep_size and ZeRO stage after 2 steps, loaded with optimizer state at another:
    the third step equals the uninterrupted one-process run (each bank parameter is one tensor of
    every rank's rows in the checkpoint, checkpoint/expert_layout.py), and to-fp32 gives the
    unmodified model's state dict."""
    from zeroshard.checkpoint.to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    world, rank = groups.world_size, groups.rank
    sizes = {"world": world, "half": world // 2}
    save_ep, load_ep = sizes.get(save_ep, save_ep), sizes.get(load_ep, load_ep)
    if world == 1:
        pytest.skip("one rank: no expert parallelism")
    oracle = reference("mixtral")
    model = copy.deepcopy(oracle)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(save_stage, save_ep))
    data = batches(world)
    train_engine(engine, data, rank, range(2))
    tag = f"ep{save_ep}s{save_stage}-ep{load_ep}s{load_stage}"
    engine.save_checkpoint(shared_dir, tag=tag)
    early = reference("mixtral")
    train_oracle(early, data, world, range(2))
    offline = get_fp32_state_dict_from_zero_checkpoint(shared_dir, tag=tag)
    assert set(offline) == set(early.state_dict())
    for name, value in early.state_dict().items():
        torch.testing.assert_close(offline[name], value, rtol=RTOL, atol=1e-7, msg=f"to-fp32 {name}")
    fresh_model = copy.deepcopy(reference("mixtral"))
    with torch.no_grad():  # other values everywhere: the load must bring them all
        for p in fresh_model.parameters():
            p.mul_(0.5)
    fresh, *_ = zeroshard.initialize(model=fresh_model, model_parameters=fresh_model.parameters(),
                                     config=config(load_stage, load_ep))
    fresh.load_checkpoint(shared_dir, tag=tag)
    assert fresh.global_steps == 2
    got = train_engine(fresh, data, rank, range(2, STEPS))
    want = train_oracle(oracle, data, world, range(STEPS))
    check_losses(got, want[2:], rank, tag)
    check_weights(fresh, oracle, tag)


@pytest.mark.parametrize("stage", [2, 3])
def test_whole_model_export_holds_every_expert(groups: ProcessGroups, stage: int) -> None:
    """The engine's consolidated 16-bit state dict (save_16bit_model, Accelerate at ZeRO-3) and, below
    stage 3, `module.state_dict()` (Trainer.save_model at ZeRO 0-2) hold every bank whole, equal to the
    model after the same training step in one process: a saved model is the model's own."""
    world, rank = groups.world_size, groups.rank
    oracle = reference("deepseek_v3")
    model = copy.deepcopy(oracle)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(stage, world, zero_optimization={
                                          "stage": stage, "stage3_gather_16bit_weights_on_model_save": True}))
    data = batches(world)
    train_engine(engine, data, rank, range(1))
    train_oracle(oracle, data, world, range(1), stage, world)
    want = oracle.state_dict()
    whole = engine._zero3_consolidated_16bit_state_dict()
    plain = engine.module.state_dict() if stage < 3 else None
    if rank == 0:
        assert set(whole) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(whole[name], value, rtol=RTOL, atol=1e-7, msg=name)
    if plain is not None:
        for name, value in want.items():
            torch.testing.assert_close(plain[name], value, rtol=RTOL, atol=1e-7, msg=name)


def test_refusals_name_the_key(groups: ProcessGroups) -> None:
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    with pytest.raises(ConfigError, match="has no transformers-5 expert bank"):
        zeroshard.initialize(model=dense, model_parameters=dense.parameters(), config=config(1, groups.world_size))
    model = reference("mixtral")
    cfg = config(1, groups.world_size)
    cfg["expert_parallel"]["preset_model"] = "qwen3_moe"
    with pytest.raises(ConfigError, match="preset_model='qwen3_moe' describes model type"):
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)


def test_routing_telemetry_counts_every_bank_route(groups: ProcessGroups, shared_dir: Path) -> None:
    """AutoEP banks report their routing like the legacy gate (moe/telemetry.py): the tokens per
    expert the CSV monitor writes per bank and step equal the routes every rank's router chose,
    summed over ranks; nothing is dropped; there is no aux-loss series (the model's router has its
    own)."""
    import csv

    world, rank = groups.world_size, groups.rank
    if world == 1:
        pytest.skip("one rank: the banks are not cut")
    model = reference("mixtral")
    cfg = config(1, world, csv_monitor={"enabled": True, "output_path": str(shared_dir), "job_name": "ep"})
    cfg["steps_per_print"] = 1
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    banks = expert_banks(engine.module)
    seen: list[list[Tensor]] = [[] for _ in banks]
    for i, bank in enumerate(banks):
        bank.register_forward_pre_hook(
            lambda _m, a, i=i: seen[i].append(torch.bincount(a[1].reshape(-1), minlength=EXPERTS).double()))
    data = batches(world)
    train_engine(engine, data, rank, range(2))
    mine = torch.stack([torch.stack([sum(seen[i][s * GAS:(s + 1) * GAS]) for i in range(len(banks))])
                        for s in range(2)])
    dist.all_reduce(mine, group=groups.dp_group)
    if rank != 0:
        return
    with (shared_dir / "ep" / "metrics.csv").open() as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    assert [int(r["step"]) for r in rows] == [1, 2]
    for s, row in enumerate(rows):
        for layer in range(len(banks)):
            tokens = [row[f"moe{layer}_tokens_expert{e}"] for e in range(EXPERTS)]
            assert tokens == mine[s, layer].tolist()
            assert sum(tokens) == 2 * world * GAS * MICRO * SEQ  # top-2: two routes per token
            assert row[f"moe{layer}_dropped"] == 0
            assert f"moe{layer}_aux_loss" not in row


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("ep_kind", ["world", "half"])
def test_estimate_equals_what_the_engine_holds(groups: ProcessGroups, stage: int, precision: str,
                                               ep_kind: str) -> None:
    """estimate/expert_states.py's per-rank model states (dense share over the data-parallel ranks, this
    rank's experts over its expert-data-parallel group) equal `engine.model_state_bytes()` byte for
    byte, category by category, on every rank, after the optimizer's states exist."""
    from zeroshard.config import load_config
    from zeroshard.estimate import Setup
    from zeroshard.estimate.expert_states import estimate_rank_ep, split_experts

    world, rank = groups.world_size, groups.rank
    ep = world if ep_kind == "world" else world // 2
    if ep < 2 or (ep_kind == "half" and world < 4):
        pytest.skip("needs expert parallelism over 2+ ranks (EP x EDP: 4 ranks)")
    model = reference("qwen3_moe")
    split = split_experts(model)  # before initialize: the model as the user builds it
    assert split is not None and split.num_experts == EXPERTS
    cfg = config(stage, ep, zero_optimization={"stage": stage, "reduce_bucket_size": 700})
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randint(0, VOCAB, (MICRO, SEQ))
    for _ in range(GAS):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    homes: dict[str, list[int]] = {}
    for h in engine.model_state_bytes():
        total = homes.setdefault(h.device, [0, 0, 0, 0])
        for i, key in enumerate(("params", "grads", "master_params", "optimizer_states")):
            total[i] += getattr(h, key)
    assert len(homes) == 1, homes  # no offload here: one device home
    est = estimate_rank_ep(split, Setup.from_config(load_config(cfg, dp_world_size=world), devices_per_node=world),
                           ep, rank)
    got = next(iter(homes.values()))
    want = [est.device.params, est.device.grads, est.device.master_params, est.device.optimizer_states]
    assert got == want, (rank, got, want)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_model_built_under_zero_init_equals_the_model_built_whole(groups: ProcessGroups, kind: str) -> None:
    """A model built inside zero.Init (how `from_pretrained` loads after a ZeRO-3 TrainingArguments)
    has every bank cut into flat shards over all ranks; AutoEP gathers each bank tensor, keeps this
    rank's experts (Note: [expert banks under zero.Init] in moe/hf_experts.py) and trains exactly as
    the same model built whole: same losses and the same weights (tolerance 0), ZeRO 3."""
    world, rank = groups.world_size, groups.rank
    if world == 1:
        pytest.skip("one rank: zero.Init cuts nothing")
    cfg = config(3, world)
    whole_model = reference(kind)
    with zeroshard.zero.Init(config_dict_or_path=cfg):
        built = reference(kind)  # the same seed, so the same values, cut as they are built
    assert all(hasattr(p, "ds_id") for b in built.modules() if is_expert_bank(b) for p in b.parameters())
    engines = [zeroshard.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]
               for m in (whole_model, built)]
    banks = expert_banks(engines[1].module)
    assert banks and all(b.num_experts == EXPERTS // world and b.first_expert == rank * (EXPERTS // world)
                         for b in banks)
    data = batches(world)
    losses = [train_engine(e, data, rank, range(STEPS)) for e in engines]
    assert losses[0] == losses[1], losses
    trained = []
    for engine in engines:
        with zeroshard.zero.GatheredParameters(list(engine.module.parameters())):
            trained.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    assert trained[0].keys() == trained[1].keys() and trained[0]
    for name, value in trained[0].items():
        assert torch.equal(value, trained[1][name]), f"{kind} {name}: built under zero.Init differs"
