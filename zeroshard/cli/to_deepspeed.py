"""`zeroshard to-deepspeed CHECKPOINT_DIR OUTPUT_DIR [--tag T]`: a DeepSpeed universal checkpoint.

Runs on CPU without a process group; see zeroshard/checkpoint/to_universal.py for the layout.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroshard to-deepspeed",
        description="Write a checkpoint (zeroshard's at any layout, or DeepSpeed's native files) as a DeepSpeed "
                    "universal checkpoint: DeepSpeed 0.19 resumes from it at any world size and ZeRO stage 1-3 with "
                    "\"checkpoint\": {\"load_universal\": true}; zeroshard loads it too.")
    p.add_argument("checkpoint_dir", help="the directory given to save_checkpoint (with 'latest'), or a tag directory")
    p.add_argument("output_dir", help="where OUTPUT_DIR/<tag>/ and OUTPUT_DIR/latest_universal are written")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from zeroshard.checkpoint.to_universal import convert_to_universal
    from zeroshard.errors import CheckpointError

    try:
        stats = convert_to_universal(args.checkpoint_dir, args.output_dir, args.tag)
    except CheckpointError as e:
        print(f"zeroshard to-deepspeed: {e}", file=sys.stderr)
        return 1
    print(f"wrote {stats.path}: {stats.trainable} trained and {stats.frozen} frozen parameters, "
          f"{stats.bytes / 2**20:,.1f} MiB in {stats.seconds:.1f} s; DeepSpeed loads it with "
          "\"checkpoint\": {\"load_universal\": true} and engine.load_checkpoint(OUTPUT_DIR)")
    return 0
