"""deepspeed.checkpoint: `utils`, and the checkpoint formats' key names (constants.py), which
DeepSpeed exports here too. DeepSpeed's offline checkpoint readers are refused by name when used:
zeroshard's `engine.load_checkpoint` reads DeepSpeed's files (native and universal) itself, and
`zeroshard to-deepspeed` writes the universal layout."""

from deepspeed.checkpoint import constants, utils
from zeroshard.compat.refused import refused_class as _refused
from zeroshard.compat.refused import refused_function as _refused_function

globals().update({_n: getattr(constants, _n) for _n in dir(constants) if _n.isupper()})

_INSTEAD = ("engine.load_checkpoint(dir) reads DeepSpeed's native and universal checkpoints at any world size, "
            "and `zeroshard to-deepspeed CKPT OUT` writes the universal layout")
DeepSpeedCheckpoint = _refused("deepspeed.checkpoint.DeepSpeedCheckpoint", _INSTEAD)
ZeROCheckpoint = _refused("deepspeed.checkpoint.ZeROCheckpoint", _INSTEAD)
NeoxCheckpoint = _refused("deepspeed.checkpoint.NeoxCheckpoint", _INSTEAD)
get_model_ckpt_name_for_rank = _refused_function("deepspeed.checkpoint.get_model_ckpt_name_for_rank", _INSTEAD)
get_zero_ckpt_name_for_rank = _refused_function("deepspeed.checkpoint.get_zero_ckpt_name_for_rank", _INSTEAD)
get_layer_ckpt_name_for_rank = _refused_function("deepspeed.checkpoint.get_layer_ckpt_name_for_rank", _INSTEAD)
