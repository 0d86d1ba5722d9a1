"""`zeroshard bench-io PATH`: swap read/write bandwidth on PATH for a grid of `aio` settings,
then the `aio` block to put in ds_config.json (DeepSpeed's ds_io, without a compiler)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def _sizes(text: str) -> list[int]:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = units.get(part[-1:], 1)
        out.append(int(float(part[:-1] if mult > 1 else part) * mult))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroshard bench-io",
        description="Measure swap bandwidth on PATH (the nvme_path you mean to use) for a grid of "
                    "block sizes, queue depths and thread counts; print a table and the aio block.")
    p.add_argument("path", type=Path, help="directory on the drive to measure (a scratch file is created and removed)")
    p.add_argument("--block-sizes", type=_sizes, default=_sizes("256k,1m,4m"), help="default 256k,1m,4m")
    p.add_argument("--queue-depths", type=_sizes, default=[1, 4, 8], help="default 1,4,8")
    p.add_argument("--thread-counts", type=_sizes, default=[1, 2], help="default 1,2")
    p.add_argument("--file-size", type=_sizes, default=_sizes("1g"), help="bytes moved per point (default 1g)")
    p.add_argument("--request-size", type=_sizes, default=_sizes("64m"),
                   help="bytes per request, as one swap buffer (default 64m)")
    p.add_argument("--json", action="store_true", help="print the points as JSON lines too")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from zeroshard.errors import ZeroshardError
    from zeroshard.zero.offload.nvme_bench import IOPoint, aio_block, best, sweep
    from zeroshard.zero.offload.nvme_io import check_swap_dir

    def show(p: IOPoint) -> None:
        print(f"{p.block_size:>10} {p.queue_depth:>5} {p.thread_count:>7} {p.write_bytes_per_s / 2**20:>10.0f} "
              f"{p.read_bytes_per_s / 2**20:>10.0f}  {'direct' if p.direct else 'buffered (page cache)'}", flush=True)
        if args.json:
            print(json.dumps(dataclasses.asdict(p)), flush=True)

    try:
        path = check_swap_dir(args.path, (args.file_size[0] // 4096 + 1) * 4096, key="bench-io PATH")
        print(f"{'block_size':>10} {'depth':>5} {'threads':>7} {'write MiB/s':>10} {'read MiB/s':>10}  I/O")
        points = sweep(path, block_sizes=args.block_sizes, queue_depths=args.queue_depths,
                       thread_counts=args.thread_counts, file_bytes=args.file_size[0],
                       request_bytes=args.request_size[0], on_point=show)
    except (ZeroshardError, OSError) as e:
        print(f"zeroshard bench-io: {e}", file=sys.stderr)
        return 1
    top = best(points)
    print(f"\nbest: write {top.write_bytes_per_s / 2**20:.0f} MiB/s, read {top.read_bytes_per_s / 2**20:.0f} MiB/s. "
          "Put this in ds_config.json:")
    print(json.dumps({"aio": aio_block(top)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
