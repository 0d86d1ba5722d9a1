"""FP8 training: linear layers whose three GEMMs run in float8, with dynamic scaling.

The `fp8` config section (config/schema_fp8.py) turns it on; `initialize` calls `convert_to_fp8`
after AutoTP has split the model and before ZeRO packs its parameters, so the parameters a
converted layer trains are the same `nn.Parameter` objects, kept in the engine's precision (fp32,
or bf16 with fp32 masters in the optimizer): only each GEMM's operands are float8.

A linear layer `y = x W^T + b` (x: tokens x K, W: N x K) runs three GEMMs per step:

    forward      y      = x  @ W^T      contraction over K
    grad input   dx     = dy @ W        contraction over N
    grad weight  dW     = dy^T @ x      contraction over the tokens

Each operand is quantised just before its GEMM, with a scale from its own amax ("dynamic
scaling": no history, no delayed amax), and the GEMM is `torch._scaled_mm` with the inverse
scales, accumulating in fp32 and writing the layer's dtype. Two recipes, as torchao names them:
- "tensorwise": one fp32 scale per tensor, `448 / amax` (e4m3's largest finite value); x and W in
  float8_e4m3fn, the output gradient in float8_e5m2 (range over precision, 57344 / amax). The
  quantised x and W are saved for backward (in float8: a quarter of fp32's bytes) and reused
  transposed, since a tensorwise scale does not depend on the axis.
- "rowwise": one scale per row along each GEMM's contraction axis, rounded down to a power of two
  (so dequantising is exact), every operand in e4m3. Each GEMM quantises along its own axis, so the
  high-precision x and W are saved and quantised again in backward.
The bias is added, and its gradient summed, in the layer's dtype. At ZeRO stage 3 with
`fp8.float8_all_gather`, a tensorwise weight arrives as float8 codes with its scale published on
the parameter (`zs_float8_scale`), which the layer then uses (Note: [float8 gather] in
zero/float8_gather.py); conversion marks the weights it may gather so (`zs_float8_weight`).

Note: [fp8 emulation] On the CPU `torch._scaled_mm` equals dequantise-then-matmul in fp32
(`(qa.float() * inv_a) @ (qb.float() * inv_b)`, cast to the output dtype) bit for bit, which is
what tests/unit/test_fp8_linear.py checks; on a GPU it runs the float8 tensor-core kernel, whose
accumulation order differs. CUDA's kernel needs the contraction dimension divisible by 16;
`_pad_inner` pads it with zeros there (zero products add nothing).

Note: [fp8 conversion in place] `convert_to_fp8` changes a chosen `nn.Linear`'s class to
`Float8Linear` (a subclass that only overrides `forward`) rather than building a new module: the
object, its parameters, hooks and every reference a PipelineModule or the user holds stay the
same, and checkpoints keep their keys. AutoTP's layers (tensor_parallel/layers.py) call their
`linear_fn` attribute; conversion sets it to this module's `fp8_linear`, with scales computed over
this rank's shard (the GEMM it runs).

torchao's `convert_to_float8_training` is the other backend (`fp8.backend: "torchao"`), imported
only when asked for. Imports torch, comm/codecs.py and zeroshard.errors only.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from zeroshard.comm.codecs import float8_scale, to_float8
from zeroshard.errors import NotSupportedError

Recipe = Literal["tensorwise", "rowwise"]
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_scale(x: Tensor, dtype: torch.dtype, dim: int | None = None, power_of_2: bool = False) -> Tensor:
    """fp32 scale that maps `x`'s amax (over all of x, or along `dim` keeping it) to `dtype`'s
    largest finite value; rounded down to a power of two when asked (rowwise)."""
    xa = x.detach().float().abs()
    scale = float8_scale(xa.amax() if dim is None else xa.amax(dim=dim, keepdim=True), dtype)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


quantise = to_float8
"""`x * scale` in fp32, saturated and rounded to a float8 dtype (comm/codecs.py, shared with the
stage-3 float8 gather)."""


def _pad_inner(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """CUDA's float8 GEMM needs the contraction dimension divisible by 16: zeros appended to both
    operands there (see Note [fp8 emulation]); the CPU kernel takes any size."""
    k = a.shape[1]
    if a.device.type != "cuda" or k % 16 == 0:
        return a, b
    pad = 16 - k % 16
    return (torch.cat([a, a.new_zeros(a.shape[0], pad)], dim=1),
            torch.cat([b, b.new_zeros(pad, b.shape[1])], dim=0))


def scaled_mm(qa: Tensor, scale_a: Tensor, qb: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """`(qa / scale_a) @ (qb / scale_b)` with fp32 accumulation: qa (M x K) and qb (K x N) in
    float8, scales fp32 (scalars, or M x 1 and 1 x N). `torch._scaled_mm` wants qa row-major and
    qb column-major."""
    qa, qb = _pad_inner(qa, qb)
    gemm_dtype = out_dtype
    if qa.device.type == "cuda" and scale_a.numel() > 1 and out_dtype != torch.bfloat16:
        gemm_dtype = torch.bfloat16  # CUDA's row-scaled float8 GEMM writes bf16 only (torchao does the same)
    out = torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=scale_a.reciprocal(),
                           scale_b=scale_b.reciprocal(), out_dtype=gemm_dtype)
    return out.to(out_dtype)


class _TensorwiseLinear(torch.autograd.Function):
    """x @ W^T with one scale per tensor; e4m3 operands, an e5m2 output gradient."""

    @staticmethod
    def forward(ctx: Any, x2: Tensor, weight: Tensor) -> Tensor:
        sw = getattr(weight, "zs_float8_scale", None)  # Note: [float8 gather] in zero/float8_gather.py
        sx, sw = fp8_scale(x2, E4M3), fp8_scale(weight, E4M3) if sw is None else sw
        qx, qw = quantise(x2, sx, E4M3), quantise(weight, sw, E4M3)
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.dtypes = (x2.dtype, weight.dtype)
        return scaled_mm(qx, sx, qw.t(), sw, x2.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None]:
        qx, sx, qw, sw = ctx.saved_tensors
        sg = fp8_scale(dy, E5M2)
        qg = quantise(dy, sg, E5M2)
        dx = scaled_mm(qg, sg, qw, sw, ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        dw = scaled_mm(qg.t(), sg, qx, sx, ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return dx, dw


def _rowwise_mm(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a (M x K) @ b (K x N), each operand scaled per row of the contraction: a along its dim 1,
    b along its dim 0; e4m3, power-of-two scales."""
    sa, sb = fp8_scale(a, E4M3, dim=1, power_of_2=True), fp8_scale(b, E4M3, dim=0, power_of_2=True)
    return scaled_mm(quantise(a, sa, E4M3), sa, quantise(b, sb, E4M3), sb, out_dtype)


class _RowwiseLinear(torch.autograd.Function):
    """x @ W^T with one scale per row along each GEMM's contraction axis; every operand e4m3."""

    @staticmethod
    def forward(ctx: Any, x2: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x2, weight)
        return _rowwise_mm(x2, weight.t(), x2.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x2, weight = ctx.saved_tensors
        dx = _rowwise_mm(dy, weight, x2.dtype) if ctx.needs_input_grad[0] else None
        dw = _rowwise_mm(dy.t(), x2, weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


_FUNCTIONS = {"tensorwise": _TensorwiseLinear, "rowwise": _RowwiseLinear}


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, recipe: Recipe = "tensorwise") -> Tensor:
    """`F.linear(x, weight, bias)` with its three GEMMs in float8 (see the module docstring).
    x: (..., K) in the layer's dtype; weight (N x K); the output has x's dtype."""
    if recipe not in _FUNCTIONS:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    if weight.dtype != x.dtype:  # an fp32 input into a bf16 layer: the GEMM runs in the layer's dtype
        x = x.to(weight.dtype)
    lead = x.shape[:-1]
    y = _FUNCTIONS[recipe].apply(x.reshape(-1, x.shape[-1]), weight).reshape(*lead, weight.shape[0])
    return y if bias is None else y + bias


class Float8Linear(nn.Linear):
    """An `nn.Linear` whose forward runs `fp8_linear`; made by `convert_to_fp8` changing the class
    of an existing layer (Note [fp8 conversion in place]), so it has no constructor of its own."""

    fp8_recipe: Recipe = "tensorwise"

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias, recipe=self.fp8_recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_recipe={self.fp8_recipe}"


def _dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of an nn.Linear (or a subclass) or an AutoTP layer (its `linear_fn` seam); None
    for other modules."""
    if isinstance(module, nn.Linear) or callable(getattr(module, "linear_fn", None)):
        weight = getattr(module, "weight", None)
        if isinstance(weight, Tensor) and weight.dim() == 2:
            return weight.shape[1], weight.shape[0]
    return None


def fp8_candidates(model: nn.Module, exclude: Sequence[str] = (), keep_first: bool = True,
                   keep_last: bool = True) -> dict[str, str]:
    """Every linear layer of `model` by name -> "fp8" or the reason it stays in high precision:
    a subclass of nn.Linear (LoRA, a quantised layer, or torchao's Float8Linear that Accelerate's
    `mixed_precision="fp8"` installs: its own forward stays), a dimension not divisible by 16 (the
    float8 GEMM's granularity), a name matching one of the `exclude` patterns (`re.search`), or
    being the first (`keep_first`) or the last (`keep_last`) linear layer in module order, as
    Accelerate's FP8 conversion keeps them: the input and output projections are the most
    sensitive to rounding. A pipeline stage passes keep_first only on the first stage and keep_last
    only on the last (runtime/initialize.py)."""
    linears = [(name, d) for name, m in model.named_modules() if (d := _dims(m)) is not None]
    edge = {linears[i][0] for i, keep in ((0, keep_first), (-1, keep_last)) if keep and linears}
    verdicts: dict[str, str] = {}
    modules = dict(model.named_modules())
    for name, (k, n) in linears:
        hit = next((p for p in exclude if re.search(p, name)), None)
        cls = type(modules[name])
        if isinstance(modules[name], nn.Linear) and cls not in (nn.Linear, Float8Linear):
            verdicts[name] = f"{cls.__module__}.{cls.__qualname__} keeps its own forward (only nn.Linear is converted)"
        elif k % 16 or n % 16:
            verdicts[name] = f"in/out features {k}/{n} not divisible by 16"
        elif hit is not None:
            verdicts[name] = f"matches fp8.exclude pattern {hit!r}"
        elif name in edge:
            verdicts[name] = "first or last linear layer (fp8.keep_first_last)"
        else:
            verdicts[name] = "fp8"
    return verdicts


def convert_to_fp8(model: nn.Module, recipe: Recipe = "tensorwise", exclude: Sequence[str] = (),
                   keep_first: bool = True, keep_last: bool = True, backend: str = "zeroshard") -> dict[str, str]:
    """Make the eligible linear layers of `model` run float8 GEMMs; returns `fp8_candidates`'
    verdicts. backend "zeroshard": `fp8_linear`, in place (see Note [fp8 conversion in place]);
    "torchao": torchao's `convert_to_float8_training` with the same recipe and the same layers
    (its Float8Linear modules replace the chosen nn.Linear ones, sharing their parameters).

    Raises:
        NotSupportedError: backend "torchao" without torchao, or with AutoTP layers to convert.
    """
    if recipe not in _FUNCTIONS:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    verdicts = fp8_candidates(model, exclude, keep_first, keep_last)
    if backend == "torchao":
        _convert_with_torchao(model, recipe, verdicts)
        return verdicts
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    for name, module in model.named_modules():
        if verdicts.get(name) != "fp8":
            continue
        if recipe == "tensorwise" and owners.get(id(module.weight)) == 1:  # not tied to another module
            module.weight.zs_float8_weight = True  # stage 3 may gather it as float8 (zero/float8_gather.py)
        if isinstance(module, nn.Linear):
            module.__class__ = Float8Linear
            module.fp8_recipe = recipe
        else:  # an AutoTP layer
            module.linear_fn = functools.partial(fp8_linear, recipe=recipe)
            module.fp8_recipe = recipe
    return verdicts


def _convert_with_torchao(model: nn.Module, recipe: Recipe, verdicts: dict[str, str]) -> None:
    """torchao's float8 training on the layers `verdicts` chose (an optional dependency)."""
    modules = dict(model.named_modules())
    split = [n for n, why in verdicts.items() if why == "fp8" and not isinstance(modules[n], nn.Linear)]
    if split:
        raise NotSupportedError(f'fp8.backend "torchao" converts nn.Linear only, and {split[0]} is an AutoTP layer; '
                                'set fp8.backend "zeroshard" (its float8 GEMM runs inside the split layers).')
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise NotSupportedError(f'fp8.backend "torchao": torchao cannot be imported ({err}); install it '
                                '(pip install torchao) or set fp8.backend "zeroshard".') from None
    # torchao's default keeps plain weights (no FSDP2 float8 all-gather wrapper, which ZeRO cannot hold)
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: verdicts.get(fqn) == "fp8")


def fp8_layers(model: nn.Module) -> list[str]:
    """Names of the layers of `model` that run in float8."""
    return [name for name, m in model.named_modules() if getattr(m, "fp8_recipe", None) is not None
            or type(m).__module__.startswith("torchao.float8")]


def refuse_float8_weight_wrappers(model: nn.Module) -> None:
    """A parameter that is a tensor subclass (torchao wraps a Float8Linear's weight in one for FSDP2's
    float8 all-gather, which Accelerate's `mixed_precision="fp8"` turns on by default) cannot live in
    ZeRO's flat buffers; refused by name before the optimizer is adopted.

    Raises:
        NotSupportedError: naming the first such parameter and its type.
    """
    for name, p in model.named_parameters():
        if not issubclass(type(p), nn.Parameter):
            cls = type(p)
            raise NotSupportedError(
                f"parameter {name} is a {cls.__module__}.{cls.__qualname__} (a tensor subclass): ZeRO packs "
                "plain tensors into flat buffers. torchao wraps float8 weights this way for FSDP2's float8 "
                "all-gather; with Accelerate pass `--fp8_enable_fsdp_float8_all_gather false` (or "
                "AORecipeKwargs(enable_fsdp_float8_all_gather=False)) so torchao's Float8Linear keeps a plain "
                "weight, or drop mixed_precision=\"fp8\" and set zeroshard's `fp8` config section instead.")
