"""DeepSpeed 0.19.8's legacy MoE checkpoint files, read without DeepSpeed: the committed fixture
(tests/unit/fixtures/ds_moe, written by real DeepSpeed at 2 ranks and ep_size 2, ZeRO 0 and 2;
see make_ds_moe_fixture.py) is read back under global expert ids, and every weight, fp32 master
and Adam moment equals what the fixture's own files hold for that id (`expected` reads them
directly, by DeepSpeed's documented layout, independently of zeroshard's reader).
tests/dist/test_moe.py loads the same fixture into an engine; tests/launch/test_ds_moe_checkpoint.py
continues training from real DeepSpeed saves (opt-in)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import Tensor

from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zeroshard.checkpoint.ds_files import address, load_ds
from zeroshard.checkpoint.ds_import import DeepSpeedReader, read_layout
from zeroshard.errors import CheckpointError

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_moe"
EP, LOCAL = 2, 2
EXPERT = re.compile(r"^(?P<prefix>.+\.deepspeed_experts)\.(?P<j>\d+)\.(?P<rest>.+)$")


def _load(path: Path) -> dict:
    return load_ds(path)  # torch.load with stand-ins for DeepSpeed's pickled classes (no DeepSpeed here)


def _global(name: str, ep_rank: int) -> str:
    m = EXPERT.match(name)
    return name if m is None else f"{m['prefix']}.{ep_rank * LOCAL + int(m['j'])}.{m['rest']}"


def expected(stage: int, root: Path = FIXTURE) -> dict[str, dict[str, Tensor]]:
    """Global name -> {"weight", "master", "exp_avg", "exp_avg_sq"} straight from the fixture's files
    (of `root`: another save of make_ds_moe_fixture.py, e.g. at 4 ranks)."""
    tag = root / f"s{stage}" / "global_step1"
    model = _load(tag / "mp_rank_00_model_states.pt")
    weights = dict(model["module"])
    for f in sorted(tag.glob("layer_*_expert_*_mp_rank_00_model_states.pt")):
        weights |= _load(f)
    out: dict[str, dict[str, list[Tensor]]] = {n: {"weight": [w]} for n, w in weights.items()}
    for r in range(EP if stage == 0 else model["dp_world_size"]):
        if stage == 0:  # the torch state dict of expert-parallel rank r: dense parameters, then its experts
            state = _load(tag / f"expp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer"]["state"]
            names = list(model["module"]) + [n for n in weights if EXPERT.match(n)
                                             and int(EXPERT.match(n)["j"]) // LOCAL == r]
            for k, n in enumerate(names):
                entry = out[n]
                if len(entry) == 1:  # every expp file holds the dense state: take the first
                    entry |= {"master": [weights[n].reshape(-1)], "exp_avg": [state[k]["exp_avg"].reshape(-1)],
                              "exp_avg_sq": [state[k]["exp_avg_sq"].reshape(-1)]}
            continue
        osd = _load(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            moe = osd["base_optimizer_state"]["param_groups"][g].get("moe", False)
            for local, addr in mapping.items():
                start, numel = address(addr)
                n, sl = _global(local, r % EP) if moe else local, slice(start, start + numel)
                entry = out[n]
                entry.setdefault("master", []).append(osd["single_partition_of_fp32_groups"][g][sl])
                for key in ("exp_avg", "exp_avg_sq"):  # a parameter's pieces, in rank order
                    entry.setdefault(key, []).append(osd["base_optimizer_state"]["state"][g][key][sl])
    return {n: {k: torch.cat([t.reshape(-1) for t in v]) for k, v in e.items()} for n, e in out.items()}


@pytest.mark.parametrize("stage", [0, 2])
def test_every_expert_reads_back_by_global_id(stage: int) -> None:
    want = expected(stage)
    assert sum(1 for n in want if EXPERT.match(n)) == 4  # experts 0-3, one weight each
    layout = read_layout(FIXTURE / f"s{stage}" / "global_step1", None)
    assert layout.experts is not None and layout.experts.ep_size == EP
    reader = DeepSpeedReader(layout)
    assert {p.name for p in layout.manifest.params} == set(want)
    index = reader.master_index()
    for name, e in want.items():
        numel = e["weight"].numel()
        assert torch.equal(reader.weights(name, 0, numel, torch.float32), e["weight"]), name
        master, state = reader.masters(index, name, 0, numel)
        assert torch.equal(master, e["master"]), name
        assert torch.equal(state["exp_avg"], e["exp_avg"]) and torch.equal(state["exp_avg_sq"], e["exp_avg_sq"]), name
        assert float(state["step"]) == 1.0
    assert reader.file("mp_rank_00_model_states.pt")["global_steps"] == 1
    reader.close()
    consolidated = get_fp32_state_dict_from_zero_checkpoint(FIXTURE / f"s{stage}")
    assert set(consolidated) == set(want)
    assert all(torch.equal(consolidated[n].reshape(-1), e["master"]) for n, e in want.items())


def test_a_missing_expert_file_is_refused_by_name(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE / "s2", tmp_path / "s2")
    (tmp_path / "s2" / "global_step1" / "layer_0_expert_2_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"\[4\] experts per MoE layer.*\{0: 3\}"):
        read_layout(tmp_path / "s2" / "global_step1", None)


def test_an_autoep_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE / "s0", tmp_path / "s0")
    path = tmp_path / "s0" / "global_step1" / "mp_rank_00_model_states.pt"
    torch.save({**torch.load(path, weights_only=True), "ds_autoep_layers": [{"moe_layer_id": 0}]}, path)
    with pytest.raises(CheckpointError, match="AutoEP"):
        read_layout(tmp_path / "s0" / "global_step1", None)
