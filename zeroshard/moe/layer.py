"""`MoE`: DeepSpeed's mixture-of-experts layer, refused by name (zeroshard has no expert parallelism)."""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroshard.errors import NotSupportedError


class MoE(nn.Module):
    """Not implemented: raises NotSupportedError when built.

    Raises:
        NotSupportedError: always; use a dense feed-forward layer, or DeepSpeed for MoE training.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(
            "deepspeed.moe.layer.MoE: zeroshard does not implement mixture-of-experts layers (expert "
            "parallelism). Use a dense feed-forward layer, or DeepSpeed for MoE training.")
