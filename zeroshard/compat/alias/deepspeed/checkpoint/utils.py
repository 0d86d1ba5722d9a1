"""deepspeed.checkpoint.utils: clone_tensors_for_torch_save, get_model_ckpt_name_for_rank."""

from zeroshard.compat.ds_utils import get_model_ckpt_name_for_rank
from zeroshard.compat.helpers import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank"]
