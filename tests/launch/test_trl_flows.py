"""TRL's GRPO and DPO trainers (tests/launch/scripts/trl_flow.py) through the `deepspeed` alias at 2
ranks: ZeRO-3 (TRL's reference model through `prepare_deepspeed`, GRPO's generation with the ZeRO-3
hooks removed and put back) equals ZeRO-0 step by step, and, where a real DeepSpeed 0.19 is installed
(opt-in, marked `deepspeed`), equals DeepSpeed's run. TRL is not a zeroshard dependency: without it
these tests skip, saying so."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_hf_flows import HAS_DEEPSPEED, SCRIPTS, relative, run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="TRL is not installed (pip install trl): the real-client flows need it")

# fp32 at 2 ranks: ZeRO-0 and ZeRO-3 (and DeepSpeed) reduce the same gradients in another order, so the
# logged values differ by fp32 round-off amplified over 3 Adam steps; measured by hand against DeepSpeed
# 0.19.8: losses, rewards and KL bitwise equal, grad_norm within 4e-8 relative. 1e-5 leaves room for a
# busy machine's other gloo chunking and stays far below a defect (a skipped step moves the loss ~1e-3).
TOL = 1e-5
KEYS = ("loss", "grad_norm", "reward", "kl", "rewards/chosen", "rewards/margins")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trl") / "tiny"
    subprocess.run([sys.executable, str(SCRIPTS / "trl_flow.py"), "--make-model", str(path)], check=True,
                   capture_output=True, timeout=300)
    return path


def flow(tmp: Path, model: Path, engine: str, name: str, stage: int) -> list[dict[str, Any]]:
    results = tmp / f"{engine}-{name}-{stage}.json"
    run([str(SCRIPTS / "trl_flow.py"), "--flow", name, "--stage", str(stage), "--model", str(model),
         "--out", str(tmp / f"out-{engine}-{name}-{stage}"), "--results", str(results)], engine, tmp, 2,
        label=f"trl {name} zero{stage}")
    return json.loads(results.read_text())


def assert_same(a: list[dict[str, Any]], b: list[dict[str, Any]], what: str) -> None:
    assert len(a) == len(b) == 3, what
    for x, y in zip(a, b):
        for key in KEYS:
            if key in x:
                assert relative(x[key], y[key]) <= TOL or abs(x[key] - y[key]) <= 1e-9, (what, key, x, y)


@pytest.mark.parametrize("name", ["grpo", "dpo"])
def test_trl_zero3_equals_zero0_world2(tmp_path: Path, model: Path, name: str) -> None:
    zero3, zero0 = flow(tmp_path, model, "zeroshard", name, 3), flow(tmp_path, model, "zeroshard", name, 0)
    assert_same(zero3, zero0, f"{name}: ZeRO-3 vs ZeRO-0")
    assert any(x["loss"] != 0 for x in zero3), zero3  # the run trained (GRPO's first loss is 0 by construction)


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed 0.19 (the [bench] extra)")
@pytest.mark.parametrize("name", ["grpo", "dpo"])
def test_trl_zero3_equals_deepspeed_world2(tmp_path: Path, model: Path, name: str) -> None:
    assert_same(flow(tmp_path, model, "zeroshard", name, 3), flow(tmp_path, model, "deepspeed", name, 3),
                f"{name}: zeroshard vs DeepSpeed 0.19")
