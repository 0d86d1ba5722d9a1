"""`deepspeed`, served by zeroshard (ZEROSHARD_AS_DEEPSPEED=1 or zeroshard.compat.install()).

Not DeepSpeed: DeepSpeed's public names mapped onto zeroshard's implementation, so scripts,
Hugging Face Transformers and Accelerate run on zeroshard unchanged. Submodules are imported
eagerly (libraries read attribute chains such as deepspeed.runtime.lr_schedules.X).
"""

import os as _os
import sys as _sys

from zeroshard.compat import DEEPSPEED_VERSION as __version__
from zeroshard.compat._names import reexport as _reexport

__served_by_zeroshard__ = True
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
__git_hash__ = None
__git_branch__ = None
version, git_hash, git_branch = __version__, None, None  # DeepSpeed exports git_version_info's names too

__getattr__, __dir__ = _reexport(__name__, {
    "initialize": "zeroshard.compat.comm:initialize",
    "init_distributed": "zeroshard.compat.comm:init_distributed",
    "add_config_arguments": "zeroshard:add_config_arguments",
    "DeepSpeedEngine": "zeroshard.runtime.engine:ZeroEngine",
    "PipelineEngine": "zeroshard.runtime.pipe_engine:PipelineEngine",  # Megatron-DeepSpeed's isinstance checks
    "DeepSpeedConfig": "zeroshard.config:Config",
    "DeepSpeedConfigError": "zeroshard.errors:ConfigError",
    "tp_model_init": "zeroshard.tensor_parallel:tp_model_init",
    "get_accelerator": "zeroshard.accelerator:get_accelerator",  # DeepSpeed-Chat: from deepspeed import get_accelerator
})

from deepspeed import (
    accelerator,
    checkpoint,
    checkpointing,
    comm,
    compression,
    launcher,
    module_inject,
    moe,
    ops,
    pipe,
    runtime,
    utils,
    zero,
)

if _os.environ.get("RANK", "0") == "0" and not _os.environ.get("ZEROSHARD_ALIAS_QUIET"):
    import zeroshard as _zs

    print(f"[zeroshard] `deepspeed` is served by zeroshard {_zs.__version__} "
          f"(as deepspeed {__version__}; unset ZEROSHARD_AS_DEEPSPEED to use a real DeepSpeed)",
          file=_sys.stderr, flush=True)
