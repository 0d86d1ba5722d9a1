"""deepspeed.utils.zero_to_fp32 -> zeroshard's streaming consolidation."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
          "convert_zero_checkpoint_to_fp32_state_dict"]
__getattr__, __dir__ = _reexport(__name__, {**{n: f"zeroshard.utils.zero_to_fp32:{n}" for n in _NAMES},
                                            "get_optim_files": "zeroshard.compat.ds_utils:get_optim_files"})
