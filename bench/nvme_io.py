"""Swap bandwidth of zero/offload/nvme_io.py against the raw disk on the same directory (bench/nvme.md).

Raw = fio, libaio, O_DIRECT, sequential, the same block size and the same number of requests in
flight as zeroshard's point (thread_count x queue_depth). The disk is shared with other jobs, so
the two are interleaved round by round and each round's ratio is reported, with the median.

    python bench/nvme_io.py DIR [--rounds 5] [--size 1g] [--block 1m] [--depth 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
from pathlib import Path

from zeroshard.cli.bench_io import _sizes
from zeroshard.zero.offload.nvme_bench import measure
from zeroshard.zero.offload.nvme_io import IOOptions


def fio(directory: Path, rw: str, size: int, block: int, depth: int) -> float:
    """Raw sequential bandwidth in bytes/s from fio (libaio, O_DIRECT)."""
    target = directory / "fio-raw.bin"
    out = subprocess.run(
        ["fio", "--name=raw", f"--filename={target}", f"--size={size}", f"--rw={rw}", f"--bs={block}",
         f"--iodepth={depth}", "--ioengine=libaio", "--direct=1", "--output-format=json"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out)["jobs"][0]
    return job[rw]["bw_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", type=_sizes, default=_sizes("1g"))
    ap.add_argument("--block", type=_sizes, default=_sizes("1m"))
    ap.add_argument("--request", type=_sizes, default=_sizes("64m"))
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio not found: apt-get install -y fio")
    size, block = args.size[0], args.block[0]
    in_flight = args.depth * args.threads
    opts = IOOptions(block_size=block, queue_depth=args.depth, thread_count=args.threads)
    ratios_w, ratios_r = [], []
    print(f"file {size >> 20} MiB, block {block >> 10} KiB, {in_flight} in flight "
          f"(zeroshard: {args.threads} threads x depth {args.depth}; fio: libaio iodepth {in_flight})")
    print("| round | fio write MiB/s | zeroshard write MiB/s | ratio | fio read MiB/s | zeroshard read MiB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        raw_w = fio(args.dir, "write", size, block, in_flight)
        raw_r = fio(args.dir, "read", size, block, in_flight)
        ours = measure(args.dir, opts, file_bytes=size, request_bytes=args.request[0])
        assert ours.direct, "O_DIRECT was refused: the comparison would measure the page cache"
        ratios_w.append(ours.write_bytes_per_s / raw_w)
        ratios_r.append(ours.read_bytes_per_s / raw_r)
        print(f"| {r + 1} | {raw_w / 2**20:.0f} | {ours.write_bytes_per_s / 2**20:.0f} | {ratios_w[-1]:.2f} "
              f"| {raw_r / 2**20:.0f} | {ours.read_bytes_per_s / 2**20:.0f} | {ratios_r[-1]:.2f} |", flush=True)
    (args.dir / "fio-raw.bin").unlink(missing_ok=True)
    print(f"\nmedian ratio: write {statistics.median(ratios_w):.2f}, read {statistics.median(ratios_r):.2f}")


if __name__ == "__main__":
    main()
