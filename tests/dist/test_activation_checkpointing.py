"""Activation checkpointing at every stage: gradients bitwise equal to the run without it.

Dropout is on (SDPA's attention dropout, plus a dropout drawn from the RNG tracker's named
state inside each region), so a recompute that drew other masks would change the gradients.
The fp32 gradient each rank's optimizer sees is captured just before `optimizer.step()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import TINY, global_batches, init_engine, make_config, rank_micro_batches
from torch import Tensor, nn

import zeroshard.checkpointing as ckpt
from zeroshard.activation_checkpointing import _unconfigure
from zeroshard.examples.gpt import GPT, GPTConfig
from zeroshard.zero.init import Init

Region = Callable[..., Tensor]

MODES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "reentrant": ckpt.checkpoint,
    "non_reentrant": ckpt.non_reentrant_checkpoint,
    "torch_reentrant": lambda f, *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=True),
}


class CheckpointedGPT(GPT):
    """The example GPT whose blocks run through `wrap(region, x)` (None: called directly)."""

    def __init__(self, cfg: GPTConfig, wrap: Callable[..., Any] | None) -> None:
        super().__init__(cfg)
        self.wrap = wrap

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = self.wrap(_region, block, x) if self.wrap is not None else _region(block, x)
        logits = self.lm_head(self.ln_f(x))
        assert targets is not None
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def _region(block: nn.Module, x: Tensor) -> Tensor:
    with ckpt.get_cuda_rng_tracker().fork():  # Megatron-style model-parallel dropout
        x = F.dropout(x, 0.2, training=block.training)
    return block(x)


def _gpt(wrap: Callable[..., Any] | None) -> CheckpointedGPT:
    torch.manual_seed(0)
    return CheckpointedGPT(GPTConfig(**{**TINY.__dict__, "dropout": 0.2, "n_layer": 3}), wrap)


def _grads_per_step(engine: Any, batches: list[tuple[Tensor, Tensor]], rank: int, world: int,
                    call: Callable[[Any, Tensor, Tensor], Tensor]) -> list[list[Tensor]]:
    """The fp32 gradients the optimizer steps on, per step (this rank's shard)."""
    seen: list[list[Tensor]] = []
    step = engine.optimizer.step

    def capture(*a: Any, **k: Any) -> Any:
        seen.append([p.grad.detach().clone() for g in engine.optimizer.param_groups for p in g["params"]
                     if p.grad is not None])
        return step(*a, **k)

    engine.optimizer.step = capture
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    torch.manual_seed(1000 + rank)
    ckpt.model_parallel_cuda_manual_seed(7)
    for batch in batches:
        for x, y in rank_micro_batches(batch, rank, world, micro, gas):
            engine.backward(call(engine, x, y))
            engine.step()
    return seen


def _assert_bitwise(got: list[list[Tensor]], want: list[list[Tensor]], what: str) -> None:
    assert len(got) == len(want) > 0, f"{what}: {len(got)} vs {len(want)} steps"
    for s, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w), f"{what} step {s}: {len(g)} vs {len(w)} gradients"
        for i, (a, b) in enumerate(zip(g, w)):
            assert torch.equal(a, b), f"{what} step {s} grad {i}: max diff {(a - b).abs().max():.3e}"


STAGES = {
    0: {"stage": 0},
    1: {"stage": 1, "reduce_bucket_size": 500},
    2: {"stage": 2, "reduce_bucket_size": 500},
    3: {"stage": 3, "stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 3000},
    # Stage 3 with nothing kept gathered between uses: the recompute must re-gather.
    "3-release": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                  "stage3_prefetch_bucket_size": 0},
}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_gpt_gradients_bitwise_equal_with_checkpointing(groups, stage: Any, mode: str) -> None:
    batches = global_batches(2, 2 * groups.world_size * 2)
    config = make_config(zero_optimization=STAGES[stage], gradient_accumulation_steps=2)

    def run(wrap: Callable[..., Any] | None) -> list[list[Tensor]]:
        engine = init_engine(_gpt(wrap), config)
        return _grads_per_step(engine, batches, groups.rank, groups.world_size, lambda e, x, y: e(x, y))

    want = run(None)
    got = run(MODES[mode])
    _assert_bitwise(got, want, f"stage {stage}, {mode}")


def test_the_oracle_sees_a_recompute_with_other_masks(groups) -> None:
    """torch.utils.checkpoint alone does not replay the tracker's state: the masks differ."""
    batches = global_batches(1, 2 * groups.world_size)
    config = make_config()
    want = _grads_per_step(init_engine(_gpt(None), config), batches, groups.rank, groups.world_size,
                           lambda e, x, y: e(x, y))
    got = _grads_per_step(init_engine(_gpt(MODES["torch_reentrant"]), config), batches, groups.rank,
                          groups.world_size, lambda e, x, y: e(x, y))
    with pytest.raises(AssertionError, match="max diff"):
        _assert_bitwise(got, want, "torch.utils.checkpoint")


def test_stage3_recompute_keeps_prefetch_order_and_memory_bounded(groups) -> None:
    config = make_config(zero_optimization=STAGES[3])
    batches = global_batches(3, 2 * groups.world_size)
    plain = init_engine(_gpt(None), config)
    _grads_per_step(plain, batches, groups.rank, groups.world_size, lambda e, x, y: e(x, y))
    engine = init_engine(_gpt(ckpt.checkpoint), config)
    _grads_per_step(engine, batches, groups.rank, groups.world_size, lambda e, x, y: e(x, y))
    strategy = engine._strategy
    assert not strategy._exec.recording, "the recompute's forwards must not restart order recording"
    assert strategy._exec.order == plain._strategy._exec.order, "recorded order = the real forward's"
    assert strategy.peak_live_numel <= plain._strategy.peak_live_numel


def test_configure_and_rng_tracker_api(groups) -> None:
    try:
        assert not ckpt.is_configured()
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"profile": True,
                                                                           "partition_activations": True}},
                       synchronize=True)
        assert ckpt.is_configured() and ckpt.settings().profile and ckpt.settings().synchronize
        assert ckpt.settings().partition_activations  # a no-op without model parallelism

        class MPU:
            def get_model_parallel_world_size(self) -> int:
                return 2

        with pytest.raises(zeroshard_errors().NotSupportedError, match="partition_activations"):
            ckpt.configure(MPU(), partition_activations=True)
        with pytest.raises(zeroshard_errors().ConfigError, match="number_checkpoints"):
            ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)
        with pytest.raises(zeroshard_errors().ConfigError, match="unknown key"):
            ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"profiel": True}})
        ckpt.reset()
        # profile: recompute time is measured
        ckpt.configure(None, profile=True)
        ckpt.recompute_seconds()
        lin = nn.Linear(4, 4)
        ckpt.checkpoint(lin, torch.randn(2, 4, requires_grad=True)).sum().backward()
        assert ckpt.recompute_seconds() > 0
        assert ckpt.recompute_seconds() == 0, "read and reset"
    finally:
        _unconfigure()


def zeroshard_errors() -> Any:
    import zeroshard.errors

    return zeroshard.errors


def test_config_block_is_applied_by_initialize(groups) -> None:
    try:
        config = make_config(activation_checkpointing={"profile": True, "cpu_checkpointing": True},
                             wall_clock_breakdown=True, steps_per_print=1)
        engine = init_engine(_gpt(ckpt.checkpoint), config)
        assert ckpt.settings().profile and ckpt.settings().cpu_checkpointing
        batches = global_batches(1, 2 * groups.world_size)
        sink: list[dict[str, float]] = []

        class Sink:
            def write(self, step: int, metrics: dict[str, float]) -> None:
                sink.append(dict(metrics))

            def close(self) -> None:
                pass

        engine._sinks = [Sink()]
        _grads_per_step(engine, batches, groups.rank, groups.world_size, lambda e, x, y: e(x, y))
        assert sink and sink[0]["time_recompute_ms"] > 0 and sink[0]["time_backward_ms"] > 0
        # Note: [monitor events]: the same dict goes to every sink (CSV, TensorBoard, wandb).
        want = {"loss", "lr", "grad_norm", "loss_scale", "skipped_steps", "samples_per_s", "samples",
                "time_forward_ms", "time_step_ms"}
        want |= {f"{k}_rank{r}" for k in ("peak_memory_bytes", "model_state_bytes") for r in range(groups.world_size)}
        assert want <= set(sink[0]), f"missing {sorted(want - set(sink[0]))}"
        assert all(sink[0][f"peak_memory_bytes_rank{r}"] > 0 for r in range(groups.world_size))
    finally:
        _unconfigure()


# -- Hugging Face models ------------------------------------------------------------------


def _llama(init: bool, dtype: torch.dtype | None = None) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_dropout=0.2, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    if init:
        with Init():
            return transformers.LlamaForCausalLM(cfg)
    return transformers.LlamaForCausalLM(cfg)


HF_CASES = {
    "stage0": ({"stage": 0}, False),
    "stage1": ({"stage": 1, "reduce_bucket_size": 500}, False),
    "stage2": ({"stage": 2, "reduce_bucket_size": 500}, False),
    "stage3": ({"stage": 3, "stage3_param_persistence_threshold": 100}, False),
    "stage3-init-offload": ({"stage": 3, "stage3_param_persistence_threshold": 100,
                             "stage3_max_reuse_distance": 0, "offload_param": {"device": "cpu"}}, True),
}


@pytest.mark.parametrize("case", list(HF_CASES))
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_hf_gradient_checkpointing_enable(groups, case: str, use_reentrant: bool) -> None:
    zero, under_init = HF_CASES[case]
    config = make_config(zero_optimization=zero, gradient_accumulation_steps=2)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (4 * groups.world_size, 12), generator=g) for _ in range(2)]
    pairs = [(b, b) for b in batches]

    def run(checkpointing: bool) -> list[list[Tensor]]:
        model = _llama(under_init)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        engine = init_engine(model, config)
        return _grads_per_step(engine, pairs, groups.rank, groups.world_size,
                               lambda e, x, y: e(input_ids=x, labels=y).loss)

    want = run(False)
    got = run(True)
    _assert_bitwise(got, want, f"HF Llama {case}, use_reentrant={use_reentrant}")
