"""`zero_to_fp32.py`, written next to every checkpoint as DeepSpeed does.

Hugging Face Trainer's messages and many tutorials tell users to run
`python zero_to_fp32.py . pytorch_model.bin` (or `... . output_dir`) inside a checkpoint
directory. zeroshard writes a script with DeepSpeed's command line that calls zeroshard's own
streaming consolidation (checkpoint/to_fp32.py), so those instructions work unchanged. Unlike
DeepSpeed's copy it is not standalone: it needs zeroshard installed.
"""

from __future__ import annotations

import os
from pathlib import Path

SCRIPT_NAME = "zero_to_fp32.py"

SCRIPT = '''#!/usr/bin/env python
"""Consolidate the zeroshard checkpoint in this directory into full fp32 weights.

Written by zeroshard's save_checkpoint, with DeepSpeed's zero_to_fp32.py command line:

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT [-t TAG] [--safe_serialization]

OUTPUT is a directory (pytorch_model.bin or, with --safe_serialization, model.safetensors is
written into it) or a file name ending in .bin / .pt / .pth / .safetensors. Streams: memory stays
near one copy of the output. Needs zeroshard (pip install zeroshard); no GPU, no process group.
"""

import argparse
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint_dir", help="directory holding `latest` (or a tag directory)")
    p.add_argument("output", help="output directory, or output file")
    p.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    p.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    p.add_argument("--max_shard_size", default="5GB", help="accepted; the output is one file")
    p.add_argument("--exclude_frozen_parameters", action="store_true")
    p.add_argument("-d", "--debug", action="store_true", help="accepted; no effect")
    args = p.parse_args()
    from zeroshard.utils import zero_to_fp32 as z

    out = Path(args.output)
    if out.suffix in (".bin", ".pt", ".pth", ".safetensors"):
        state = z.get_fp32_state_dict_from_zero_checkpoint(
            args.checkpoint_dir, args.tag, exclude_frozen_parameters=args.exclude_frozen_parameters)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".safetensors" or args.safe_serialization:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(out))
        else:
            import torch

            torch.save(state, out)
        print(f"wrote {out}: {len(state)} tensors")
        return 0
    if args.exclude_frozen_parameters:
        state = z.get_fp32_state_dict_from_zero_checkpoint(args.checkpoint_dir, args.tag,
                                                           exclude_frozen_parameters=True)
        import torch

        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "pytorch_model.bin")
        print(f"wrote {out / 'pytorch_model.bin'}: {len(state)} tensors")
        return 0
    z.convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, out, tag=args.tag,
                                                 safe_serialization=args.safe_serialization)
    print(f"wrote {out / ('model.safetensors' if args.safe_serialization else 'pytorch_model.bin')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def write_recovery_script(save_dir: str | os.PathLike[str]) -> Path:
    """Write `save_dir/zero_to_fp32.py` (atomically: a crash never leaves half a script)."""
    path = Path(save_dir) / SCRIPT_NAME
    tmp = path.with_name(f".{SCRIPT_NAME}.tmp{os.getpid()}")
    tmp.write_text(SCRIPT)
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return path
