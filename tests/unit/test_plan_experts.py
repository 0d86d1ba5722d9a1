"""`zeroshard plan --3d` with expert parallelism (estimate/plan3d.py): for a model with expert
banks the search adds EP over the data-parallel ranks (beside every TP and PP size), each EP layout's
memory is estimate_rank_ep's, its step time counts the token all-to-alls and ZeRO over the expert-data-
parallel group, and the report says why the chosen EP beats EP 1 (or why EP 1 wins).
The models are Hugging Face configs built on the meta device: no weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroshard.cli.plan import main as plan_main
from zeroshard.estimate.model_source import load_model_spec
from zeroshard.estimate.parallel import Layout, estimate_layout
from zeroshard.estimate.plan3d import (
    Cluster,
    Training,
    all_to_all_bytes,
    flops_per_step,
    make_3d_plan,
    report_3d,
    step_time,
)
from zeroshard.estimate.states import Setup

pytest.importorskip("transformers")

GiB = 2**30
# Mixtral-8x7B's shape: 46.7B parameters, 45.1B of them in 32 banks of 8 experts, top-2.
MIXTRAL_8X7B = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 4096}
# Small experts (8 x 64 x 512 per layer) and many tokens: dispatching tokens costs more than
# sharing the experts does.
SMALL_EXPERTS = {"model_type": "mixtral", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 512,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
                 "num_experts_per_tok": 2, "max_position_embeddings": 4096}


def _spec(tmp_path: Path, cfg: dict[str, object]):  # type: ignore[no-untyped-def]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return load_model_spec(str(path), "AutoModelForCausalLM")


def test_experts_that_fit_only_cut_over_ep_ranks_choose_ep(tmp_path: Path) -> None:
    spec = _spec(tmp_path, MIXTRAL_8X7B)
    assert spec.experts is not None and spec.experts.top_k == 2 and spec.experts.moe_layers == 32
    cluster = Cluster(nodes=4, devices_per_node=8, device_memory=40 * GiB)
    train = Training(seq_len=4096, global_batch=256, tp_sizes=(1,), pp_sizes=(1,))
    plan = make_3d_plan(spec, train, cluster)
    assert {c.layout.ep for c in plan.candidates} == {1, 2, 4, 8}  # divisors of DP 32 that divide 8 experts
    ep1 = [c for c in plan.candidates if c.layout.ep == 1]
    assert ep1 and not any(c.fits for c in ep1)  # 37 GB at best: every expert of a layer gathered at ZeRO-3
    best = plan.chosen
    assert best is not None and best.layout.ep > 1 and best.memory <= cluster.device_budget
    assert best.time.ep > 0
    text = report_3d(plan)
    assert f"(EP {best.layout.ep} x expert-DP {32 // best.layout.ep})" in text
    assert "- EP 1 (every expert on every rank): nothing fits" in text
    assert f"- EP {best.layout.ep} against EP 1 (same ZeRO-{best.zero_stage}): expert states" in text
    assert "replaced by token all-to-alls" in text and "EP groups: " in text


def test_ep_one_wins_when_token_all_to_alls_cost_more(tmp_path: Path) -> None:
    spec = _spec(tmp_path, SMALL_EXPERTS)
    cluster = Cluster(nodes=2, devices_per_node=4, device_memory=80 * GiB, inter_bandwidth=1 * GiB,
                      intra_bandwidth=1 * GiB, device_flops=1e12)
    train = Training(seq_len=4096, global_batch=64, tp_sizes=(1,), pp_sizes=(1,))
    plan = make_3d_plan(spec, train, cluster)
    best = plan.chosen
    assert best is not None and best.layout.ep == 1
    ep = [c for c in plan.fitting if c.layout.ep > 1]
    assert ep and all(c.time.total > best.time.total for c in ep)
    assert all(c.time.ep > c.time.dp for c in ep[:1])  # the all-to-alls are what EP pays
    text = report_3d(plan)
    assert "- expert parallelism (EP > 1): best is TP 1 x PP 1 x DP 8 (EP " in text
    assert ": EP all-to-alls " in text and "against EP 1" not in text
    # The same model and cluster with the tokens cut 64-fold: EP wins.
    few = make_3d_plan(spec, Training(seq_len=64, global_batch=64, tp_sizes=(1,), pp_sizes=(1,)), cluster)
    assert few.chosen is not None and few.chosen.layout.ep > 1


def test_ep_term_by_hand(tmp_path: Path) -> None:
    spec = _spec(tmp_path, SMALL_EXPERTS)
    split = spec.experts
    assert split is not None
    assert (split.dense.total_params, split.expert_params) == (179_776, 3_145_728)
    # Compute from the active parameters: dense + 2 of 8 experts.
    assert split.active_params == 179_776 + 3_145_728 * 2 // 8 == 966_208
    train = Training(seq_len=256, global_batch=32)
    assert flops_per_step(spec, train, False) == 6 * 966_208 * 32 * 256 + 12 * 4 * 64 * 256 * 32 * 256
    # EP 4 of DP 8 on 2 nodes x 4: EP groups inside a node, expert-DP pairs (r, r + 4) across nodes.
    cluster = Cluster(nodes=2, devices_per_node=4, device_memory=GiB, intra_bandwidth=10 * GiB,
                      inter_bandwidth=1 * GiB, device_flops=1e12)
    layout = Layout.of(dp=8, ep=4, micro_batches=4)
    # 4 passes x 4 MoE layers x 1024 tokens per rank x top-2 x 64 x 2 bytes x 3/4 = 3 MiB.
    assert all_to_all_bytes(spec, train, layout, False) == 3_145_728
    assert all_to_all_bytes(spec, train, layout, True) == 4_718_592  # recompute: 6 passes
    setup = Setup(zero_stage=0, precision="bf16")
    worst = estimate_layout(spec, setup, layout)[0]  # its dense share, experts and MoE layers
    assert (worst.spec.total_params, worst.expert_params, worst.moe_layers) == (179_776, 3_145_728 // 4, 4)
    t = step_time(spec, train, cluster, layout, setup, worst, 1, False)
    assert t.ep == pytest.approx(3_145_728 / (10 * GiB))
    g = setup.grad_bytes
    dense = 2 * 7 / 8 * 179_776 * g  # all-reduce over DP 8, across nodes
    experts = 2 * 1 / 2 * (3_145_728 // 4) * g  # each rank's quarter over its expert-DP pair, across nodes
    assert t.dp == pytest.approx((dense + experts) / GiB)
    assert t.total == pytest.approx(t.compute + t.dp + t.ep)
    # EP 8 crosses the nodes: the all-to-alls go over the inter-node links, no expert ZeRO traffic.
    wide_layout = Layout.of(dp=8, ep=8, micro_batches=4)
    wide = step_time(spec, train, cluster, wide_layout, setup, estimate_layout(spec, setup, wide_layout)[0], 1, False)
    assert wide.ep == pytest.approx(4 * 4 * 1024 * 2 * 64 * 2 * 7 / 8 / GiB)
    assert wide.dp == pytest.approx(dense / GiB)


def test_cli_prints_ep_in_the_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_8X7B))
    code = plan_main(["--model", str(path), "--hf-class", "AutoModelForCausalLM", "--devices", "8", "--nodes", "4",
                      "--device-memory", "40GB", "--cpu-memory", "1TB", "--seq-len", "4096", "--global-batch", "256",
                      "--3d", "--tp", "1", "--pp", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "choice: TP 1 x PP 1 x DP 32 (EP " in out and "46.70B params, 12.88B active" in out
    assert "top-2 of 8 experts" in out and "+ EP " in out
    # --ep restricts the search: EP 1 alone does not fit.
    assert plan_main(["--model", str(path), "--hf-class", "AutoModelForCausalLM", "--devices", "8", "--nodes", "4",
                      "--device-memory", "40GB", "--cpu-memory", "1TB", "--seq-len", "4096", "--global-batch", "256",
                      "--3d", "--tp", "1", "--pp", "1", "--ep", "1"]) == 1


def test_search_offers_ep_beside_tp_and_pp(tmp_path: Path) -> None:
    """Every (TP, PP) gets EP 1 and every divisor of its DP that divides the 8 experts; an EP x TP and an
    EP x PP layout's memory is the estimator's for that layout (its fullest stage)."""
    spec = _spec(tmp_path, SMALL_EXPERTS)
    cluster = Cluster(nodes=2, devices_per_node=4, device_memory=80 * GiB)
    plan = make_3d_plan(spec, Training(seq_len=256, global_batch=16, zero_stages=(1,), checkpointing=False), cluster)
    seen = {(c.layout.tp, c.layout.pp, c.layout.ep) for c in plan.candidates}
    assert {(2, 1, 2), (2, 1, 4), (1, 2, 2), (1, 2, 4), (2, 2, 2), (4, 1, 2), (1, 4, 2)} <= seen
    assert (2, 2, 4) not in seen and (4, 2, 2) not in seen  # DP 2 and DP 1: EP divides DP
    setup = Setup(zero_stage=1, precision="bf16", bucket_numel=int(min(5e8, max(1e6, 64**2))))
    for tp, pp in ((2, 1), (1, 2)):
        c = next(c for c in plan.candidates if (c.layout.tp, c.layout.pp, c.layout.ep) == (tp, pp, 2))
        states = estimate_layout(spec, setup, Layout.of(tp=tp, pp=pp, dp=8 // (tp * pp), ep=2), every_rank=False)
        assert c.worst.rank.device.total == max(states, key=lambda s: s.device_peak).rank.device.total
        assert c.worst.expert_params == spec.experts.expert_params // pp // 2  # its stage's banks, halved by EP
    text = report_3d(plan)
    assert "EP over DP for the experts" in text


def test_ep_groups_are_placed_by_the_real_rank_layout() -> None:
    """rank = (pp * dp + d) * tp + t: an EP group's data-parallel ranks sit TP ranks apart."""
    from zeroshard.estimate.plan3d import ep_spans_nodes, expert_dp_spans_nodes, placement_lines

    # TP 2 x DP 4, EP 2 on nodes of 4: EP groups {0, 2}, {1, 3}, {4, 6}, {5, 7} stay inside a node,
    # expert-DP groups {0, 4}, ... cross (a TP-blind count would put both inside).
    lay = Layout.of(tp=2, dp=4, ep=2)
    assert not ep_spans_nodes(lay, 4) and expert_dp_spans_nodes(lay, 4)
    # TP 4 x DP 2, EP 2 on nodes of 4: the EP groups {t, 4 + t} cross.
    assert ep_spans_nodes(Layout.of(tp=4, dp=2, ep=2), 4)
    assert not ep_spans_nodes(Layout.of(tp=4, dp=2, ep=2), 8)
    # PP 2 x DP 2, EP 2 on nodes of 2: each stage's EP group is one node.
    assert not ep_spans_nodes(Layout.of(pp=2, dp=2, ep=2), 2)
    assert ep_spans_nodes(Layout.of(pp=2, dp=4, ep=4), 2) and not expert_dp_spans_nodes(Layout.of(pp=2, dp=4, ep=4), 2)
    lines = "\n".join(placement_lines(lay, 4))
    assert "EP groups: 2 consecutive data-parallel ranks (2 ranks apart: one TP rank's), inside one node" in lines
    assert "expert-DP groups: 2 ranks one every 2 data-parallel ranks, across nodes" in lines
