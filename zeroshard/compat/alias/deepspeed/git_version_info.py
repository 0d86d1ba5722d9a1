"""deepspeed.git_version_info: `torch_info` (the installed torch's version, CUDA and NCCL), read by
scripts that check their environment. zeroshard compiles no ops, so `installed_ops` is all False."""

from zeroshard.compat import DEEPSPEED_VERSION as version
from zeroshard.compat.ds_utils import COMPATIBLE_OPS as _OPS
from zeroshard.compat.ds_utils import torch_info as _torch_info

git_hash = None
git_branch = None
installed_ops = {name: False for name in _OPS}
compatible_ops = dict(_OPS)
torch_info = _torch_info()

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "compatible_ops", "torch_info"]
