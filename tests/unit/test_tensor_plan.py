"""Tensor-parallel plans, the topology arithmetic and the checkpoint range mapping, without a process group."""

from __future__ import annotations

import pytest
import torch

from zeroshard.comm import Comm, ProcessGroups
from zeroshard.comm.topology import Topology
from zeroshard.config import load_config
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.tensor_parallel import ColumnParallelLinear, RowParallelLinear, Style, resolve_plan, shard_model
from zeroshard.tensor_parallel.checkpoint import global_segments
from zeroshard.tensor_parallel.tp_plan import hf_tp_plan, plan_from_hf


def _tp(**section: object):
    return load_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2, **section}},
                       dp_world_size=1).tensor_parallel


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def test_topology_puts_tp_ranks_next_to_each_other() -> None:
    t = Topology.for_world(8, pp=2, tp=2)
    assert t.dp == 2 and t.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.axis_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.coord(5) == {"pp": 1, "dp": 0, "tp": 1} and t.rank_at(pp=1, dp=0, tp=1) == 5
    assert t.axis_ranks("dp", 5) == [5, 7] and t.axis_ranks("tp", 5) == [4, 5]
    with pytest.raises(ValueError, match="must divide the world size"):
        Topology.for_world(6, tp=4)


def test_config_section_and_aliases() -> None:
    tp = _tp(tp={"tp_size": 2}, tp_overlap_comm=True, kernel_inject=False)
    assert tp.size == 2 and tp.enabled and tp.tp_overlap_comm
    assert load_config({"train_batch_size": 2}, dp_world_size=1).tensor_parallel.size == 1
    with pytest.raises(ConfigError, match="disagree"):
        _tp(tp={"tp_size": 4})
    with pytest.raises(NotSupportedError, match='tensor_parallel.preset_model="phi3"'):
        _tp(preset_model="phi3")
    with pytest.raises(ConfigError, match="preset_model"):
        _tp(preset_model="gpt9")
    with pytest.raises(NotSupportedError, match="replace_with_kernel_inject"):
        _tp(kernel_inject=True)
    with pytest.raises(ConfigError, match=r"layer_specs\[0\].partition_type"):
        _tp(partition_config={"layer_specs": [{"patterns": [".*"], "partition_type": "diagonal"}]})
    with pytest.raises(ConfigError, match=r"layer_specs\[0\].patterns"):
        _tp(partition_config={"layer_specs": [{"patterns": ["(unclosed"]}]})
    with pytest.raises(NotSupportedError, match=r"layer_specs\[0\].shape"):
        _tp(partition_config={"layer_specs": [{"patterns": [".*qkv"], "shape": [3, -1]}]})
    with pytest.raises(ConfigError, match="unknown key"):
        _tp(autotp_sise=2)
    with pytest.raises(ConfigError, match=r"layer_specs\[0\].grad_allreduce=true goes with partition_type \"skip\""):
        _tp(partition_config={"layer_specs": [{"patterns": [".*q_norm"], "partition_type": "column",
                                               "grad_allreduce": True}]})


def test_replicated_weights_whose_gradient_is_summed() -> None:
    """HF's replicated_with_grad_allreduce and DeepSpeed's skip spec with grad_allreduce: kept whole,
    with the gradient summed over tp (a hook on the parameter; at tp = 1 the sum is the gradient)."""
    assert plan_from_hf({"layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"}).style_of(
        "model.layers.3.self_attn.q_norm", None) is Style.REPLICATED_GRAD_SUM
    model = _llama()
    plan = resolve_plan(model, _tp(partition_config={"layer_specs": [
        {"patterns": [r".*input_layernorm\.weight$"], "partition_type": "skip", "grad_allreduce": True},
        {"patterns": [r".*o_proj"], "partition_type": "row"}]}))
    assert plan.style_of("model.layers.0.input_layernorm", "llama") is Style.REPLICATED_GRAD_SUM
    state = shard_model(model, plan, Comm(ProcessGroups.single()))
    assert state.grad_summed == {"model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"}
    assert "model.layers.0.input_layernorm.weight" not in state.split
    model(input_ids=torch.randint(0, 64, (2, 8))).logits.sum().backward()
    assert model.model.layers[0].input_layernorm.weight.grad is not None


def test_hf_plan_of_llama_and_its_styles() -> None:
    model = _llama()
    plan = resolve_plan(model, _tp())
    assert plan.source == "the model's HF tp_plan"
    assert plan.style_of("model.layers.1.self_attn.q_proj", "llama") is Style.COLUMN
    assert plan.style_of("model.layers.0.mlp.down_proj", "llama") is Style.ROW
    assert plan.style_of("lm_head", "llama") is Style.COLUMN_GATHER
    assert plan.style_of("model.embed_tokens", "llama") is Style.SKIP
    assert plan.style_of("model.norm", "llama") is None
    assert "layers.*.self_attn.q_proj" in hf_tp_plan(model)
    with pytest.raises(NotSupportedError, match="'sequence_parallel'"):
        plan_from_hf({"norm": "sequence_parallel"})
    whole_head = resolve_plan(model, _tp(vocab_parallel_lm_head=False))
    assert whole_head.style_of("lm_head", "llama") is None


def test_preset_and_partition_config() -> None:
    model = _llama()
    plan = resolve_plan(model, _tp(preset_model="llama"))
    assert plan.style_of("model.layers.0.mlp.up_proj", "llama") is Style.COLUMN
    custom = resolve_plan(model, _tp(preset_model="llama", partition_config={
        "layer_specs": [{"patterns": [r".*\.up_proj\.weight$"], "partition_type": "skip"}]}))
    assert custom.style_of("model.layers.0.mlp.up_proj", "llama") is Style.SKIP  # custom first
    assert custom.style_of("model.layers.0.mlp.gate_proj", "llama") is Style.COLUMN  # merged preset
    alone = resolve_plan(model, _tp(preset_model="llama", partition_config={
        "use_default_specs": False, "layer_specs": [{"patterns": [r".*o_proj"], "partition_type": "row"}]}))
    assert alone.style_of("model.layers.0.mlp.gate_proj", "llama") is None
    typed = resolve_plan(model, _tp(partition_config={"layer_specs": [
        {"patterns": [r".*q_proj"], "partition_type": "column", "model_types": ["mistral"]}]}))
    assert typed.style_of("model.layers.0.self_attn.q_proj", "llama") is None


def test_no_plan_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="has no Hugging Face tp_plan; set tensor_parallel.preset_model"):
        resolve_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), _tp())


def test_shard_model_at_world_one_keeps_the_maths() -> None:
    """tp = 1 (no group): the layers are replaced, the output is the same."""
    model = _llama()
    ids = torch.randint(0, 64, (2, 8))
    want = model(input_ids=ids).logits
    state = shard_model(model, resolve_plan(model, _tp()), Comm(ProcessGroups.single()))
    assert isinstance(model.model.layers[0].self_attn.o_proj, RowParallelLinear)
    assert isinstance(model.lm_head, ColumnParallelLinear)
    assert state.split["model.layers.0.self_attn.o_proj.weight"] == (1, (32, 32))
    torch.testing.assert_close(model(input_ids=ids).logits, want)


def test_strict_mode_and_indivisible_sizes() -> None:
    model = _llama()
    strict = resolve_plan(model, _tp(partition_config={"strict_mode": True, "layer_specs": [
        {"patterns": [r".*q_proj"], "partition_type": "column"}]}))
    with pytest.raises(ConfigError, match="strict_mode: Linear 'model.layers.0.self_attn.k_proj'"):
        shard_model(model, strict, Comm(ProcessGroups.single()))


@pytest.mark.parametrize("dim,shape,rank,offset,numel,want", [
    (0, (4, 3), 1, 0, 6, [(6, 6, 0)]),
    (0, (4, 3), 1, 2, 3, [(8, 3, 0)]),
    (1, (2, 4), 0, 0, 4, [(0, 2, 0), (4, 2, 2)]),
    (1, (2, 4), 1, 1, 2, [(3, 1, 0), (6, 1, 1)]),
    (0, (6,), 2, 0, 2, [(4, 2, 0)]),
])
def test_global_segments(dim: int, shape: tuple[int, ...], rank: int, offset: int, numel: int,
                         want: list[tuple[int, int, int]]) -> None:
    tp = 3 if shape == (6,) else 2
    assert global_segments(dim, shape, tp, rank, offset, numel) == want
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    piece = full.chunk(tp, dim=dim)[rank].reshape(-1)
    for g, n, local in want:  # each segment holds the same elements on both sides
        assert torch.equal(full.reshape(-1)[g : g + n], piece[offset + local : offset + local + n])


def test_sizes_read_before_the_config_and_tp_model_init() -> None:
    import zeroshard
    from zeroshard.comm.parallel_dims import resolve_dims
    from zeroshard.config import tensor_parallel_size
    from zeroshard.tensor_parallel.setup import check_recorded_dtype, recorded_tp_size

    assert tensor_parallel_size({}) == 1 and tensor_parallel_size({"tensor_parallel": {"autotp_size": 0}}) == 1
    assert tensor_parallel_size({"tensor_parallel": {"tp": {"tp_size": 4}}}) == 4
    with pytest.raises(ConfigError, match="expected a non-negative integer"):
        tensor_parallel_size({"tensor_parallel": {"autotp_size": "2"}})
    model = zeroshard.tp_model_init(model=_llama(), tp_size=2, dtype=torch.bfloat16,
                                    config={"tensor_parallel": {"autotp_size": 2}})
    assert resolve_dims(4, config_tp=1, recorded_tp=recorded_tp_size(model)).tp == 2
    assert recorded_tp_size(_llama()) == 1
    with pytest.raises(ConfigError, match=r"tp_model_init\(tp_size=2\) and tensor_parallel.autotp_size \(4\)"):
        resolve_dims(4, config_tp=4, recorded_tp=recorded_tp_size(model))
    check_recorded_dtype(model, torch.bfloat16)
    with pytest.raises(ConfigError, match="does not match the config's precision"):
        check_recorded_dtype(model, torch.float32)
    with pytest.raises(ConfigError, match="disagree"):
        zeroshard.tp_model_init(_llama(), 2, None, config={"tensor_parallel": {"autotp_size": 4}})
    with pytest.raises(NotSupportedError, match="tp_group"):
        zeroshard.tp_model_init(_llama(), 2, None, tp_group=object())
