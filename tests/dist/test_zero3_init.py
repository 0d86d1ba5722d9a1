"""zero.Init: models built already partitioned train exactly like models built whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import (
    assert_params_close,
    gathered_snapshot,
    global_batches,
    init_engine,
    make_config,
    make_model,
    train_engine,
)
from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.zero.init import Init
from zeroshard.zero.units import PartitionedParameterError, ZeroParameter

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 100}


def _assert_trains_alike(groups, got_model: nn.Module, want_model: nn.Module, steps: int) -> None:
    """ZeRO-3 training of `got_model` is bitwise that of `want_model`, step by step."""
    batches = global_batches(steps, 2 * groups.world_size)
    _, want = train_engine(init_engine(want_model, make_config(zero_optimization=STAGE3)), batches,
                           groups.rank, groups.world_size)
    _, got = train_engine(init_engine(got_model, make_config(zero_optimization=STAGE3)), batches,
                          groups.rank, groups.world_size)
    for step in range(len(batches)):
        assert_params_close(got[step], want[step], 0.0, f"step {step}")


def test_gpt_built_under_init_trains_like_the_whole_model(groups) -> None:
    whole = make_model(seed=0)
    with Init():
        cut = make_model(seed=0)
    w = cut.blocks[0].mlp[0].weight
    assert isinstance(w, ZeroParameter) and w.shape == (64, 16)
    assert w._zs.init_shard.numel() == -(-w.numel() // groups.world_size), "each rank holds 1/N"
    assert w.detach().shape == (0,), "outside the block a read gives DeepSpeed's empty placeholder"
    with pytest.raises(PartitionedParameterError, match="GatheredParameters"):
        F.linear(torch.ones(2, 16), w)
    lora = nn.Module()  # DeepSpeed-Chat wraps a zero.Init weight in a LoRA module and moves it
    lora.weight = w
    assert lora.to(w.device).to(w.dtype).weight is w
    with pytest.raises(PartitionedParameterError, match="normal_ writes into a placeholder.*modifier_rank=0"):
        w.data.normal_()
    _assert_trains_alike(groups, cut, whole, 5)


def test_init_needs_stage3(groups) -> None:
    with Init():
        cut = make_model()
    with pytest.raises(ConfigError, match=r"zero\.Init.*stage 3.*stage 2"):
        init_engine(cut, make_config(zero_optimization={"stage": 2}))


def test_transformers_model_from_config_under_init(groups) -> None:
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    whole = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    with Init(dtype=torch.bfloat16):
        cut = transformers.LlamaForCausalLM(cfg)
    assert cut.lm_head.weight is cut.model.embed_tokens.weight, "tied weights survive"
    engine = init_engine(cut, make_config(bf16={"enabled": True}, zero_optimization=STAGE3))
    got = gathered_snapshot(engine.module)
    want = [p.detach().to(torch.bfloat16).float() for p in whole.parameters()]
    assert_params_close(got, want, 0.0, "weights after zero.Init")
    ids = torch.randint(0, 128, (2, 8))
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    assert engine.global_steps == 1 and torch.isfinite(out.loss)


def test_gathered_parameters_before_initialize(groups) -> None:
    """GatheredParameters on a model built under zero.Init, before initialize() (transformers
    does this for weight init, from_pretrained and resize_token_embeddings): a read-only gather
    gives every rank the whole values; with modifier_rank the modifying rank's values are
    broadcast and re-cut, and initialize() then trains from them."""
    from zeroshard.zero.init import GatheredParameters

    with Init():
        model = make_model(seed=1)
    want = make_model(seed=1)
    w = model.blocks[0].mlp[0].weight
    with pytest.raises(PartitionedParameterError, match="setting .data.*modifier_rank=0"):
        w.data = torch.zeros(64, 16)  # outside a gather: lost at the next one
    with GatheredParameters([w, w]):  # a parameter named twice is gathered once
        assert torch.equal(w.detach(), want.blocks[0].mlp[0].weight.detach())
    assert not w._zs.gathered
    with GatheredParameters(list(model.blocks[0].parameters()), modifier_rank=0):
        if groups.rank == 0:
            with torch.no_grad():
                w.fill_(0.25)
        else:
            with torch.no_grad():
                w.fill_(-1.0)  # not the modifier: discarded
    engine = init_engine(model, make_config(zero_optimization={"stage": 3}))
    with GatheredParameters([w]):
        assert torch.all(w.detach() == 0.25)
    train_engine(engine, global_batches(1, 2 * groups.world_size), groups.rank, groups.world_size)


def test_a_parent_initialising_its_children_builds_rank_0s_model(groups) -> None:
    """A parent's `apply(init)` in its __init__ (nanoGPT's `self.apply(self._init_weights)`, DeepSpeed's
    TestZero3InitForParentWeightInitialization) reaches children already cut; whatever each rank
    draws or writes there, every rank ends with rank 0's values, as without zero.Init (where
    initialize() broadcasts rank 0's model)."""
    from zeroshard.zero.init import GatheredParameters

    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(12, 3), torch.nn.Linear(3, 5)
            torch.manual_seed(100 + groups.rank)  # a different RNG state on every rank
            self.apply(self._init)

        def _init(self, m: torch.nn.Module) -> None:
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight)
                with torch.no_grad():
                    m.bias.fill_(1.0 + groups.rank)

    with Init():
        model = Parent()
    params = list(model.parameters())
    with GatheredParameters(params):
        mine = [p.detach().clone() for p in params]
    torch.manual_seed(100)  # rank 0's draws, in apply's order (a, then b)
    want_a, want_b = torch.empty(3, 12).normal_(), torch.empty(5, 3).normal_()
    assert torch.equal(mine[0], want_a) and torch.equal(mine[2], want_b), "the weights rank 0 drew"
    assert torch.all(mine[1] == 1.0) and torch.all(mine[3] == 1.0), "the biases rank 0 wrote"


def test_nested_blocks_build_one_model(groups) -> None:
    """A model whose __init__ builds a sub-model under its own zero.Init (transformers'
    VisionEncoderDecoderModel and multimodal models, through from_config) and then initialises
    it: the inner block cuts what it built, the outer __init__ can still touch those parameters,
    and the model trains like the same model built whole."""
    from zeroshard.zero.init import GatheredParameters

    class Outer(torch.nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            with Init():
                self.sub = make_model(seed=seed)
                head = torch.nn.Linear(16, 4)  # a sub-model with parameters of its own (its top level)
            assert isinstance(head.weight, ZeroParameter), "cut when the inner block ends"
            self.head = head
            with torch.no_grad():  # the outer __init__ initialises parameters the inner block cut
                self.sub.blocks[0].mlp[0].weight.mul_(0.5)
                self.head.weight.fill_(0.25)

        def forward(self, *args):
            return self.sub(*args)

    whole = Outer.__new__(Outer)
    torch.nn.Module.__init__(whole)
    whole.sub = make_model(seed=3)
    whole.head = torch.nn.Linear(16, 4)
    with torch.no_grad():
        whole.sub.blocks[0].mlp[0].weight.mul_(0.5)
        whole.head.weight.fill_(0.25)
    with Init():
        cut = Outer(seed=3)
    params = list(cut.parameters())
    with GatheredParameters(params):
        for got, want in zip(params, whole.parameters()):
            assert torch.equal(got.detach(), want.detach()), got._zs.name
    # transformers' tie_weights after loading: assigning a cut parameter to a module outside any
    # gather reads only its metadata (torch checks grad_fn), which needs no data.
    cut.head.weight = cut.head.weight
    assert cut.head.weight.grad_fn is None


class _SoloMpu:
    """A Megatron-style mpu whose data-parallel group is this rank alone (model parallel over the world)."""

    def get_data_parallel_group(self) -> None:
        return None  # one rank: no torch group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1


def test_init_cuts_over_the_groups_its_arguments_name(groups) -> None:
    """zero.Init's ranks come from its own arguments (an mpu's data-parallel group, the config's
    parallel sizes), never from groups an earlier engine built: an mpu whose data-parallel group is one
    rank leaves every parameter whole on its rank, a config with data parallelism only cuts over the world."""
    with Init(mpu=_SoloMpu()):
        solo = make_model(seed=0)
    with Init(config_dict_or_path=make_config(zero_optimization=STAGE3)):
        world = make_model(seed=0)
    for a, b in zip(solo.parameters(), world.parameters()):
        assert a._zs.init_shard.numel() == a.numel(), a._zs.name
        assert b._zs.init_shard.numel() == -(-b.numel() // groups.world_size), b._zs.name
    with pytest.raises(ConfigError, match="mpu= or data_parallel_group=, not both"), Init(
            mpu=_SoloMpu(), data_parallel_group=object()):
        pass


def test_init_module_cuts_an_already_built_model(groups) -> None:
    """DeepSpeed's `zero.Init(module=model)`: a model built whole (each rank from its own seed here) is
    cut on the spot to rank 0's values, and trains exactly as the model built inside the block."""
    built = make_model(seed=groups.rank)  # the ranks disagree; rank 0's values must win
    Init(module=built, config_dict_or_path=make_config(zero_optimization=STAGE3))
    w = built.blocks[0].mlp[0].weight
    assert isinstance(w, ZeroParameter) and w._zs.init_shard.numel() == -(-w.numel() // groups.world_size)
    with Init():
        inside = make_model(seed=0)
    _assert_trains_alike(groups, built, inside, 3)
    with pytest.raises(TypeError, match="expected an nn.Module"):
        Init(module="model")
