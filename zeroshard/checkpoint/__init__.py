"""Checkpoints: sharded save/load with a layout manifest, resharding, consolidation to fp32.

Layer 5: imports comm/, checkpoint_format.py and errors, never runtime/ or zero/: the engine
hands it tensors and a `Manifest`, and reaches this package only through the `Checkpointer`
initialize() gives it.
See docs/checkpoints.md for the on-disk format.
"""

from zeroshard.checkpoint.checkpointer import InTurnCheckpointer, ShardedCheckpointer
from zeroshard.checkpoint.to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    export_pretrained,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = [
    "InTurnCheckpointer",
    "ShardedCheckpointer",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "export_pretrained",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]
