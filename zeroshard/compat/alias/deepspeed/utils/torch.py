"""deepspeed.utils.torch: `required_torch_version`."""

from zeroshard.compat.ds_utils import required_torch_version

__all__ = ["required_torch_version"]
