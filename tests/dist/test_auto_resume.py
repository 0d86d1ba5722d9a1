"""Auto-resume (issue 42) inside one process group (world 1, 2, 3), ZeRO 2 and 3, fp32.

One uninterrupted run per stage saves at steps 2 and 4 and records its per-step losses. Each case
copies those checkpoints, damages step 4 in one way (or not), and a fresh engine with
`checkpoint.auto_resume_dir` must pick step 2 with a warning naming the tag and the problem (step 4
when intact), then train with the uninterrupted run's losses (data loader position and dropout
RNG restored). `latest` names step 4 throughout: it must not win when step 4 is damaged.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import TINY, capture_zeroshard_log, make_config

import zeroshard
from zeroshard.checkpoint.files import LATEST, MANIFEST, MODEL_FILE, optim_file, rng_file
from zeroshard.checkpoint.verify import verify
from zeroshard.comm import Comm
from zeroshard.errors import CheckpointError
from zeroshard.examples.gpt import GPT, GPTConfig

STEPS = 6
SAVES = (2, 4)


def config(stage: int, **checkpoint: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:  # the tiny model's tensors are small: partition those above 100 elements
        zero["stage3_param_persistence_threshold"] = 100
    extra = {"checkpoint": checkpoint} if checkpoint else {}
    return make_config(gradient_clipping=0.5, zero_optimization=zero, **extra)


def dataset() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY.vocab_size, (40, TINY.block_size + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def build(cfg: dict[str, Any], seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY.__dict__, "dropout": 0.1}))
    engine, _, loader, _ = zeroshard.initialize(model=model, training_data=dataset(), config=cfg)
    return engine, loader


def train(engine: Any, loader: Any, steps: int, save_dir: Path | None = None) -> list[float]:
    losses, it = [], iter(loader)
    for _ in range(steps):
        x, y = next(it)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save_dir is not None and engine.global_steps in SAVES:
            engine.save_checkpoint(save_dir)
    return losses


@pytest.fixture(scope="module")
def references(comm: Comm) -> Iterator[dict[int, tuple[Path, list[float]]]]:
    """Per stage: a directory with the uninterrupted run's checkpoints, and its per-step losses."""
    token = torch.tensor([int.from_bytes(os.urandom(4), "little") >> 1 if comm.rank == 0 else 0])
    comm.broadcast(token, src=0)
    root = Path(tempfile.gettempdir()) / f"zeroshard-auto_resume-ref-{int(token.item())}"
    refs: dict[int, tuple[Path, list[float]]] = {}
    for stage in (2, 3):
        engine, loader = build(config(stage), seed=0)
        torch.manual_seed(100 + comm.rank)
        refs[stage] = (root / f"s{stage}", train(engine, loader, STEPS, save_dir=root / f"s{stage}"))
    yield refs
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def _truncate(tag: Path, world: int) -> str:
    path = tag / optim_file(0)
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return f"{optim_file(0)} is {size // 2} bytes, the manifest says {size} (truncated or replaced after the save)"


def _flip(tag: Path, world: int) -> str:
    path = tag / MODEL_FILE
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return f"{MODEL_FILE} has checksum crc32:"


def _no_manifest(tag: Path, world: int) -> str:
    (tag / MANIFEST).unlink()
    return f"no {MANIFEST} (the manifest is written last: the save did not finish, or it was removed)"


def _rank_file_gone(tag: Path, world: int) -> str:
    (tag / rng_file(world - 1)).unlink()
    return f"{rng_file(world - 1)} is missing"


def _no_checksums(tag: Path, world: int) -> str:
    """A checkpoint of an older zeroshard: sizes only, loads without a word."""
    manifest = json.loads((tag / MANIFEST).read_text())
    del manifest["checksums"]
    (tag / MANIFEST).write_text(json.dumps(manifest))
    return ""


CASES: dict[str, Callable[[Path, int], str] | None] = {
    "intact": None, "old-manifest-no-checksums": _no_checksums, "truncated": _truncate, "flipped-bytes": _flip,
    "manifest-deleted": _no_manifest, "rank-file-deleted": _rank_file_gone,
}


def _copy(comm: Comm, src: Path, dst: Path, damage: Callable[[Path, int], str] | None) -> str:
    expected = ""
    if comm.rank == 0:
        shutil.copytree(src, dst)
        if damage is not None:
            expected = damage(dst / "global_step4", comm.world_size)
    comm.barrier()
    return expected


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
@pytest.mark.parametrize("case", list(CASES))
def test_auto_resume_skips_damaged_newest(comm: Comm, shared_dir: Path, references: Any, stage: int,
                                          case: str) -> None:
    src, want = references[stage]
    expected = _copy(comm, src, shared_dir, CASES[case])
    assert (shared_dir / LATEST).read_text().strip() == "global_step4"  # `latest` names the damaged one
    with capture_zeroshard_log() as log:
        engine, loader = build(config(stage, auto_resume_dir=str(shared_dir)), seed=12)
    resumed_at = 4 if case in ("intact", "old-manifest-no-checksums") else 2
    assert engine.global_steps == resumed_at, log.getvalue()
    warnings = [line for line in log.getvalue().splitlines() if line.startswith("auto-resume: skipping")]
    if comm.rank == 0:
        if resumed_at == 2:
            assert warnings == [f"auto-resume: skipping checkpoint {shared_dir / 'global_step4'}: {expected}"] or (
                case == "flipped-bytes" and len(warnings) == 1 and expected in warnings[0]
                and "the manifest says crc32:" in warnings[0]), log.getvalue()
        else:
            assert warnings == [], log.getvalue()
        assert f"auto-resume: resumed from {shared_dir / f'global_step{resumed_at}'}" in log.getvalue()
    got = train(engine, loader, STEPS - resumed_at)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want[resumed_at:], dtype=torch.float64), rtol=1e-6, atol=0)


def test_verify_names_each_problem(comm: Comm, shared_dir: Path, references: Any) -> None:
    src, _ = references[2]
    _copy(comm, src, shared_dir, None)
    tag = shared_dir / "global_step2"
    assert verify(tag) == []
    comm.barrier()  # every rank has read the intact files before rank 0 damages one
    if comm.rank == 0:
        _flip(tag, comm.world_size)
        problems = verify(tag)
        assert len(problems) == 1 and problems[0].startswith(f"{MODEL_FILE} has checksum crc32:"), problems
        assert verify(shared_dir / "nothing-here") == [f"no {MANIFEST} (the manifest is written last: the save "
                                                       "did not finish, or it was removed)"]
    comm.barrier()


def test_explicit_api_and_fresh_start(comm: Comm, shared_dir: Path, references: Any) -> None:
    src, want = references[2]
    engine, loader = build(config(2), seed=12)
    with capture_zeroshard_log() as log:
        assert engine.auto_resume(shared_dir / "empty") == (None, None)  # nothing saved yet: fresh start
    if comm.rank == 0:
        assert f"auto-resume: no complete, verified checkpoint in {shared_dir / 'empty'}; training starts fresh" \
            in log.getvalue()
    assert engine.global_steps == 0
    _copy(comm, src, shared_dir / "ckpt", _rank_file_gone)
    path, _ = engine.auto_resume(shared_dir / "ckpt")
    assert path == str(shared_dir / "ckpt" / "global_step2") and engine.global_steps == 2
    got = train(engine, loader, STEPS - 2)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want[2:], dtype=torch.float64),
                               rtol=1e-6, atol=0)
    # Another global batch is refused by name, with the gradient accumulation that keeps it.
    other, _ = build(make_config(gradient_accumulation_steps=2, zero_optimization={"stage": 2}), seed=12)
    with pytest.raises(CheckpointError, match="train_batch_size .* Set gradient_accumulation_steps to 1"):
        other.auto_resume(shared_dir / "ckpt")
