"""`deepspeed.env_report` (DeepSpeed's `ds_report`) as zeroshard answers it: the versions and
devices a run will use, and, in place of DeepSpeed's compiled-op table, which of DeepSpeed's op
features zeroshard runs (it compiles none). Megatron-DeepSpeed's pretrain_gpt.py calls `main()`
at start-up to log the environment."""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

from zeroshard.compat.ds_utils import COMPATIBLE_OPS, torch_info


def general_report() -> list[tuple[str, str]]:
    """(name, value) rows: zeroshard, torch, CUDA, NCCL, Python, the accelerator and its backend."""
    import zeroshard
    from zeroshard.accelerator import get_accelerator

    info, accelerator = torch_info(), get_accelerator()
    return [
        ("zeroshard version", f"{zeroshard.__version__} (serving deepspeed {_served_version()})"),
        ("zeroshard install path", os.path.dirname(zeroshard.__file__)),
        ("torch version", torch.__version__),
        ("torch install path", os.path.dirname(torch.__file__)),
        ("torch cuda version", info["cuda_version"]),
        ("nccl version", info["nccl_version"]),
        ("python version", platform.python_version()),
        ("accelerator", f"{accelerator.device_name()} ({accelerator.communication_backend_name()})"),
        ("devices", str(torch.cuda.device_count()) if torch.cuda.is_available() else "0 (CPU only)"),
    ]


def _served_version() -> str:
    from zeroshard.compat import DEEPSPEED_VERSION

    return DEEPSPEED_VERSION


def op_report() -> list[tuple[str, str]]:
    """(DeepSpeed op, what zeroshard does) rows: the feature runs on torch's kernels, or is absent."""
    return [(name, "runs on torch's kernels (nothing to compile)" if ok else "not provided")
            for name, ok in COMPATIBLE_OPS.items() if name != "deepspeed_not_implemented"]


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    """Print the report (DeepSpeed's signature; zeroshard has no op build errors to hide)."""
    rows = [("DeepSpeed op feature", "zeroshard")] if not hide_operator_status else []
    if not hide_operator_status:
        rows += op_report()
    rows += [("", "")] + general_report()
    width = max(len(name) for name, _ in rows) + 3
    print("zeroshard environment report (deepspeed.env_report)")
    for name, value in rows:
        print(f"{name} {'.' * (width - len(name))} {value}" if name else "-" * (width + 20))


def cli_main() -> None:
    """`python -m zeroshard.compat.env_report [--hide_operator_status] [--hide_errors_and_warnings]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hide_operator_status", action="store_true")
    parser.add_argument("--hide_errors_and_warnings", action="store_true")
    args = parser.parse_args(sys.argv[1:])
    main(args.hide_operator_status, args.hide_errors_and_warnings)


if __name__ == "__main__":
    cli_main()
