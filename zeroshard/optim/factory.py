"""Optimizer and scheduler factories: build from the config, or adopt the client's objects.

We wrap torch.optim, we do not rewrite it: Adam/AdamW map to torch's fused kernels where the
device has them (CUDA, and CPU since torch 2.4), Lamb is ours (optim/lamb.py), and any other
`torch.optim` class is taken by name. OneBitAdam (optim/onebit_adam.py) is torch's AdamW during its
warm-up.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.optim.lamb import Lamb
from zeroshard.optim.onebit_adam import OneBitAdam
from zeroshard.optim.onebit_lamb import OneBitLamb
from zeroshard.optim.zero_one_adam import ZeroOneAdam

logger = logging.getLogger("zeroshard")

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def params_dict(params: Any) -> dict[str, Any]:
    """A config params section (typed dataclass or mapping) as keyword arguments."""
    if params is None:
        return {}
    if dataclasses.is_dataclass(params):
        return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    return dict(params)


def _fused_supported(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu", "xpu", "mps")


def build_optimizer(
    type_name: str, params: Any, param_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """Build the optimizer named in the config's `optimizer` section.

    DeepSpeed semantics: type "Adam" means decoupled weight decay (AdamW) unless
    `adam_w_mode` is false, and weight decay defaults to 0 for both Adam and AdamW.
    """
    kwargs = params_dict(params)
    name = type_name.lower()
    model_params = [p for g in param_groups for p in g["params"]]  # may be empty on a rank (stage 1/2)
    device = model_params[0].device if model_params else torch.device("cpu")
    if name in ("adam", "adamw"):
        adam_w_mode = kwargs.pop("adam_w_mode", True)
        kwargs.pop("torch_adam", None)
        if not kwargs.pop("bias_correction", True):
            raise ConfigError(
                "optimizer.params.bias_correction: false is not supported by torch's Adam; "
                "remove it (bias correction on is the standard Adam update)"
            )
        kwargs.setdefault("weight_decay", 0.0)
        cls = torch.optim.AdamW if (name == "adamw" or adam_w_mode) else torch.optim.Adam
        kwargs = {k: (tuple(v) if k == "betas" else v) for k, v in kwargs.items()}
        if _fused_supported(device) and all(p.dtype == torch.float32 for p in model_params):
            kwargs["fused"] = True
        return cls(param_groups, **kwargs)
    if name == "lamb":
        return Lamb(param_groups, **kwargs)
    if name == "onebitadam":
        return _one_bit_adam(kwargs, param_groups, device, model_params)
    if name in ("onebitlamb", "zerooneadam"):
        cls = OneBitLamb if name == "onebitlamb" else ZeroOneAdam
        return cls(param_groups, **_onebit_kwargs(cls.__name__, kwargs))
    for attr in dir(torch.optim):
        cls = getattr(torch.optim, attr)
        if attr.lower() == name and inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer):
            return cls(param_groups, **kwargs)
    raise ConfigError(f"optimizer.type: {type_name!r} is not Adam, AdamW, Lamb or a torch.optim class")


def _onebit_kwargs(optimizer: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Config params of ZeroOneAdam / OneBitLamb as their constructors take them: amsgrad refused
    by name; the keys DeepSpeed's versions store and never read, dropped (config/effects.py
    lists them as accepted without effect)."""
    if kwargs.pop("amsgrad", False):
        raise ConfigError(f"optimizer.params.amsgrad: true is not supported by {optimizer} (nor by "
                          "DeepSpeed's). Remove the key or set it to false.")
    for key in ("bias_correction", "eps_inside_sqrt", "max_grad_norm"):
        kwargs.pop(key, None)
    return {k: (tuple(v) if k == "betas" else v) for k, v in kwargs.items()}


def _one_bit_adam(kwargs: dict[str, Any], param_groups: list[dict[str, Any]], device: torch.device,
                  model_params: list[nn.Parameter]) -> OneBitAdam:
    """OneBitAdam from its config params: the keys DeepSpeed accepts but we cannot honour are
    refused here by name (bias_correction is refused at config load, support.py)."""
    for key, why in (("amsgrad", "1-bit Adam does not support the AMSGrad variant (nor does DeepSpeed's)"),
                     ("eps_inside_sqrt", "its warm-up is torch's AdamW, which adds eps outside the square root")):
        if kwargs.pop(key, False):
            raise ConfigError(f"optimizer.params.{key}: true is not supported by OneBitAdam: {why}. "
                              "Remove the key or set it to false.")
    kwargs.pop("bias_correction", None)
    kwargs.pop("max_grad_norm", None)  # DeepSpeed's OnebitAdam stores it and never reads it
    # The warm-up runs the same AdamW kernel as "type": "Adam" would, so it is bitwise plain Adam.
    fused = _fused_supported(device) and all(p.dtype == torch.float32 for p in model_params)
    return OneBitAdam(param_groups, fused=fused or None, **kwargs)


def adopt_client_optimizer(
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    model_params: list[nn.Parameter],
    master_params_for: Callable[[list[nn.Parameter]], list[nn.Parameter]],
    cpu_offload: bool = False,
) -> torch.optim.Optimizer:
    """Use the client's optimizer object (or factory) on the engine's master parameters.

    An optimizer object keeps its identity (so a client scheduler built on it still works):
    its parameter groups are re-pointed in place at the master parameters. With CPU offload, a
    torch Adam/AdamW is switched to torch's fused CPU kernel with the same hyper-parameters.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ConfigError(
                "the client optimizer already has state (it has stepped); pass a fresh optimizer "
                "to initialize() or load its state after initialize()"
            )
        for group in optimizer.param_groups:
            group["params"] = master_params_for(group["params"])
        if cpu_offload and isinstance(optimizer, torch.optim.Adam):  # AdamW and DeepSpeed's Adam classes too
            _use_fused_cpu_kernel(optimizer)
        return optimizer
    if callable(optimizer):
        built = optimizer(model_params)
        if not isinstance(built, torch.optim.Optimizer):
            raise ConfigError(f"the optimizer factory returned {type(built).__name__}, not an Optimizer")
        return built
    raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")


def _use_fused_cpu_kernel(optimizer: torch.optim.Optimizer) -> None:
    """Switch a torch Adam/AdamW in place to its fused kernel (vectorised on CPU)."""
    if all(g.get("fused") for g in optimizer.param_groups):
        return
    for group in [*optimizer.param_groups, optimizer.defaults]:
        group["fused"], group["foreach"] = True, False
    logger.info(
        f"offload_optimizer: the client's {type(optimizer).__name__} now runs torch's fused CPU "
        "kernel on the CPU master shard (same hyper-parameters)"
    )


def client_auto_values(optimizer: Any) -> Mapping[str, Any]:
    """Values a client optimizer can supply for "auto" keys in the optimizer section."""
    if not isinstance(optimizer, torch.optim.Optimizer) or not optimizer.param_groups:
        return {}
    group = optimizer.param_groups[0]
    out: dict[str, Any] = {}
    for key in ("lr", "weight_decay", "eps", "betas"):
        if key in group:
            value = group[key]
            out[f"optimizer.params.{key}"] = float(value) if key == "lr" else value
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    if hasattr(optimizer, "resident_state_bytes"):  # states kept outside memory (NVMe swap)
        return int(optimizer.resident_state_bytes)
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
