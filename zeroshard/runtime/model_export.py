"""Writing the whole model in its training dtype: `save_16bit_model` and the consolidated state_dict.

A mixin of `ZeroEngine` (DeepSpeed's names and return values). At stage 3 the shards are gathered
one parameter at a time, so the peak is one unit plus, on rank 0, the copy being written.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from zeroshard.moe.hf_experts import expert_banks, gather_bank_rows
from zeroshard.zero.init import GatheredParameters
from zeroshard.zero.units import ZeroParameter

if TYPE_CHECKING:
    from zeroshard.tensor_parallel.setup import ParallelGroups

logger = logging.getLogger("zeroshard")


class ModelExport:
    """`save_16bit_model` / `save_fp16_model` / `_zero3_consolidated_16bit_state_dict` /
    `_consolidated_16bit_state_dict`."""

    # Provided by ZeroEngine and EngineQueries: `module`, `rank`, `zero_gather_16bit_weights_on_model_save()`.
    module: nn.Module
    rank: int
    parallel: "ParallelGroups | None"

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Tensor] | None:
        """The whole model's state_dict in its training dtype, on CPU, on rank 0 (None on the
        others), gathering stage-3 shards one parameter at a time. Every rank must call it.

        DeepSpeed's name; unlike DeepSpeed it also works below stage 3 (nothing to gather).
        Tied parameters stay one tensor under each of their names.
        """
        state = self.module.state_dict(keep_vars=True)
        banks = {id(p): b for b in expert_banks(self.module) for p in b.parameters(recurse=False)}
        tp = self.parallel.tp if self.parallel is not None else None
        first = self.rank == 0 and (self.parallel is None or self.parallel.tp_rank == 0)
        out: dict[str, Tensor] = {}
        done: dict[int, Tensor] = {}
        for name, value in state.items():
            if exclude_frozen_parameters and isinstance(value, nn.Parameter) and not value.requires_grad:
                continue
            if id(value) not in done:
                with GatheredParameters([value] if isinstance(value, ZeroParameter) else []):
                    # Tensor-parallel pieces are joined into the whole weight (DeepSpeed writes rank 0's
                    # pieces); only the first rank keeps a copy, the others take part in the gathers.
                    whole = tp.full(name, value) if tp is not None else value
                    if id(value) in banks:  # AutoEP: every expert-parallel rank's experts (moe/hf_experts.py)
                        whole = gather_bank_rows(banks[id(value)], whole)
                    done[id(value)] = whole.detach().to("cpu", copy=True) if first else value
            out[name] = done[id(value)]
        return out if first else None

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Tensor] | None:
        """DeepSpeed's name for the whole model's 16-bit state_dict under tensor parallelism
        (Accelerate's `get_state_dict` calls it): the same as `_zero3_consolidated_16bit_state_dict`,
        which joins tensor-parallel pieces and stage-3 shards alike."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the whole model's state_dict in its training dtype (fp16/bf16/fp32), on rank 0.

        At stage 3 the shards are gathered one parameter at a time (peak: one unit), which
        needs `zero_optimization.stage3_gather_16bit_weights_on_model_save: true`; without it
        nothing is written and False is returned, as in DeepSpeed. Every rank must call this.

        Returns:
            True when the file was written (on rank 0) or would be (other ranks).
        """
        partitioned = any(isinstance(p, ZeroParameter) for p in self.module.parameters())
        if partitioned and not self.zero_gather_16bit_weights_on_model_save():
            logger.warning("save_16bit_model: the weights are partitioned and "
                           "zero_optimization.stage3_gather_16bit_weights_on_model_save is false; "
                           "nothing written. Set it to true to gather them.")
            return False
        out = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if out is not None:
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            torch.save(out, tmp)
            os.replace(tmp, path)  # never a half-written file under the real name
            logger.info(f"saved the {len(out)}-tensor model state to {path}")
        return True

    def save_fp16_model(self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin",
                        exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)
