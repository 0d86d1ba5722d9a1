"""comm/codecs.py: blockwise int8/int4 round-trip bounds, packed byte counts, sign compression
with error feedback. No process group."""

from __future__ import annotations

import math

import pytest
import torch

from zeroshard.comm.codecs import (
    DEFAULT_BLOCK_NUMEL,
    SignCompressor,
    dequantize,
    pack_signs,
    quantize_int4,
    quantize_int8,
    sign_wire_bytes,
    unpack_signs,
    wire_bytes,
)

QUANT = {8: (quantize_int8, 127), 4: (quantize_int4, 7)}


def _check_bound(x: torch.Tensor, bits: int, block: int) -> None:
    """Every element within amax_block / (2 * qmax), plus the documented fp32 slack."""
    quant, qmax = QUANT[bits]
    q = quant(x, block)
    out = dequantize(q)
    flat = x.reshape(-1).float()
    assert out.shape == flat.shape
    n = flat.numel()
    nblocks = math.ceil(n / block)
    padded = torch.zeros(nblocks * block)
    padded[:n] = flat
    amax = padded.view(nblocks, block).abs().amax(dim=1)
    per_elem = amax.repeat_interleave(block)[:n]
    bound = per_elem / (2 * qmax) + per_elem * 2.0**-22 + torch.finfo(torch.float32).tiny
    err = (flat - out).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), f"element {worst}: error {err[worst]} > bound {bound[worst]}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,block", [(10_000, DEFAULT_BLOCK_NUMEL), (4096, 2048), (1, 2048),
                                     (7, 1), (33, 4), (5, 3), (2049, 2048)])
def test_round_trip_within_bound_random(bits: int, n: int, block: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + block + bits)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)]
    _check_bound(x, bits, block)


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_adversarial(bits: int) -> None:
    block = 64
    cases = {
        "zeros": torch.zeros(300),
        "one outlier per block": torch.where(torch.arange(256) % 64 == 0, 1e6, 1e-3),
        "exact half steps": (torch.arange(-64, 64, dtype=torch.float32) + 0.5) / 64 * 127,
        "subnormal": torch.full((100,), 1e-42) * torch.randn(100).sign(),
        "huge": torch.full((65,), 3e38) * torch.randn(65).sign(),
        "bf16 input": torch.randn(200).to(torch.bfloat16),
        "2d": torch.randn(17, 13),
    }
    for name, x in cases.items():
        try:
            _check_bound(x, bits, block)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("bits", [8, 4])
def test_zeros_are_exact_and_max_is_exact(bits: int) -> None:
    quant, _ = QUANT[bits]
    x = torch.zeros(5000)
    assert torch.equal(dequantize(quant(x)), x)
    y = torch.tensor([3.0, -3.0, 1.0, 0.0])
    out = dequantize(quant(y, 4))
    assert out[0] == 3.0 and out[1] == -3.0 and out[3] == 0.0  # amax maps to +/-qmax exactly


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused_by_name(bits: int, bad: float) -> None:
    quant, _ = QUANT[bits]
    x = torch.ones(100)
    x[42] = bad
    with pytest.raises(ValueError, match=rf"quantize_int{bits}: input has 1 non-finite.*index 42"):
        quant(x)


def test_bad_arguments_refused() -> None:
    with pytest.raises(ValueError, match="block_numel: got 0"):
        quantize_int8(torch.ones(4), 0)
    with pytest.raises(ValueError, match="floating-point"):
        quantize_int8(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="bits: got 2"):
        wire_bytes(10, 2)


def test_int4_packs_two_per_byte_with_known_layout() -> None:
    q = quantize_int4(torch.tensor([7.0, -7.0, 0.0]), 4)
    # codes 7, -7, 0, pad -> biased 15, 1, 8, 8 -> bytes 0x1F, 0x88
    assert q.codes.dtype == torch.uint8 and q.codes.tolist() == [0x1F, 0x88]


@pytest.mark.parametrize("n", [1, 2047, 2048, 2049, 1_000_000])
def test_wire_bytes_match_the_tensors_and_the_theory(n: int) -> None:
    x = torch.randn(n)
    for bits, quant in ((8, quantize_int8), (4, quantize_int4)):
        q = quant(x)
        assert q.wire_bytes == wire_bytes(n, bits)
    bf16 = 2 * n
    nblocks = math.ceil(n / DEFAULT_BLOCK_NUMEL)
    assert wire_bytes(n, 8) == n + 4 * nblocks
    assert wire_bytes(n, 4) == math.ceil(n / 2) + 4 * nblocks
    if n >= 1_000_000:  # the theory: int8 ~ 1/2 of bf16, int4 ~ 1/4, scales add 0.1-0.2 points
        assert 0.5 < wire_bytes(n, 8) / bf16 < 0.5 + 0.001
        assert 0.25 < wire_bytes(n, 4) / bf16 < 0.25 + 0.001
        assert sign_wire_bytes(n) / (4 * n) == pytest.approx(1 / 32, rel=1e-4)


def test_sign_pack_round_trip_and_bytes() -> None:
    c = torch.tensor([1.0, -2.0, 0.0, 0.5, -0.5, 3.0, -1.0, 2.0, -4.0])
    p = pack_signs(c)
    assert p.bits.numel() == 2 and p.wire_bytes == sign_wire_bytes(9) == 6
    out = unpack_signs(p)
    s = c.abs().mean()
    expected = torch.where(c >= 0, s, -s)  # zero counts as +1
    assert torch.allclose(out, expected)


def test_error_feedback_residual_contracts_and_sums_telescope() -> None:
    g = torch.Generator().manual_seed(0)
    n = 1000
    comp = SignCompressor(n)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(50):
        x = torch.randn(n, generator=g) + 0.3
        compensated_norm = float((x + comp.error).norm())
        out = unpack_signs(comp.compress(x))
        # ||e'|| <= ||c|| * sqrt(1 - 1/n): the least-squares scale never grows the residual
        assert float(comp.error.norm()) <= compensated_norm * math.sqrt(1 - 1 / n) * (1 + 1e-5)
        sent += out.double()
        total += x.double()
    # Everything sent equals everything given minus what is still held back.
    assert torch.allclose(sent + comp.error.double(), total, atol=1e-3)
    # Without feedback the bias would accumulate; with it, the held-back part stays bounded.
    assert float(comp.error.norm()) < float(total.norm()) / 10


def test_one_hot_residual_is_smaller_than_input() -> None:
    # The case where DeepSpeed's ||c||/sqrt(n) scale leaves a residual larger than c.
    comp = SignCompressor(64)
    x = torch.zeros(64)
    x[3] = 1.0
    comp.compress(x)
    assert float(comp.error.norm()) < 1.0


def test_compressor_refuses_wrong_length_and_non_finite() -> None:
    comp = SignCompressor(8)
    with pytest.raises(ValueError, match="got 4 elements, expected 8"):
        comp.compress(torch.ones(4))
    with pytest.raises(ValueError, match="SignCompressor.compress: input has 1 non-finite"):
        comp.compress(torch.tensor([1.0] * 7 + [float("nan")]))
