"""`deepspeed.sequence.layer` (DeepSpeed-Ulysses) served by the `deepspeed` alias from zeroshard.sequence,
with DeepSpeed 0.19.8's signatures where DeepSpeed is installed. The numerics are tests/dist/test_ulysses.py's."""

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
import zeroshard.sequence.ulysses as ours
print("PROBE" + json.dumps({"file": deepspeed.__file__,
                            "same": [DistributedAttention is ours.DistributedAttention,
                                     apply_rotary_pos_emb is ours.apply_rotary_pos_emb]}))
"""


def test_alias_serves_distributed_attention() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    env.update(ZEROSHARD_AS_DEEPSPEED="1", ZEROSHARD_ALIAS_QUIET="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-c", ALIAS_PROBE], env=env, text=True, capture_output=True,
                          timeout=180, cwd="/")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE"))[5:])
    assert "compat/alias" in out["file"], out["file"]
    assert out["same"] == [True, True]


SIGNATURES = [(f"zeroshard.sequence.ulysses:{name}", f"deepspeed.sequence.layer:{name}") for name in (
    "DistributedAttention.__init__", "DistributedAttention.forward", "apply_rotary_pos_emb")]


@pytest.mark.parametrize(("ours", "theirs"), SIGNATURES, ids=[s[0].rpartition(":")[2] for s in SIGNATURES])
def test_signature_matches_deepspeed(ours: str, theirs: str) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    assert_same_signature(ours, theirs, kinds=True)
