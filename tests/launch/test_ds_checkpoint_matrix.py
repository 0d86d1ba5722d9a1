"""The generated DeepSpeed-checkpoint matrix (issue 24 item 1): real DeepSpeed 0.19 writes every
case of scripts/ds_matrix_common.py (parameter sets with odd, prime and tiny sizes and a
parameter across each partition boundary; frozen and tied parameters, two groups, round-robin
gradients; worlds 2, 3, 4; stages 1-3; fp32/bf16/fp16; CPU offload on half), and zeroshard loads
each at worlds 1, 2 and 3 into every stage and continues with DeepSpeed's losses (fp32 1e-5,
bf16/fp16 2e-3). Also: tests/unit/ds_layout.py's layout rules (the in-suite writer CI uses) equal
what DeepSpeed wrote, file by file, for every stage-1/2 case.

Opt-in (marker `deepspeed`; `python tests/run.py --deepspeed`). The full matrix is 108 DeepSpeed
checkpoints and 1296 loads; ZEROSHARD_DS_MATRIX=<regex> runs the cases whose name matches.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torchrun_cmd import job_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from ds_matrix_common import WORLDS, all_cases, make_model, model_parameters, parse  # noqa: E402  after the sys.path insert

pytestmark = [pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="DeepSpeed is not installed (optional: pip install deepspeed==0.19.8)")]

CASES = [c for c in all_cases() if re.search(os.environ.get("ZEROSHARD_DS_MATRIX", ""), c)]


def _env() -> dict[str, str]:
    return job_env(ROOT, deepspeed=True)


def _run(nproc: int, script: str, *args: str, timeout_s: int = 3600) -> str:
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                 "--local-ranks-filter=0"])
    proc = subprocess.run([*launcher, str(SCRIPTS / script), *args], cwd=ROOT, env=_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"{script} at {nproc} ranks exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc.stdout


@pytest.fixture(scope="session")
def ds_matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("ds_matrix")
    for world in WORLDS:
        cases = [c for c in CASES if parse(c)[1] == world]
        if cases:
            out = _run(world, "ds_matrix_gen.py", str(root), *cases)
            missing = [c for c in cases if f"DS MATRIX OK {c}" not in out]
            assert not missing, f"DeepSpeed could not write {missing}:\n{out[-6000:]}"
    yield root


def test_layout_writer_follows_deepspeeds_files(ds_matrix: Path) -> None:
    from ds_layout import plan

    from zeroshard.checkpoint.ds_files import address, load_ds

    checked = 0
    for case in CASES:
        _, world, stage, precision, _ = parse(case)
        if stage == 3:
            continue
        model = make_model(case)
        groups = model_parameters(model, case)
        groups = groups if isinstance(groups[0], dict) else [{"params": groups}]
        names = {id(p): n for n, p in model.named_parameters()}
        ckpt = next((ds_matrix / case).glob("global_step*"))
        saved = load_ds(ckpt / "mp_rank_00_model_states.pt")
        cfg = saved["ds_config"]["zero_optimization"]
        p = plan([[(names[id(t)], t.numel()) for t in g["params"]] for g in groups], world,
                 round_robin=bool(cfg.get("round_robin_gradients")))
        assert [list(s) for s in saved["param_shapes"]] == p.flat_order, case
        for r in range(world):
            osd = load_ds(next(ckpt.glob(f"*zero_pp_rank_{r}_mp_rank_00_optim_states.pt")))["optimizer_state_dict"]
            assert [t.numel() for t in osd["single_partition_of_fp32_groups"]] == p.ranks[r].lean_numel, (case, r)
            assert list(osd["group_paddings"]) == p.ranks[r].group_paddings, (case, r)
            assert [{n: address(a) for n, a in m.items()} for m in osd["param_slice_mappings"]] \
                == p.ranks[r].mappings, (case, r)
            state = osd["base_optimizer_state"]["state"]
            assert [state[g]["exp_avg"].numel() for g in range(len(groups))] == p.partition, (case, r)
        checked += 1
    print(f"layout writer checked against {checked} DeepSpeed ZeRO-1/2 checkpoints")
    assert checked > 0 or not any(parse(c)[2] < 3 for c in CASES)


def test_every_case_loads_at_world_1_2_3_into_every_stage(ds_matrix: Path) -> None:
    lines = []
    for world in (1, 2, 3):
        out = _run(world, "ds_matrix_load.py", str(ds_matrix), "0,1,2,3", *CASES)
        lines += [line for line in out.splitlines() if line.startswith("DSMATRIX")]
    print("\n".join(lines))
    failed = [line for line in lines if not line.startswith("DSMATRIX OK")]
    assert not failed, "\n".join(failed)
    for case in CASES:
        for world in (1, 2, 3):
            for stage in range(4):
                assert any(line.startswith(f"DSMATRIX OK {case} -> stage {stage} world {world}:") for line in lines), \
                    (case, stage, world)
    devs = [float(line.rsplit(" ", 1)[1]) for line in lines]
    print(f"{len(CASES)} cases x 3 worlds x 4 stages = {len(devs)} loads, max |dloss| {max(devs):.3e}")
    assert torch.isfinite(torch.tensor(devs)).all()
