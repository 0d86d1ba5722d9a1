"""The differential suite's comparison (tests/differential/compare.py) catches what it must.

Runs without DeepSpeed: synthetic per-step records stand in for the two engines' output.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "differential"))
from cases import BY_NAME, CASES, SAVE_AT, STEPS
from compare import compare_case, table


def _steps(loss0: float = 5.5, scale: float | None = None) -> list[dict[str, Any]]:
    return [{"step": i + 1, "loss": loss0 - 0.01 * i, "lr": [1e-3], "betas": [[0.9, 0.999]],
             "grad_norm": 1.5, "loss_scale": scale, "skipped": 0, "global_steps": i + 1}
            for i in range(STEPS)]


def _record(steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"train_batch_size": 4, "gas": 1, "steps": steps,
            "resumed": copy.deepcopy(steps[SAVE_AT:])}


W = {"wte.weight": torch.ones(3, 2)}


def test_identical_records_match() -> None:
    r = compare_case(BY_NAME["s2_fp32"], _record(_steps()), _record(_steps()), W, W)
    assert r.ok, r.problems
    assert r.loss == 0.0 and r.weights == 0.0


def test_fp32_loss_off_by_1e_4_fails_but_bf16_tolerates_it() -> None:
    zs = _record(_steps())
    zs["steps"][2]["loss"] *= 1 + 1e-4
    assert not compare_case(BY_NAME["s2_fp32"], zs, _record(_steps()), W, W).ok
    assert compare_case(BY_NAME["s2_bf16"], zs, _record(_steps()), W, W).ok


def test_lr_grad_norm_scale_skips_weights_and_resume_are_each_checked() -> None:
    base = _record(_steps(scale=65536.0))
    for mutate, word in [
        (lambda r: r["steps"][1]["lr"].__setitem__(0, 1.1e-3), "lr"),
        (lambda r: r["steps"][1].__setitem__("grad_norm", 1.6), "grad norm"),
        (lambda r: r["steps"][0].__setitem__("loss_scale", 32768.0), "loss_scale"),
        (lambda r: r["steps"][0].__setitem__("skipped", 1), "skipped"),
        (lambda r: r["resumed"][0].__setitem__("loss", 9.0), "resumed"),
    ]:
        zs = copy.deepcopy(base)
        mutate(zs)
        r = compare_case(BY_NAME["s2_fp16"], zs, base, W, W)
        assert not r.ok and any(word in p for p in r.problems), (word, r.problems)
    r = compare_case(BY_NAME["s2_fp32"], _record(_steps()), _record(_steps()),
                     {"wte.weight": W["wte.weight"] + 1e-3}, W)
    assert not r.ok and "weights" in r.problems[0]


def test_fp16_is_compared_up_to_the_first_growth_step() -> None:
    ds = _record(_steps(scale=65536.0))
    for s in ds["steps"][3:]:
        s["loss_scale"] = 131072.0
    ds["resumed"] = copy.deepcopy(ds["steps"][SAVE_AT:])
    zs = copy.deepcopy(ds)
    zs["steps"][4]["loss"] += 0.1  # after the growth step (index 3): not compared
    r = compare_case(BY_NAME["s2_fp16_growth"], zs, ds, None, None)
    assert r.ok, r.problems
    zs["steps"][3]["loss"] += 0.1  # the growth step itself: compared
    assert not compare_case(BY_NAME["s2_fp16_growth"], zs, ds, None, None).ok


def test_errors_and_missing_records_fail_and_the_table_says_so() -> None:
    r = compare_case(BY_NAME["s2_fp32"], {"error": "ConfigError: x"}, None, None, None)
    assert not r.ok and len(r.problems) == 2
    text = table([r])
    assert "| s2_fp32 | fp32 |" in text and "FAIL" in text


def test_case_names_are_unique_and_references_exist() -> None:
    assert len({c.name for c in CASES}) == len(CASES)
    for c in CASES:
        assert c.ds_reference is None or c.ds_reference in BY_NAME
