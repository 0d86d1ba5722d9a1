"""runtime/fp8.py against an emulation written here: explicit quantise / dequantise in fp32.

The emulation rounds each GEMM operand to float8 the way the recipe says (amax -> scale ->
saturate -> cast), turns it back into fp32 (`q.float() / scale`), multiplies in fp32 and casts to
the output dtype. On the CPU `torch._scaled_mm` is that arithmetic, so forward, input gradient,
weight gradient and bias gradient must equal it bit for bit (Note [fp8 emulation]), for both
recipes, fp32 and bf16 layers, 2-D and 3-D inputs. The layer selection (`fp8_candidates`) and
the in-place conversion are checked too.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from zeroshard.errors import NotSupportedError
from zeroshard.runtime.fp8 import (
    Float8Linear,
    convert_to_fp8,
    fp8_candidates,
    fp8_layers,
    fp8_linear,
    refuse_float8_weight_wrappers,
)

E4M3_MAX, E5M2_MAX = 448.0, 57344.0  # the largest finite values of float8_e4m3fn and float8_e5m2


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    """Bit-for-bit against the emulation needs one summation order: torch's CPU GEMMs split the
    contraction differently with more threads (measured: 1.4e-6 on the 3-D case at 2 threads),
    so the comparison runs on one thread, as CI does (tests/run.py sets OMP_NUM_THREADS=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _dequantised(x: Tensor, fmt: torch.dtype, top: float, dim: int | None, power_of_2: bool) -> Tensor:
    """x rounded through float8 and back, in fp32: the value a float8 GEMM multiplies."""
    x = x.detach().float()
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = top / torch.clamp(amax, min=1e-12)
    if power_of_2:
        scale = 2.0 ** torch.floor(torch.log2(scale))
    q = torch.clamp(x * scale, -top, top).to(fmt)
    return q.float() * (1.0 / scale)


def _emulate(x: Tensor, w: Tensor, b: Tensor | None, dy: Tensor, recipe: str) -> tuple[Tensor, ...]:
    """(y, dx, dw, db) of y = x w^T + b under `recipe`, each GEMM as fp32 matmul of dequantised operands."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    if recipe == "tensorwise":
        xq, wq = _dequantised(x2, e4, E4M3_MAX, None, False), _dequantised(w, e4, E4M3_MAX, None, False)
        gq = _dequantised(dy2, e5, E5M2_MAX, None, False)
        y, dx, dw = xq @ wq.t(), gq @ wq, gq.t() @ xq
    else:  # each operand scaled per row of its GEMM's contraction axis, power-of-two scales, e4m3
        def row(t: Tensor, dim: int) -> Tensor:
            return _dequantised(t, e4, E4M3_MAX, dim, True)
        y = row(x2, 1) @ row(w.t(), 0)
        dx = row(dy2, 1) @ row(w, 0)
        dw = row(dy2.t(), 1) @ row(x2, 0)
    y = y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
    if b is not None:
        y = y + b
    db = None if b is None else dy2.sum(0)
    return y, dx.to(x.dtype).reshape(x.shape), dw.to(w.dtype), db


@pytest.mark.parametrize("shape", [(24, 32), (2, 5, 32)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_equals_emulation_bitwise(recipe: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_()
    w = (torch.randn(48, 32, generator=g) * 0.2).to(dtype).requires_grad_()
    b = torch.randn(48, generator=g).to(dtype).requires_grad_()
    dy = (torch.randn(*shape[:-1], 48, generator=g) * 1e-3).to(dtype)
    y = fp8_linear(x, w, b, recipe=recipe)
    y.backward(dy)
    want = _emulate(x, w, b, dy, recipe)
    for name, got, ref in zip(("y", "dx", "dw", "db"), (y, x.grad, w.grad, b.grad), want):
        assert got.dtype == ref.dtype == dtype, (name, got.dtype, ref.dtype)
        assert torch.equal(got, ref), f"{name}: max |diff| {(got.float() - ref.float()).abs().max().item()}"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_rounds(recipe: str) -> None:
    """The emulation is not the unquantised product (the test can tell float8 from fp32), and the
    fp8 result stays near it (relative error of a few float8 steps)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 32, generator=g), torch.randn(16, 32, generator=g)
    y, exact = fp8_linear(x, w, recipe=recipe), x @ w.t()
    assert not torch.equal(y, exact)
    assert (y - exact).norm() / exact.norm() < 0.08


def test_zero_input_and_saturation() -> None:
    """An all-zero tensor gives zeros (finite scale); the scale maps amax to the format's top exactly."""
    w = torch.randn(16, 16)
    assert torch.equal(fp8_linear(torch.zeros(4, 16), w), torch.zeros(4, 16))
    x = torch.zeros(16, 16)
    x[3, 5] = 7.0
    y = fp8_linear(x, torch.eye(16), recipe="tensorwise")
    assert y[3, 5] == 7.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 40), nn.Linear(40, 64)])
        self.head = nn.Linear(64, 32)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for m in self.blocks:
            x = torch.relu(m(x))
        return self.head(x)


def test_candidates_keep_first_last_and_misaligned() -> None:
    verdicts = fp8_candidates(_Net())
    assert verdicts["blocks.0"] == "fp8"
    assert "first or last" in verdicts["inp"] and "first or last" in verdicts["head"]
    assert "not divisible by 16" in verdicts["blocks.1"] and "not divisible by 16" in verdicts["blocks.2"]
    assert fp8_candidates(_Net(), keep_last=False)["head"] == "fp8"
    assert "exclude" in fp8_candidates(_Net(), exclude=[r"^blocks\.0$"])["blocks.0"]


class _OwnLinear(nn.Linear):
    """Stands for a layer with its own forward (LoRA, torchao's Float8Linear): never converted."""


def test_linear_subclasses_keep_their_forward() -> None:
    net = _Net()
    net.blocks[0] = _OwnLinear(64, 64)
    verdicts = convert_to_fp8(net, keep_first=False, keep_last=False)
    assert "keeps its own forward" in verdicts["blocks.0"] and type(net.blocks[0]) is _OwnLinear
    assert verdicts["inp"] == verdicts["head"] == "fp8"


def test_convert_in_place_keeps_parameters_and_names() -> None:
    net = _Net()
    params = {n: p for n, p in net.named_parameters()}
    block = net.blocks[0]
    convert_to_fp8(net, recipe="rowwise", keep_first=False, keep_last=False)
    assert net.blocks[0] is block and type(block) is Float8Linear and block.fp8_recipe == "rowwise"
    assert fp8_layers(net) == ["inp", "blocks.0", "head"]
    assert {n: p for n, p in net.named_parameters()} == params
    x = torch.randn(3, 32)
    y = net(x)
    y.sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_unknown_recipe_is_refused() -> None:
    with pytest.raises(ValueError, match="blockwise"):
        convert_to_fp8(_Net(), recipe="blockwise")  # type: ignore[arg-type]


class _WrappedWeight(torch.Tensor):
    """Stands for torchao's WeightWithDynamicFloat8CastTensor (FSDP2's float8 all-gather wrapper)."""


def test_tensor_subclass_weights_are_refused_by_name() -> None:
    net = _Net()
    refuse_float8_weight_wrappers(net)  # plain parameters pass
    net.blocks[0].weight = nn.Parameter(net.blocks[0].weight.detach().as_subclass(_WrappedWeight))
    match = r"blocks\.0\.weight .*_WrappedWeight.*fp8_enable_fsdp_float8_all_gather"
    with pytest.raises(NotSupportedError, match=match):
        refuse_float8_weight_wrappers(net)


# -- the `fp8` config section ------------------------------------------------------------------------


@pytest.mark.parametrize("extra,match", [
    ({"fp8": {"enabled": True, "recipe": "blockwise"}}, r'fp8\.recipe: got "blockwise"'),
    ({"fp8": {"enabled": True}, "fp16": {"enabled": True}}, r"fp8\.enabled: .*set bf16\.enabled instead"),
    ({"fp8": {"exclude": ["("]}}, r'fp8\.exclude: "\(" is not a regular expression'),
    ({"fp8": {"enabled": True, "float8_all_gather": True}}, r"fp8\.float8_all_gather: only ZeRO stage 3"),
    ({"fp8": {"enabled": True, "float8_all_gather": True, "recipe": "rowwise"}, "zero_optimization": {"stage": 3}},
     r'needs fp8\.recipe "tensorwise"'),
    ({"fp8": {"enabled": True, "float8_all_gather": True},
      "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     r"not combined with .*zero_quantized_weights"),
], ids=["recipe", "fp16", "exclude", "stage", "rowwise-gather", "qwz"])
def test_config_refusals_name_the_key(extra: dict, match: str) -> None:
    from zeroshard.config import load_config
    from zeroshard.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config({"train_batch_size": 2, **extra}, dp_world_size=1)


def test_config_accepts_the_section() -> None:
    from zeroshard.config import load_config

    cfg = load_config({"train_batch_size": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                       "fp8": {"enabled": True, "float8_all_gather": True, "exclude": ["lm_head"]}}, dp_world_size=1)
    assert cfg.fp8.enabled and cfg.fp8.recipe == "tensorwise" and cfg.fp8.exclude == ("lm_head",)
    assert cfg.fp8.float8_all_gather and cfg.fp8.keep_first_last and cfg.fp8.backend == "zeroshard"
