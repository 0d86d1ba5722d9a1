"""The estimator's expert split (estimate/expert_states.py) and `zeroshard estimate --ep`: which
parameters are experts, one rank's share of them, and the CLI's table against the function; beside
TP and PP, counted by hand. The per-rank bytes against the engine itself: tests/dist/test_autoep.py
and tests/dist/test_ep_tensor_parallel.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from zeroshard.cli.estimate import build_parser, run
from zeroshard.errors import ZeroshardError
from zeroshard.estimate import Setup, spec_from_module
from zeroshard.estimate.expert_states import estimate_rank_ep, split_experts
from zeroshard.estimate.model_source import load_model_spec

transformers = pytest.importorskip("transformers")

CONFIG = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 24,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 4,
          "num_experts_per_tok": 2, "max_position_embeddings": 64}


def tiny() -> torch.nn.Module:
    cfg = dict(CONFIG)
    cfg.pop("model_type")
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**cfg))


def test_split_counts_every_parameter_once_and_cuts_the_banks() -> None:
    model = tiny()
    split = split_experts(model)
    assert split is not None and split.num_experts == 4
    banks = [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]
    assert split.banks == tuple(tuple(p.numel() for p in b.parameters()) for b in banks)
    assert split.dense.total_params + split.expert_params == spec_from_module(model).total_params
    share = split.share(2)
    assert share.total_params * 2 == split.expert_params and share.unit_params[0] == ()
    with pytest.raises(ZeroshardError, match="must divide the 4 experts"):
        split.share(3)
    assert split_experts(torch.nn.Linear(4, 4)) is None


def test_experts_shard_over_the_expert_data_parallel_ranks() -> None:
    """At ZeRO 1 a rank holds its 1 / ep of the experts whole, and their optimizer states over the
    dp / ep ranks holding them: parameters shrink with ep, optimizer states do not (up to padding)."""
    split = split_experts(tiny())
    setup = Setup(zero_stage=1, precision="fp32", devices_per_node=4, optimizer_state_bytes=8)
    one, two, four = (estimate_rank_ep(split, setup, ep) for ep in (1, 2, 4))
    assert one.device.params > two.device.params > four.device.params
    pad = 4 * 16 * 8  # fp32 bytes of 16-element alignment over a few buckets
    assert abs((one.device.params - two.device.params) - 4 * split.expert_params // 2) <= pad
    assert abs((two.device.params - four.device.params) - 4 * split.expert_params // 4) <= pad
    assert abs(one.device.optimizer_states - four.device.optimizer_states) <= 2 * pad
    with pytest.raises(ZeroshardError, match="must divide the data-parallel size"):
        estimate_rank_ep(split, setup, 3)


def test_cli_table_is_the_function(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = build_parser().parse_args(["--model", str(tmp_path), "--hf-class", "AutoModelForCausalLM",
                                      "--devices", "4", "--ep", "2", "--precision", "bf16"])
    text = run(args)
    split = load_model_spec(str(tmp_path), "AutoModelForCausalLM").experts
    assert split is not None
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    for zero, row in zip(range(4), rows):
        est = estimate_rank_ep(split, Setup(zero_stage=zero, precision="bf16", devices_per_node=4), 2)
        assert float(row[-1]) == pytest.approx(round(est.device_peak / 2**30, 2), abs=0.006)
        assert int(row[1].replace(",", "")) == split.expert_params // 2
    with pytest.raises(ZeroshardError, match="must divide"):
        run(build_parser().parse_args(["--model", str(tmp_path), "--devices", "4", "--ep", "3"]))


# Heads that divide over 2 TP ranks (tests/dist/test_ep_tensor_parallel.py's Mixtral): per layer q 16 x 16,
# k and v 8 x 16, o 16 x 16, router 4 x 16, two norms of 16; a bank of 4 experts 4 x 48 x 16 + 4 x 16 x 24.
TP_CONFIG = {**CONFIG, "num_attention_heads": 4, "num_key_value_heads": 2}
EMBED = HEAD = 64 * 16
ATTN = 256 + 128 + 128 + 256  # split over TP
ROUTER, NORMS, BANK = 4 * 16, 2 * 16, 4 * 48 * 16 + 4 * 16 * 24


def _tp_spec():  # type: ignore[no-untyped-def]
    cfg = dict(TP_CONFIG)
    cfg.pop("model_type")
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**cfg))
    return replace(spec_from_module(model), experts=split_experts(model))


def test_tp2_ep2_by_hand() -> None:
    """TP 2 x DP 2 with EP 2: the attention and the (untied) head are split over TP, the embedding, norms,
    router and experts are not; a rank holds half of each bank (EP 2), whole on both TP ranks."""
    from zeroshard.estimate.parallel import Layout, estimate_layout

    spec = _tp_spec()
    split = spec.experts
    assert split.routers == {ROUTER} and split.bank_blocks == (0, 1) and split.expert_params == 2 * BANK
    dense = EMBED + 2 * (ATTN // 2 + ROUTER + NORMS) + 16 + HEAD // 2
    assert dense == 2512
    experts = 2 * BANK // 2
    fp32 = Setup(zero_stage=0, precision="fp32")  # 4 + 4 + 8 bytes a parameter, nothing partitioned
    (est,) = estimate_layout(spec, fp32, Layout.of(tp=2, dp=2, ep=2))
    assert (est.spec.total_params, est.expert_params, est.moe_layers) == (dense, experts, 2)
    assert (est.rank.device.params, est.rank.device.grads, est.rank.device.optimizer_states) == (
        4 * (dense + experts), 4 * (dense + experts), 8 * (dense + experts))
    # ZeRO 1: optimizer states of the dense share over DP 2 (one flat buffer padded to 2 x 16 elements),
    # of the experts over expert-DP 1 (padded to 16): the experts' do not shrink.
    (z1,) = estimate_layout(spec, replace(fp32, zero_stage=1), Layout.of(tp=2, dp=2, ep=2))
    assert z1.rank.device.optimizer_states == 8 * (-(-dense // 32) * 32 // 2 + experts)
    # EP 4 over DP 4 (TP 2, 8 ranks): the rank's experts halve again; TP 1: the dense share grows back.
    (ep4,) = estimate_layout(spec, fp32, Layout.of(tp=2, dp=4, ep=4))
    assert ep4.rank.device.params == 4 * (dense + experts // 2)
    (tp1,) = estimate_layout(spec, fp32, Layout.of(tp=1, dp=2, ep=2))
    assert tp1.rank.device.params == 4 * (EMBED + 2 * (ATTN + ROUTER + NORMS) + 16 + HEAD + experts)
    # EP 1 at TP 2 (one strategy): the banks stay whole on every TP rank, never split by the TP rule.
    (ep1,) = estimate_layout(spec, fp32, Layout.of(tp=2, dp=2))
    assert ep1.spec.total_params == dense + 2 * BANK and ep1.expert_params == 0


def test_pp2_ep2_by_hand() -> None:
    """PP 2 x DP 2 with EP 2: each stage holds its block's bank, half of it per rank; stage 0 the
    embedding, stage 1 the final norm and head."""
    from zeroshard.estimate.parallel import Layout, estimate_layout

    spec = _tp_spec()
    block = ATTN + ROUTER + NORMS
    fp32 = Setup(zero_stage=0, precision="fp32")
    first, last = estimate_layout(spec, fp32, Layout.of(pp=2, dp=2, ep=2))
    assert (first.spec.total_params, first.expert_params, first.moe_layers) == (EMBED + block, BANK // 2, 1)
    assert (last.spec.total_params, last.expert_params, last.moe_layers) == (block + 16 + HEAD, BANK // 2, 1)
    assert first.rank.device.params == 4 * (EMBED + block + BANK // 2)
    assert last.rank.device.optimizer_states == 8 * (block + 16 + HEAD + BANK // 2)
    # The pipeline keeps a whole local gradient aside (dense and experts) during the batch.
    assert last.pipeline_buffers == 4 * (block + 16 + HEAD + BANK // 2)
    # ZeRO 2: gradients of the dense share over DP 2, of the experts over expert-DP 1.
    _, z2 = estimate_layout(spec, replace(fp32, zero_stage=2), Layout.of(pp=2, dp=2, ep=2))
    assert z2.rank.device.grads == 4 * (-(-(block + 16 + HEAD) // 32) * 32 // 2 + BANK // 2)
    # PP 2 x TP 2 x EP 2 (8 ranks; the engine is not tested there): both rules at once.
    _, both = estimate_layout(spec, fp32, Layout.of(pp=2, tp=2, dp=2, ep=2))
    assert (both.spec.total_params, both.expert_params) == (ATTN // 2 + ROUTER + NORMS + 16 + HEAD // 2, BANK // 2)


def test_a_stage_without_banks_holds_dense_states_only() -> None:
    from zeroshard.estimate.expert_states import ExpertSplit
    from zeroshard.estimate.parallel import Layout, estimate_layout

    base = _tp_spec()
    split = base.experts
    late = ExpertSplit(dense=split.dense, banks=split.banks[1:], num_experts=4, top_k=2, bank_blocks=(1,),
                       routers=split.routers)
    spec = replace(base, experts=late)
    fp32 = Setup(zero_stage=0, precision="fp32")
    first, last = estimate_layout(spec, fp32, Layout.of(pp=2, dp=2, ep=2))
    assert (first.expert_params, first.moe_layers, last.moe_layers) == (0, 0, 1)
    assert first.rank.device.params == 4 * first.spec.total_params


def test_cli_ep_beside_tp_is_the_function(tmp_path: Path) -> None:
    """`zeroshard estimate --ep 2 --tp 2`: the per-stage table's parameters per rank are the dense share
    plus the rank's experts; an EP that does not divide the data-parallel size is refused."""
    (tmp_path / "config.json").write_text(json.dumps(TP_CONFIG))
    base = ["--model", str(tmp_path), "--hf-class", "AutoModelForCausalLM", "--devices", "4", "--precision", "bf16"]
    text = run(build_parser().parse_args([*base, "--ep", "2", "--tp", "2"]))
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4 and all(int(r[3].replace(",", "")) == 2512 + BANK for r in rows)
    assert "whole on every TP rank" in text
    with pytest.raises(ZeroshardError, match="must divide the data-parallel size"):
        run(build_parser().parse_args([*base, "--ep", "4", "--tp", "2"]))
