"""`deepspeed.sequence.layer` (DeepSpeed-Ulysses), `deepspeed.runtime.sequence_parallel.parallel_state_sp`
(ALST's mpu) and `deepspeed.utils.groups`' sequence-parallel getters served by the `deepspeed` alias from
zeroshard.sequence, with DeepSpeed 0.19.8's signatures where DeepSpeed is installed. The numerics are
tests/dist/test_ulysses.py's and tests/dist/test_sequence_parallel.py's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from signatures import assert_same_signature

ALIAS_PROBE = """
import json
import deepspeed
from deepspeed.sequence.layer import DistributedAttention, apply_rotary_pos_emb
from deepspeed.runtime.sequence_parallel import parallel_state_sp, ulysses_sp
import zeroshard.sequence.alst as alst
import zeroshard.sequence.tiled as tiled
from deepspeed.utils import groups
import zeroshard.sequence.ulysses as ours
import zeroshard.sequence.parallel_state as state
import zeroshard.compat.ds_groups as ds_groups
print("PROBE" + json.dumps({"file": deepspeed.__file__,
                            "same": [DistributedAttention is ours.DistributedAttention,
                                     apply_rotary_pos_emb is ours.apply_rotary_pos_emb,
                                     parallel_state_sp.initialize_sequence_parallel
                                     is state.initialize_sequence_parallel,
                                     parallel_state_sp.get_model_parallel_group is state.get_sequence_parallel_group,
                                     groups._get_sequence_data_parallel_group
                                     is ds_groups._get_sequence_data_parallel_group,
                                     ulysses_sp.UlyssesSPAttentionHF is alst.UlyssesSPAttentionHF,
                                     ulysses_sp.UlyssesSPDataLoaderAdapter is alst.UlyssesSPDataLoaderAdapter,
                                     ulysses_sp.TiledMLP is tiled.TiledMLP,
                                     ulysses_sp.TiledFusedLogitsLoss is tiled.TiledFusedLogitsLoss,
                                     ulysses_sp.sequence_tiled_compute is tiled.sequence_tiled_compute],
                            "no_sp": [groups._get_sequence_parallel_world_size(),
                                      groups._get_sequence_parallel_rank()]}))
"""


def test_alias_serves_distributed_attention() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    env.update(ZEROSHARD_AS_DEEPSPEED="1", ZEROSHARD_ALIAS_QUIET="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-c", ALIAS_PROBE], env=env, text=True, capture_output=True,
                          timeout=180, cwd="/")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE"))[5:])
    assert "compat/alias" in out["file"], out["file"]
    assert out["same"] == [True] * 10
    assert out["no_sp"] == [1, 0]  # without sequence parallelism, as DeepSpeed answers


SIGNATURES = [(f"zeroshard.sequence.ulysses:{name}", f"deepspeed.sequence.layer:{name}") for name in (
    "DistributedAttention.__init__", "DistributedAttention.forward", "apply_rotary_pos_emb")] + [
    (f"zeroshard.sequence.parallel_state:{name}", f"deepspeed.runtime.sequence_parallel.parallel_state_sp:{name}")
    for name in ("initialize_sequence_parallel", "get_sequence_parallel_group", "get_sequence_data_parallel_group",
                 "get_sequence_parallel_world_size", "get_sequence_data_parallel_world_size",
                 "get_sequence_parallel_rank", "get_sequence_data_parallel_rank")] + [
    (f"zeroshard.compat.ds_groups:{name}", f"deepspeed.utils.groups:{name}")
    for name in ("_get_sequence_parallel_group", "_get_sequence_parallel_world_size", "_get_sequence_parallel_rank",
                 "_get_sequence_data_parallel_group", "_get_sequence_data_parallel_world_size",
                 "_get_sequence_data_parallel_rank")] + [
    (f"zeroshard.sequence.{module}:{name}", f"deepspeed.runtime.sequence_parallel.ulysses_sp:{name}")
    for module, name in (("alst", "UlyssesSPAttentionHF.__init__"), ("alst", "UlyssesSPAttentionHF.forward"),
                         ("alst", "UlyssesSPAttentionHF.register_with_transformers"),
                         ("alst", "UlyssesSPDataLoaderAdapter.__init__"), ("tiled", "sequence_tiled_compute"))]


@pytest.mark.parametrize(("ours", "theirs"), SIGNATURES, ids=[s[0].rpartition(":")[2] for s in SIGNATURES])
def test_signature_matches_deepspeed(ours: str, theirs: str) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    assert_same_signature(ours, theirs, kinds=True)
