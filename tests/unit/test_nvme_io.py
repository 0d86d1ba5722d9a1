"""The NVMe swap I/O layer (zero/offload/nvme_io.py): round trips, alignment, fallbacks, errors."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from zeroshard.errors import ConfigError
from zeroshard.zero.offload import nvme_io
from zeroshard.zero.offload.nvme_io import ALIGN, AsyncIO, IOOptions, NvmeIOError, aligned_empty, check_swap_dir

SMALL = IOOptions(block_size=8192, queue_depth=2, thread_count=2)


def _random(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(numel)
    return torch.randn(numel, generator=g).to(dtype)


def test_aligned_empty_is_page_aligned_and_padded() -> None:
    for numel in (1, 1023, 1024, 5000):
        t = aligned_empty(numel, torch.float32)
        assert t.numel() == numel and t.data_ptr() % ALIGN == 0
        assert t.untyped_storage().nbytes() % ALIGN == 0 and t.untyped_storage().nbytes() >= numel * 4


@pytest.mark.parametrize("numel", [1, 1024, 1025, 12_345, 70_001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bitwise(tmp_path: Path, numel: int, dtype: torch.dtype) -> None:
    with AsyncIO(tmp_path, SMALL) as io:
        f = io.open("x.swp", numel * 4)
        src = aligned_empty(numel, dtype)
        src.copy_(_random(numel, dtype))
        f.write(src).wait()
        dst = aligned_empty(numel, dtype)
        dst.fill_(7)
        f.read(dst).wait()
        assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
        f.remove()
    assert not (tmp_path / "x.swp").exists()


def test_unaligned_tensor_and_offset_round_trip(tmp_path: Path) -> None:
    """A slice of an ordinary tensor at an odd file offset: the buffered path carries it."""
    base = _random(40_000)
    src = base[3:30_003]  # not page-aligned
    with AsyncIO(tmp_path, SMALL) as io:
        f = io.open("y.swp", 200_000)
        assert f.direct
        handles = [f.write(src, offset=12), f.write(base[:1000], offset=130_000)]
        for h in handles:
            h.wait()
        dst = torch.zeros(30_000)
        f.read(dst, offset=12).wait()
        assert torch.equal(dst, src)
        tail = torch.zeros(1000)
        f.read(tail, offset=130_000).wait()
        assert torch.equal(tail, base[:1000])
        f.remove()


def test_blocks_split_direct_body_and_buffered_tail(tmp_path: Path) -> None:
    with AsyncIO(tmp_path, SMALL) as io:
        f = io.open("z.swp", 100_000)
        t = aligned_empty(5000, torch.float32)  # 20000 bytes: 16384 direct + 3616 buffered
        blocks = list(f._blocks(t, 0))
        assert [b[3] for b in blocks] == [True, True, False]
        assert sum(b[2] for b in blocks) == 20_000 and blocks[0][2] == 8192
        assert all(not b[3] for b in f._blocks(t, 100))  # unaligned offset: all buffered
        f.remove()


def test_many_requests_in_flight(tmp_path: Path) -> None:
    """More blocks than `in_flight` do not deadlock, and concurrent requests land in place."""
    with AsyncIO(tmp_path, IOOptions(block_size=4096, queue_depth=1, thread_count=2)) as io:
        f = io.open("m.swp", 64 * 40_960)
        parts = [aligned_empty(10_000, torch.float32) for _ in range(64)]
        for i, p in enumerate(parts):
            p.copy_(_random(10_000) + i)
        handles = [f.write(p, offset=i * 40_960) for i, p in enumerate(parts)]
        for h in handles:
            h.wait()
        for i, p in enumerate(parts):
            out = aligned_empty(10_000, torch.float32)
            f.read(out, offset=i * 40_960).wait()
            assert torch.equal(out, p)
        f.remove()


def _refuse_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & nvme_io._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(nvme_io.os, "open", fake_open)


def test_direct_refused_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_direct(monkeypatch)
    with AsyncIO(tmp_path, SMALL) as io:
        assert not io.direct
        f = io.open("b.swp", 40_000)
        assert not f.direct
        src = aligned_empty(10_000, torch.float32)
        src.copy_(_random(10_000))
        f.write(src).wait()
        dst = aligned_empty(10_000, torch.float32)
        f.read(dst).wait()
        assert torch.equal(src, dst)
        f.remove()


def test_direct_required_but_refused_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_direct(monkeypatch)
    with pytest.raises(ConfigError, match="refuses O_DIRECT"):
        AsyncIO(tmp_path, IOOptions(direct=True))
    with pytest.raises(ConfigError, match=r"offload_optimizer.nvme_path.*refuses O_DIRECT"):
        check_swap_dir(tmp_path, 0, key="zero_optimization.offload_optimizer.nvme_path", direct=True)


def test_errors_name_file_and_range(tmp_path: Path) -> None:
    with AsyncIO(tmp_path, SMALL) as io:
        f = io.open("e.swp", 8192)
        with pytest.raises(NvmeIOError, match=r"e\.swp: bytes \[4096, 44096\) lie outside the 8192-byte"):
            f.read(torch.zeros(10_000), offset=4096)
        with pytest.raises(NvmeIOError, match="contiguous CPU tensor"):
            f.write(torch.zeros(100, 2).t())
        os.truncate(f.path, 100)  # someone else truncated it: a short read is an error, not zeros
        with pytest.raises(NvmeIOError, match=r"e\.swp: read of bytes \[100, .*end of the file"):
            f.read(torch.zeros(1000)).wait()
        f.remove()


def test_check_swap_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = "zero_optimization.offload_optimizer.nvme_path"
    assert check_swap_dir(tmp_path, 1000, key=key) == tmp_path.resolve()
    with pytest.raises(ConfigError, match=f"{key}: .*missing.*does not exist; create it"):
        check_swap_dir(tmp_path / "missing", 0, key=key)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        check_swap_dir(tmp_path / "file", 0, key=key)
    with pytest.raises(ConfigError, match=r"need 1048576.00 GiB .* but .* GiB \(\d+ bytes\) free"):
        check_swap_dir(tmp_path, 2**50, key=key)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode bits: make the write fail instead
            monkeypatch.setattr(Path, "write_bytes", lambda self, b: (_ for _ in ()).throw(
                PermissionError(errno.EACCES, "Permission denied")))
        with pytest.raises(ConfigError, match="is not writable"):
            check_swap_dir(ro, 0, key=key)
    finally:
        ro.chmod(0o700)


def test_options_validated() -> None:
    with pytest.raises(ConfigError, match="aio.queue_depth: must be at least 1"):
        IOOptions(queue_depth=0)
    assert IOOptions(queue_depth=4, thread_count=3).in_flight == 12


def test_bench_io_cli_prints_table_and_aio_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from zeroshard.cli.main import main

    rc = main(["bench-io", str(tmp_path), "--block-sizes", "64k,128k", "--queue-depths", "1,2",
               "--thread-counts", "1", "--file-size", "1m", "--request-size", "256k"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.strip().endswith("direct")]
    assert len(rows) == 4
    block = json.loads(out[out.index("{"):])["aio"]
    assert block["block_size"] in (65536, 131072) and block["queue_depth"] in (1, 2)
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone
    assert main(["bench-io", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_best_prefers_the_slower_side_then_fewer_in_flight() -> None:
    from zeroshard.zero.offload.nvme_bench import IOPoint, aio_block, best

    mib = 2**20
    pts = [IOPoint(1 << 20, 8, 2, 900 * mib, 100 * mib, True),  # fast writes, slow reads
           IOPoint(1 << 20, 4, 1, 500 * mib, 500 * mib, True),
           IOPoint(1 << 20, 8, 1, 500 * mib, 500 * mib, True)]
    assert best(pts) is pts[1]
    assert aio_block(pts[1])["intra_op_parallelism"] == 1
