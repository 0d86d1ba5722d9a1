"""The memory formulas: seed 003's closed forms, DeepSpeed's estimator, the activation model.

Pure arithmetic on ints (no process group). The per-rank comparison with the engine itself is
tests/dist/test_estimate_engine.py.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from zeroshard.config import load_config
from zeroshard.errors import ZeroshardError
from zeroshard.estimate import (
    ActivationOptions,
    Setup,
    TransformerShape,
    activation_bytes,
    estimate_node,
    estimate_rank,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    spec_from_counts,
    spec_from_gpt,
)
from zeroshard.estimate.activations import layer_bytes
from zeroshard.estimate.states import Device, Precision, ZeroStage

PHI = 1_200_000_000  # divisible by every world size below times 16: no padding in the closed forms
GiB = 2**30


def total(stage: ZeroStage, n: int, precision: Precision = "bf16", grads: Precision | None = None,
          opt: Device = "none", param: Device = "none") -> tuple[int, int]:
    setup = Setup(zero_stage=stage, precision=precision, grad_accum_dtype=grads, offload_optimizer=opt,
                  offload_param=param, devices_per_node=n)
    est = estimate_rank(spec_from_counts(PHI), setup)
    return est.device.total, est.host.total


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64])
def test_seed_003_formulas_with_16_bit_gradients(n: int) -> None:
    # Seed 003 (mixed precision, Adam, 16-bit gradients): 4Φ + 12Φ/N, 2Φ + 14Φ/N, 16Φ/N.
    pad = 32 * n  # counts-only estimates add at most one aligned chunk per bucket (or unit)
    cases: list[tuple[ZeroStage, int]] = [(1, 4 * PHI + 12 * PHI // n), (2, 2 * PHI + 14 * PHI // n),
                                          (3, 16 * PHI // n)]
    for stage, want in cases:
        dev, host = total(stage, n, grads="bf16")
        assert host == 0
        assert want <= dev <= want + 18 * pad, (stage, n, dev - want)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_zeroshard_accounting_differs_as_documented(n: int) -> None:
    pad = 18 * 32 * n
    # fp32 gradient accumulation (the default under bf16): 2 more bytes per gradient element.
    assert total(0, n)[0] == 18 * PHI
    assert abs(total(1, n)[0] - (6 * PHI + 12 * PHI // n)) <= pad
    assert abs(total(2, n)[0] - (2 * PHI + 16 * PHI // n)) <= pad
    assert abs(total(3, n)[0] - 18 * PHI // n) <= pad
    # fp32 training without offload: no second master copy at stages 0-2.
    assert total(0, n, "fp32")[0] == 16 * PHI
    assert abs(total(2, n, "fp32")[0] - (4 * PHI + 12 * PHI // n)) <= pad
    # With optimizer offload the master shard exists in fp32 too, on the CPU.
    dev, host = total(2, n, "fp32", opt="cpu")
    assert abs(dev - 4 * PHI) <= pad and abs(host - 16 * PHI // n) <= pad
    dev, host = total(3, n, opt="cpu", param="cpu")
    assert dev <= pad and abs(host - 18 * PHI // n) <= pad


def test_partition_padding_is_reproduced_exactly_from_sizes() -> None:
    # 3 ranks, chunks aligned to 16 elements: a 1000-element parameter in one bucket pads to
    # 1008 = 3 * 336; rank 2's chunk ends in 8 padding elements, so it owns 328 (Adam: 8 B each).
    from zeroshard.estimate.spec import ModelSpec

    spec = ModelSpec(name="one", total_params=1000, largest_layer_params=1000, param_numels=(1000,))
    setup = Setup(zero_stage=2, precision="fp32", devices_per_node=3)
    ranks = [estimate_rank(spec, setup, r) for r in range(3)]
    assert [r.device.optimizer_states for r in ranks] == [8 * 336, 8 * 336, 8 * 328]
    assert {r.device.params for r in ranks} == {4 * 1008}
    assert {r.device.grads for r in ranks} == {4 * 336}


def test_setup_from_config() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                       "data_types": {"grad_accum_dtype": "bf16"},
                       "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                       "zero_optimization": {"stage": 2, "reduce_bucket_size": 7000, "allgather_bucket_size": 5000,
                                             "offload_optimizer": {"device": "cpu"}}}, dp_world_size=4)
    s = Setup.from_config(cfg, devices_per_node=4)
    assert (s.zero_stage, s.offload_optimizer, s.precision, s.grad_bytes) == (2, "cpu", "bf16", 2)
    assert s.bucket_numel == 5000 and s.optimizer_state_bytes == 4 and s.world_size == 4


def test_stage2_nvme_optimizer_moves_master_and_states_to_the_swap_files() -> None:
    """zeroshard swaps optimizer states at stages 1-3: at stage 2 the fp32 master and Adam's two
    states leave host memory for the swap files, the gradient shard stays on the host, and the
    host keeps the swap pool (buffer_count slots x 3 states x sub-group)."""
    spec = spec_from_counts(100e6)
    cpu = estimate_rank(spec, Setup(zero_stage=2, offload_optimizer="cpu", precision="bf16"), 0)
    nv = estimate_rank(spec, Setup(zero_stage=2, offload_optimizer="nvme", precision="bf16",
                                   sub_group_size=10_000_000, nvme_buffer_count=4), 0)
    assert nv.device == cpu.device and nv.host.grads == cpu.host.grads
    assert nv.nvme.master_params == cpu.host.master_params and nv.nvme.optimizer_states == cpu.host.optimizer_states
    assert nv.host.master_params == nv.host.optimizer_states == 0
    assert nv.host_buffers == 4 * 3 * 10_000_000 * 4  # 10 sub-groups of the 100M shard, 4 slots


def test_setup_rejects_impossible_combinations() -> None:
    with pytest.raises(ZeroshardError, match="offload_param needs stage 3"):
        Setup(zero_stage=2, offload_param="cpu")
    with pytest.raises(ZeroshardError, match="rank 4 outside"):
        estimate_rank(spec_from_counts(1e6), Setup(zero_stage=1, devices_per_node=4), 4)


def test_node_figures_count_local_ranks_and_init() -> None:
    spec = spec_from_counts(PHI, 1e7)
    node = estimate_node(spec, Setup(zero_stage=2, offload_optimizer="cpu", devices_per_node=8, nodes=2))
    assert node.cpu_steady == pytest.approx(8 * 16 * PHI / 16, rel=1e-6)  # 8 local ranks, 1/16 each
    assert node.cpu_init == 8 * 4 * PHI  # every local rank builds the fp32 model first
    assert node.cpu_peak == node.cpu_init
    z3 = estimate_node(spec, Setup(zero_stage=3, offload_optimizer="cpu", offload_param="cpu", devices_per_node=8,
                                   zero_init=True))
    assert z3.cpu_init == 8 * 4 * 10**7  # zero.Init: one layer per rank


# -- DeepSpeed's formulas ------------------------------------------------------------------------

def test_deepspeed_zero3_reproduces_the_published_t0_3b_table() -> None:
    # bigscience/T0_3B as AutoModel: 2,783,959,040 params, largest layer 65,798,144 (the
    # embedding). The table DeepSpeed prints for it on 1 GPU (seed 001's example):
    want = [(70.00, 0.25), (70.00, 0.25), (62.23, 5.43), (62.23, 5.43), (0.37, 46.91), (15.56, 46.91)]
    got = []
    for opt, param in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(2_783_959_040, 65_798_144, 1, 1, opt, param, zero_init)
            got.append((round(cpu / GiB, 2), round(gpu / GiB, 2)))
    assert got == want


def test_deepspeed_zero2_formula() -> None:
    cpu, gpu = estimate_zero2_model_states_mem_needs(2851e6, 8, 1, cpu_offload=True)
    assert (round(cpu / GiB, 2), round(gpu / GiB, 2)) == (127.45, 5.31)  # DeepSpeed's docs
    cpu, gpu = estimate_zero2_model_states_mem_needs(1e9, 4, 2, cpu_offload=False)
    assert gpu == 2 * 10**9 + 18 * 10**9 // 8 and cpu == int(1e9 * 4 * 4 * 1.5)


def _printed(fn, *args, **kwargs) -> str:  # any estimator function
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args, **kwargs)
    return buf.getvalue()


def _normalised(text: str) -> list[str]:
    # DeepSpeed formats its device enum with the enum's name on some Pythons
    # ("offload_param=OffloadDeviceEnum.cpu,") and as the padded value on others ("cpu ,", its
    # docs); the figures and every other character must match.
    return [" ".join(line.replace("OffloadDeviceEnum.", "").replace(" ,", ",").split())
            for line in text.splitlines() if "Setting accelerator" not in line]


@pytest.mark.parametrize("gpus,nodes", [(1, 1), (8, 1), (4, 3)])
def test_output_is_deepspeeds_own_when_asked(gpus: int, nodes: int) -> None:
    why = "compares with a real DeepSpeed 0.19, which is not installed (pip install -e '.[bench]')"
    ds = pytest.importorskip("deepspeed.runtime.zero.stage3", reason=why)
    ds12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2", reason=why)
    ours = _printed(estimate_zero3_model_states_mem_needs_all_cold, 2851e6, 32e6, gpus, nodes, formulas="deepspeed")
    theirs = _printed(ds.estimate_zero3_model_states_mem_needs_all_cold, 2851e6, 32e6, gpus, nodes)
    assert _normalised(ours) == _normalised(theirs) and len(ours.splitlines()) == 10
    ours = _printed(estimate_zero2_model_states_mem_needs_all_cold, 2851e6, gpus, nodes, formulas="deepspeed")
    theirs = _printed(ds12.estimate_zero2_model_states_mem_needs_all_cold, 2851e6, gpus, nodes)
    assert _normalised(ours) == _normalised(theirs) and len(ours.splitlines()) == 6


def test_deepspeed_named_functions_print_zeroshards_figures_by_default() -> None:
    from zeroshard.examples.gpt import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tiny"))
    out = _printed(estimate_zero3_model_states_mem_needs_all_live, model, num_gpus_per_node=2)
    assert "zeroshard's accounting" in out and "offload_param=cpu , offload_optimizer=cpu , zero_init=1" in out
    rows = estimate_zero3_model_states_mem_needs_all_live(model, 2, formulas="deepspeed")
    assert len(rows) == 6 and rows[-1].gpu_bytes == rows[-2].gpu_bytes


# -- activations ---------------------------------------------------------------------------------

def test_activations_follow_korthikanti() -> None:
    # One layer, 16-bit activations, dropout, attention scores stored: s*b*h*(34 + 5*a*s/h).
    s, b, h, a = 2048, 4, 4096, 32
    shape = TransformerShape(hidden_size=h, num_layers=1, num_heads=a, vocab_size=0, ffn_hidden_size=4 * h)
    opt = ActivationOptions(seq_len=s, micro_batch=b, flash_attention=False)
    assert layer_bytes(shape, opt) == s * b * h * 34 + 5 * a * s * s * b
    flash = ActivationOptions(seq_len=s, micro_batch=b)
    assert layer_bytes(shape, flash) == s * b * h * 34  # fused attention keeps no s*s matrix


def test_checkpointing_keeps_layer_inputs_only() -> None:
    shape = TransformerShape(hidden_size=1024, num_layers=24, num_heads=16, vocab_size=50257, ffn_hidden_size=4096)
    full = activation_bytes(shape, ActivationOptions(seq_len=1024, micro_batch=2))
    ckpt = activation_bytes(shape, ActivationOptions(seq_len=1024, micro_batch=2, checkpointing=True))
    sbh = 1024 * 2 * 1024
    head = 1024 * 2 * 50257 * (2 + 4 + 4)
    assert ckpt == 25 * 2 * sbh + layer_bytes(shape, ActivationOptions(seq_len=1024, micro_batch=2)) + head
    assert full == 24 * layer_bytes(shape, ActivationOptions(seq_len=1024, micro_batch=2)) + 2 * sbh + head
    assert ckpt - head < (full - head) / 8  # the logits are not checkpointed
    fp32 = activation_bytes(shape, ActivationOptions(seq_len=1024, micro_batch=2, act_bytes=4, dropout=False))
    assert fp32 > full


def test_gpt_spec_has_the_shape_for_activations() -> None:
    spec = spec_from_gpt("25m")
    assert spec.shape is not None and (spec.shape.hidden_size, spec.shape.num_layers) == (512, 8)
    assert spec.shape.max_seq_len == 256 and spec.live
