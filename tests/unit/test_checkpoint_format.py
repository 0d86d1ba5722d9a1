"""Checkpoint pieces without a process group: resharding arithmetic, the manifest, tag
resolution, crash-safe writes and their fault points, the safetensors writer, the resumable
sampler, and the `zeroshard to-fp32` command line."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from zeroshard.checkpoint import files
from zeroshard.checkpoint.expert_layout import experts_move, globalize, own_global_names
from zeroshard.checkpoint.manifest import check_compatible, from_json, read_latest, resolve, to_json
from zeroshard.checkpoint.reshard import RangeIndex, Read
from zeroshard.checkpoint.safetensors_io import SafetensorsWriter, read_safetensors
from zeroshard.checkpoint_format import Manifest, TensorInfo
from zeroshard.cli.main import main as cli
from zeroshard.errors import CheckpointError
from zeroshard.runtime.dataloader import ResumableDistributedSampler
from zeroshard.zero.flat import BucketedPartition

# -- resharding ---------------------------------------------------------------------------


def test_reads_tile_a_range_across_sources() -> None:
    # param 0 (10 elements) split 4 / 6 over two ranks; param 1 whole on rank 1
    index = RangeIndex([[(0, 0, 4)], [(0, 4, 6), (1, 0, 3)]], ["a", "b"])
    assert index.reads(0, 2, 5) == [Read(0, 0, 2, 0, 2), Read(1, 0, 0, 2, 3)]
    assert index.reads(0, 0, 10) == [Read(0, 0, 0, 0, 4), Read(1, 0, 0, 4, 6)]
    assert index.reads(1, 1, 2) == [Read(1, 1, 1, 0, 2)]
    assert index.reads(0, 5, 0) == []
    assert index.sources_for([(0, 5, 3)]) == {1}


def test_reads_refuse_a_gap() -> None:
    index = RangeIndex([[(0, 0, 4)], [(0, 6, 4)]], ["w"])
    with pytest.raises(CheckpointError, match=r"no saved fragment covers elements \[4, 8\) of parameter w"):
        index.reads(0, 2, 6)
    with pytest.raises(CheckpointError, match="parameter w"):
        index.reads(0, 8, 4)


@pytest.mark.parametrize("saved_world,loaded_world", [(2, 1), (2, 3), (3, 2), (1, 4), (4, 3)])
def test_any_partition_reassembles_from_any_other(saved_world: int, loaded_world: int) -> None:
    numels = [7, 130, 1, 64, 33, 250]
    flat = torch.arange(sum(numels), dtype=torch.float32)
    params = list(flat.split(numels))

    def shards(world: int) -> list[list[tuple[int, int, int]]]:
        plan = BucketedPartition(numels, bucket_numel=100, world_size=world, align=16)
        return [[(f.param_index, f.param_offset, f.numel) for f in plan.rank_fragments(r)] for r in range(world)]

    saved = shards(saved_world)
    data = [[params[p][o : o + n] for p, o, n in rank] for rank in saved]
    index = RangeIndex(saved, [str(i) for i in range(len(numels))])
    for rank in shards(loaded_world):
        for p, o, n in rank:
            out = torch.empty(n)
            for r in index.reads(p, o, n):
                src = data[r.source][r.entry]
                out[r.dst_offset : r.dst_offset + r.numel] = src[r.src_offset : r.src_offset + r.numel]
            assert torch.equal(out, params[p][o : o + n])


# -- manifest -----------------------------------------------------------------------------


def manifest(**changes: object) -> Manifest:
    m = Manifest(world_size=2, zero_stage=2, precision="bf16",
                 params=[TensorInfo("w", (4, 3), "bfloat16", True), TensorInfo("frozen", (2,), "bfloat16", False)],
                 aliases={"head.w": "w"}, buffers=[TensorInfo("mask", (3,), "bool")], optimizer="AdamW",
                 param_groups=1, fragments=[[(0, 0, 8)], [(0, 8, 4)]], weight_pieces=None, tag="t",
                 files={"a.pt": 10})
    for k, v in changes.items():
        setattr(m, k, v)
    return m


def test_manifest_json_round_trip(tmp_path: Path) -> None:
    m = manifest()
    text = to_json(m)
    assert text.startswith('{\n "format": "zeroshard-checkpoint",\n "format_version": 1,')
    assert from_json(text, tmp_path / "m.json") == m


@pytest.mark.parametrize("text,match", [
    ("{oops", "not valid JSON"),
    ('{"format": "deepspeed"}', "not a zeroshard checkpoint manifest"),
    ('{"format": "zeroshard-checkpoint", "format_version": 99}', "format version 99"),
    ('{"format": "zeroshard-checkpoint", "format_version": 1}', "field missing or malformed"),
])
def test_manifest_rejects_foreign_or_damaged_json(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as info:
        from_json(text, tmp_path / "zeroshard_manifest.json")
    assert "zeroshard_manifest.json" in str(info.value)


def test_compatibility_names_each_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "zeroshard_manifest.json"
    check_compatible(manifest(), manifest(), path, need_optimizer=True)
    other = manifest(params=[TensorInfo("w", (4, 4), "float32", True), TensorInfo("extra", (1,), "float32", True)])
    with pytest.raises(CheckpointError) as info:
        check_compatible(manifest(), other, path, need_optimizer=False)
    msg = str(info.value)
    assert str(path) in msg and "missing from the checkpoint: extra" in msg
    assert "shape mismatch: w: checkpoint [4, 3], model [4, 4]" in msg
    with pytest.raises(CheckpointError, match="2 parameter groups, the checkpoint 1"):
        check_compatible(manifest(), manifest(param_groups=2), path, need_optimizer=True)
    with pytest.raises(CheckpointError, match="load_optimizer_states=False"):
        check_compatible(manifest(has_optimizer_states=False), manifest(), path, need_optimizer=True)
    thawed = manifest(params=[TensorInfo("w", (4, 3), "bfloat16", True), TensorInfo("frozen", (2,), "bfloat16", True)])
    with pytest.raises(CheckpointError, match="frozen when saved .* frozen"):
        check_compatible(manifest(), thawed, path, need_optimizer=True)


def test_expert_layouts_are_told_apart(tmp_path: Path) -> None:
    """Experts are saved per rank under local names. At another world size or ep_size the load
    reads them by global id (checkpoint/expert_layout.py, load.py) and never reaches this check;
    what check_compatible still refuses is a checkpoint and a model that differ in their MoE layers."""
    path = tmp_path / "zeroshard_manifest.json"
    moe = manifest(expert_parallel={"ep_size_2": 2})
    assert from_json(to_json(moe), path) == moe
    check_compatible(moe, manifest(expert_parallel={"ep_size_2": 2}), path, need_optimizer=True)
    check_compatible(manifest(world_size=4), manifest(), path, need_optimizer=True)  # dense: any world size
    assert not experts_move(moe, manifest(expert_parallel={"ep_size_2": 2}))
    assert not experts_move(manifest(world_size=4), manifest())
    for target in (manifest(world_size=4, expert_parallel={"ep_size_2": 2}), manifest(expert_parallel={"ep_size_1": 1}),
                   manifest()):
        assert experts_move(moe, target)
    with pytest.raises(CheckpointError, match="saved by 2 rank.*ep_size_2.*differ in their MoE layers"):
        check_compatible(moe, manifest(), path, need_optimizer=False)


def test_globalize_names_each_expert_once_by_id() -> None:
    """EP 2 at 4 ranks, 2 local experts of 2 parameters each: the global manifest lists the
    dense parameter and experts 0-3 once; rank r's fragments point at experts (r % 2) * 2 + j."""
    e = "moe.deepspeed_experts"
    local = [TensorInfo("dense", (3,), "float32", True)] + [
        TensorInfo(f"{e}.{j}.{n}", (2,), "float32", True) for j in range(2) for n in ("w", "b")]
    frags = [[(0, 0, 3)] + [(i, 0, 2) for i in range(1, 5)] for _ in range(4)]
    m = manifest(world_size=4, params=local, aliases={}, fragments=frags, expert_parallel={"ep_size_2": 2})
    g = globalize(m, 2)
    assert [p.name for p in g.params] == ["dense"] + [f"{e}.{k}.{n}" for k in range(4) for n in ("w", "b")]
    names = [[g.params[i].name for i, _, _ in g.fragments[r]] for r in range(4)]
    assert names[0] == names[2] == ["dense", f"{e}.0.w", f"{e}.0.b", f"{e}.1.w", f"{e}.1.b"]
    assert names[1] == names[3] == ["dense", f"{e}.2.w", f"{e}.2.b", f"{e}.3.w", f"{e}.3.b"]
    assert g.expert_parallel is None
    own = own_global_names(m, 3, 2)
    assert [p.name for p in own.params] == ["dense", f"{e}.2.w", f"{e}.2.b", f"{e}.3.w", f"{e}.3.b"]


def test_resolve_tags(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        resolve(tmp_path / "absent", None)
    assert resolve(tmp_path, None) is None  # nothing saved yet
    (tmp_path / "t").mkdir()
    (tmp_path / files.LATEST).write_text("t\n")
    assert read_latest(tmp_path) == "t"
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve(tmp_path, None)
    with pytest.raises(CheckpointError, match=r"tag 'nope' not found in .*; tags there: \['t'\]"):
        resolve(tmp_path, "nope")
    (tmp_path / "t" / files.MANIFEST).write_text(to_json(manifest()))
    assert resolve(tmp_path, None) == (tmp_path / "t", manifest())
    # interrupted re-save of tag t: t/ renamed to .t.old/, the new one not yet renamed in
    os.replace(tmp_path / "t", files.retired_dir(tmp_path, "t"))
    resolved = resolve(tmp_path, None)
    assert resolved is not None and resolved[0] == tmp_path / ".t.old"
    (tmp_path / files.LATEST).write_text("../x")
    with pytest.raises(CheckpointError, match="does not hold a tag name"):
        resolve(tmp_path, None)


# -- crash-safe writes --------------------------------------------------------------------


def test_write_atomic_counts_events_and_leaves_no_temp(tmp_path: Path) -> None:
    files.begin_save(0)
    size = files.save_torch(tmp_path / "x.pt", {"t": torch.arange(10)})
    events = files.events()
    assert events[0] == "open" and events[-2:] == ["fsync", "rename"] and "write" in events
    assert size == (tmp_path / "x.pt").stat().st_size and os.listdir(tmp_path) == ["x.pt"]
    assert torch.equal(files.load_torch(tmp_path / "x.pt", expected_bytes=size)["t"], torch.arange(10))
    with pytest.raises(CheckpointError, match=r"x.pt: \d+ bytes, the manifest says 3"):
        files.load_torch(tmp_path / "x.pt", expected_bytes=3)


def test_fault_point_kills_at_the_kth_event(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:  # child: die at the 3rd event (a write), leaving only a temp file
        os.environ[files.FAULT_ENV] = "3"
        files.begin_save(0)
        files.save_torch(tmp_path / "x.pt", {"t": torch.zeros(1000)})
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert os.listdir(tmp_path) == ["x.pt.tmp"]


def test_load_torch_names_a_foreign_file(tmp_path: Path) -> None:
    (tmp_path / "f.pt").write_bytes(b"not a zip at all")
    with pytest.raises(CheckpointError, match=r"f.pt: not a readable zeroshard checkpoint file"):
        files.load_torch(tmp_path / "f.pt", expected_bytes=None)
    with pytest.raises(CheckpointError, match="missing"):
        files.load_torch(tmp_path / "g.pt", expected_bytes=None)


# -- safetensors --------------------------------------------------------------------------


def tensors() -> dict[str, torch.Tensor]:
    return {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "mask": torch.tensor([True, False]),
            "i": torch.arange(6, dtype=torch.int64).view(2, 3), "empty": torch.zeros(0, 2)}


def test_safetensors_writer_streams_and_round_trips(tmp_path: Path) -> None:
    want = tensors()
    with SafetensorsWriter(tmp_path / "x.safetensors", [(k, tuple(v.shape), v.dtype) for k, v in want.items()]) as w:
        for k, v in want.items():
            w.write(k, v)
    got = read_safetensors(tmp_path / "x.safetensors")
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(AssertionError, match="expected 2 tensors, 1 written"):
        entries = [("a", (1,), torch.float32), ("b", (1,), torch.float32)]
        with SafetensorsWriter(tmp_path / "y.safetensors", entries) as w:
            w.write("a", torch.zeros(1))
    assert not (tmp_path / "y.safetensors").exists() and not (tmp_path / "y.safetensors.tmp").exists()


def test_safetensors_files_load_with_the_safetensors_package(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    want = tensors()
    with SafetensorsWriter(tmp_path / "x.safetensors", [(k, tuple(v.shape), v.dtype) for k, v in want.items()]) as w:
        for k, v in want.items():
            w.write(k, v)
    got = st.load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)


# -- data loader position -----------------------------------------------------------------


@pytest.mark.parametrize("n,world,drop_last", [(40, 2, False), (41, 3, False), (41, 3, True), (5, 4, False)])
def test_sampler_at_start_matches_torch(n: int, world: int, drop_last: bool) -> None:
    for rank in range(world):
        ours = ResumableDistributedSampler(n, rank=rank, world_size=world, shuffle=True, seed=7, drop_last=drop_last)
        theirs: DistributedSampler[int] = DistributedSampler(
            range(n), num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=drop_last)  # type: ignore[arg-type]
        ours.set_epoch(2)
        theirs.set_epoch(2)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sampler_resume_continues_the_same_sequence(world: int) -> None:
    n, batches, micro = 41, 3, 2
    for rank in range(world):
        whole = ResumableDistributedSampler(n, rank=rank, world_size=world, shuffle=True, seed=0, drop_last=False)
        resumed = ResumableDistributedSampler(n, rank=rank, world_size=world, shuffle=True, seed=0, drop_last=False)
        resumed.set_epoch(0, batches * micro * world)
        assert list(resumed) == list(whole)[batches * micro :]


@pytest.mark.parametrize("new_world", [1, 2, 3, 5])
def test_sampler_resumes_the_rest_of_the_epoch_at_another_world_size(new_world: int) -> None:
    n, start = 40, 12  # saved at world 2 after 3 micro-batches of 2
    order = list(ResumableDistributedSampler(n, rank=0, world_size=1, shuffle=True, seed=0, drop_last=False))
    got: list[list[int]] = []
    for rank in range(new_world):
        s = ResumableDistributedSampler(n, rank=rank, world_size=new_world, shuffle=True, seed=0, drop_last=False)
        s.set_epoch(0, start)
        got.append(list(s))
    assert len({len(g) for g in got}) == 1, "every rank gets as many samples"
    flat = [i for g in got for i in g]
    # every remaining sample, plus (as torch's sampler does) fewer than world_size repeats as padding
    assert set(flat) >= set(order[start:]) and 0 <= len(flat) - (n - start) < new_world


# -- command line -------------------------------------------------------------------------


def test_to_fp32_cli_reports_a_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["to-fp32", str(tmp_path / "none"), str(tmp_path / "out.pt")]) == 1
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert cli(["to-fp32", str(tmp_path), str(tmp_path / "out.pt")]) == 1
    assert "no 'latest' file" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("content", [bytes(range(256)) * 3, b"", b"\x00\x01", "global_step1\nglobal_step2".encode()])
def test_garbage_in_latest_is_named(tmp_path: Path, content: bytes) -> None:
    # A `latest` holding garbage (binary, empty, two lines) names the file, what it holds (cut to
    # 60 bytes, repr) and what a tag looks like -- on zeroshard's and DeepSpeed's loading paths.
    from zeroshard.checkpoint.ds_files import resolve_ds

    (tmp_path / files.LATEST).write_bytes(content)
    for read in (lambda: resolve(tmp_path, None), lambda: resolve_ds(tmp_path, None)):
        with pytest.raises(CheckpointError) as info:
            read()
        first = str(info.value).splitlines()[0]
        assert first.startswith(f"{tmp_path / files.LATEST}: does not hold a tag name (it holds "), first
        assert repr(content[:60]) in first and "'global_step1000'" in first and "tag=" in first, first
        if len(content) > 60:
            assert f"... ({len(content)} bytes)" in first, first


def _write_same_file(path: str, value: float) -> None:
    import torch as _t

    from zeroshard.checkpoint.files import write_atomic

    for _ in range(30):
        write_atomic(Path(path), lambda f: _t.save({"w": _t.full((256,), value)}, f), per_process_tmp=True)


def test_write_atomic_per_process_tmp_lets_ranks_write_one_file(tmp_path) -> None:
    """Every rank of a script converting a checkpoint writes the same output file: with a
    per-process temporary name no rank renames another's half-written file away."""
    import multiprocessing as mp

    import torch as _t

    out = tmp_path / "pytorch_model.bin"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_same_file, args=(str(out), float(r))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    w = _t.load(out)["w"]
    assert w.eq(w[0]).all() and w[0].item() in (0.0, 1.0)
    assert not list(tmp_path.glob("*.tmp"))
