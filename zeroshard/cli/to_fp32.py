"""`zeroshard to-fp32 CHECKPOINT_DIR OUTPUT [--tag T] [--safetensors]`: consolidate a checkpoint.

Runs on CPU without a process group; see zeroshard/checkpoint/to_fp32.py for the memory bound.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroshard to-fp32",
        description="Write the full fp32 weights of a zeroshard checkpoint to one file "
                    "(no GPU, no process group; streams so memory stays near one copy of the output).")
    p.add_argument("checkpoint_dir", help="the directory given to save_checkpoint (with 'latest'), or a tag directory")
    p.add_argument("output", help="output file: a torch.save state dict, or safetensors with --safetensors")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    p.add_argument("--safetensors", action="store_true", help="write safetensors, streamed tensor by tensor")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--chunk-mb", type=int, default=64, help="output MiB assembled per pass (default 64)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from zeroshard.checkpoint.to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    from zeroshard.errors import CheckpointError

    try:
        stats = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output, args.tag, safetensors=args.safetensors,
            progress=not args.no_progress, chunk_bytes=max(args.chunk_mb, 1) * 2**20)
    except CheckpointError as e:
        print(f"zeroshard to-fp32: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {stats.tensors} tensors, {stats.output_bytes / 2**20:,.1f} MiB "
          f"in {stats.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
