"""`deepspeed.init_distributed` as the alias serves it: DeepSpeed's rule for a lone process.

DeepSpeed's `init_distributed()` always ends with a process group: without a launcher's
variables it asks MPI for them (and fails without mpi4py). Libraries then call
torch.distributed freely (Transformers' Trainer gathers its loss through it). zeroshard's own
`init_distributed` keeps a lone process group-free; under the alias a lone process gets what
a one-process MPI world would give it (rank 0 of 1 on 127.0.0.1, a free port), so
`python train.py --deepspeed ds.json` runs without a launcher, which DeepSpeed cannot do
without MPI installed.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from zeroshard.comm.env import parse_launch_env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(*args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's signature (see zeroshard.comm.init_distributed); a lone process joins a
    one-rank group instead of staying group-free. An explicit `init_method`/`rank`/`world_size`
    goes to torch as in DeepSpeed (a launcher's environment gives the rank and world size where it is
    set; an explicit `init_method` other than env:// is still where the ranks meet)."""
    import inspect

    import torch.distributed as dist

    from zeroshard.comm import destroy_distributed
    from zeroshard.comm import init_distributed as zs_init

    bound = inspect.signature(zs_init).bind_partial(*args, **kwargs).arguments
    explicit = bound.get("init_method") is not None or bound.get("rank", -1) != -1 \
        or bound.get("world_size", -1) != -1
    if not dist.is_initialized() and parse_launch_env(os.environ) is None and not explicit \
            and bound.get("dist_init_required", True) is not False:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
        destroy_distributed()  # forget a group-free world of 1 joined earlier (e.g. by zero.Init)
    zs_init(*args, **kwargs)
    return None  # DeepSpeed returns None


def initialize(*args: Any, **kwargs: Any) -> Any:
    """`deepspeed.initialize` under the alias: like DeepSpeed's, it first makes sure a process
    group exists (see `init_distributed`), then runs zeroshard.initialize; with sequence parallelism
    at ZeRO 3 the engine then averages the sequence ranks' gradients as DeepSpeed 0.19.8 does
    (sequence/sp_setup.py's `keep_deepspeed_zero3_average`)."""
    from zeroshard import initialize as zs_initialize
    from zeroshard.sequence.sp_setup import keep_deepspeed_zero3_average

    if kwargs.get("dist_init_required", None) is not False:
        init_distributed()
    result = zs_initialize(*args, **kwargs)
    keep_deepspeed_zero3_average(result[0])  # the version it presents itself as: its clients rely on it
    return result


def _zero_init_class() -> type:
    from zeroshard.zero import Init

    class DeepSpeedInit(Init):  # type: ignore[misc, valid-type]
        """`deepspeed.zero.Init` under the alias: like DeepSpeed's, it makes sure a process group
        exists first (see `init_distributed`), then partitions as zeroshard's Init does. It also
        installs the sharded `from_pretrained` load (compat/hf_loading.py): Transformers enters
        this before every ZeRO-3 `from_pretrained` reads its checkpoint."""

        def __enter__(self) -> "DeepSpeedInit":
            if getattr(self, "_enabled", True):
                init_distributed()
                from zeroshard.compat.hf_loading import install_transformers_hook

                install_transformers_hook()
            return super().__enter__()  # type: ignore[no-any-return]

    return DeepSpeedInit


def __getattr__(name: str) -> object:
    if name == "Init":  # built on first use: importing zeroshard.zero pulls in torch
        value = _zero_init_class()
        globals()["Init"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
