"""Compare the records of the two engines case by case, and render the table.

Per optimizer step: loss (relative, LOSS_TOL by precision), lr and betas/momentum (absolute,
LR_TOL), pre-clip global grad norm (relative, LOSS_TOL; DeepSpeed reports none at stage 0
without mixed precision, and the table says so), fp16 loss scale and skipped-step count
(exact). fp16 runs are compared up to and including the first loss-scale growth step: on that
step DeepSpeed unscales with the already doubled scale (docs/deepspeed-differences.md,
"Differential test suite"), so later steps are not expected to agree. Then the final fp32
master weights (max abs, WEIGHT_TOL), and the resumed run (fresh engine, load the step-SAVE_AT
checkpoint, continue) against DeepSpeed's uninterrupted run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cases import LOSS_TOL, LR_TOL, SAVE_AT, WEIGHT_TOL, Case
from torch import Tensor


@dataclass
class Result:
    case: Case
    loss: float = 0.0
    """Max relative loss deviation over the compared steps."""
    norm: float | None = None
    lr: float = 0.0
    weights: float | None = None
    resume: float = 0.0
    steps_compared: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def status(self) -> str:
        if self.case.xfail:
            return "xfail (expected)" if not self.ok else "XPASS: matches now, remove xfail"
        return "ok" if self.ok else "FAIL"


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _flat(values: Any) -> list[float]:
    if values is None:
        return []
    if isinstance(values, (int, float)):
        return [float(values)]
    return [v for item in values for v in _flat(item)]


def _groups_dev(zs: list[Any], ds: list[Any]) -> float:
    """lr / betas per param group; group counts may differ, so compare the distinct values."""
    a = sorted(set(_flat(zs)))
    b = sorted(set(_flat(ds)))
    if len(a) != len(b):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def _first_growth(steps: list[dict[str, Any]]) -> int | None:
    """Index of the first step whose loss scale is larger than the step before's."""
    for i in range(1, len(steps)):
        prev, cur = steps[i - 1]["loss_scale"], steps[i]["loss_scale"]
        if prev is not None and cur is not None and cur > prev:
            return i
    return None


def compare_steps(res: Result, zs: list[dict[str, Any]], ds: list[dict[str, Any]], what: str,
                  tol: float) -> float:
    """Compare two step-record lists; returns the max relative loss deviation."""
    if len(zs) != len(ds):
        res.problems.append(f"{what}: {len(zs)} steps vs DeepSpeed's {len(ds)}")
        return math.inf
    worst = 0.0
    for z, d in zip(zs, ds):
        step = d["step"]
        dev = _rel(z["loss"], d["loss"])
        worst = max(worst, dev)
        if dev > tol:
            res.problems.append(f"{what} step {step}: loss {z['loss']:.8g} vs {d['loss']:.8g} (rel {dev:.1e})")
        for key in ("lr", "betas"):
            g = _groups_dev(z[key], d[key])
            res.lr = max(res.lr, g)
            if g > LR_TOL:
                res.problems.append(f"{what} step {step}: {key} {z[key]} vs {d[key]}")
        if d["grad_norm"] is not None and z["grad_norm"] is not None:
            if isinstance(d["grad_norm"], str) or isinstance(z["grad_norm"], str):
                if d["grad_norm"] != z["grad_norm"]:
                    res.problems.append(f"{what} step {step}: grad norm {z['grad_norm']} vs {d['grad_norm']}")
            else:
                n = _rel(z["grad_norm"], d["grad_norm"])
                res.norm = max(res.norm or 0.0, n)
                if n > tol:
                    res.problems.append(f"{what} step {step}: grad norm {z['grad_norm']:.8g} vs "
                                        f"{d['grad_norm']:.8g} (rel {n:.1e})")
        for key in ("loss_scale", "skipped", "global_steps"):
            if z[key] != d[key]:
                res.problems.append(f"{what} step {step}: {key} {z[key]} vs {d[key]}")
    return worst


def compare_weights(res: Result, zs: dict[str, Tensor] | None, ds: dict[str, Tensor] | None) -> None:
    if not zs or not ds:
        res.problems.append("final fp32 weights missing")
        return
    missing = sorted(set(ds) - set(zs))
    if missing:
        res.problems.append(f"final weights: zeroshard lacks {missing[:3]}")
    worst = 0.0
    for name in set(ds) & set(zs):
        if zs[name].shape != ds[name].shape:
            res.problems.append(f"final weights: {name} shape {tuple(zs[name].shape)} vs {tuple(ds[name].shape)}")
            continue
        worst = max(worst, float((zs[name] - ds[name]).abs().max()))
    res.weights = worst
    tol = WEIGHT_TOL[res.case.precision]
    if worst > tol:
        res.problems.append(f"final fp32 weights: max abs deviation {worst:.1e} > {tol:g}")


def compare_case(case: Case, zs: dict[str, Any] | None, ds: dict[str, Any] | None,
                 zs_w: dict[str, Tensor] | None, ds_w: dict[str, Tensor] | None,
                 ds_own: dict[str, Any] | None = None) -> Result:
    """`ds` is DeepSpeed's record to match: its run of `case`, or of `case.ds_reference`
    (then `ds_own` is its run of `case`, whose distance from the reference is noted)."""
    res = Result(case)
    if case.ds_reference and ds_own and ds and "error" not in ds_own and "error" not in ds:
        res.notes.append(f"compared with DeepSpeed's {case.ds_reference} (its own {case.name} is "
                         f"{_dev_list(ds_own['steps'], ds['steps']):.1e} rel off that, a DeepSpeed defect)")
    for who, rec in (("zeroshard", zs), ("DeepSpeed", ds)):
        if rec is None:
            res.problems.append(f"{who}: no record (job died or timed out)")
        elif "error" in rec:
            res.problems.append(f"{who}: {rec['error']}")
    if not res.ok:
        return res
    assert zs is not None and ds is not None
    for key in ("train_batch_size", "gas"):
        if zs[key] != ds[key]:
            res.problems.append(f"{key}: {zs[key]} vs DeepSpeed's {ds[key]}")
    tol = LOSS_TOL[case.precision]
    zs_steps, ds_steps, zs_res = zs["steps"], ds["steps"], zs["resumed"]
    ds_res = ds["resumed"]
    growth = _first_growth(ds_steps) if case.precision == "fp16" else None
    if growth is not None:
        res.notes.append(f"compared up to the first loss-scale growth (step {growth + 1})")
        zs_steps, ds_steps = zs_steps[: growth + 1], ds_steps[: growth + 1]
        keep = max(0, growth + 1 - SAVE_AT)
        zs_res, ds_res = zs_res[:keep], ds_res[:keep]
    res.steps_compared = len(ds_steps)
    res.loss = compare_steps(res, zs_steps, ds_steps, "train", tol)
    ds_after = ds_steps[SAVE_AT:]
    res.resume = compare_steps(res, zs_res, ds_after, "resumed", tol)
    if _dev_list(ds_res, ds_after) > tol:
        res.notes.append(f"DeepSpeed's own resume deviates from its uninterrupted run "
                         f"(rel {_dev_list(ds_res, ds_after):.1e})")
    if growth is None:
        compare_weights(res, zs_w, ds_w)
    if all(s["grad_norm"] is None for s in ds_steps):
        res.notes.append("DeepSpeed reports no grad norm here")
    return res


def _dev_list(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    if len(a) != len(b):
        return math.inf
    return max((_rel(x["loss"], y["loss"]) for x, y in zip(a, b)), default=0.0)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1e}"


def table(results: list[Result]) -> str:
    """Markdown table: case | precision | max deviation (loss, grad norm, lr/betas, weights,
    resumed loss) | status, then the problems and notes of each case that has any."""
    head = ("| case | prec | loss (rel) | grad norm (rel) | lr/betas (abs) | fp32 weights (abs) "
            "| resumed loss (rel) | status |")
    lines = [head, "|" + "---|" * 8]
    for r in results:
        lines.append(f"| {r.case.name} | {r.case.precision} | {_fmt(r.loss)} | {_fmt(r.norm)} | "
                     f"{_fmt(r.lr)} | {_fmt(r.weights)} | {_fmt(r.resume)} | {r.status} |")
    by_prec: dict[str, list[Result]] = {}
    for r in results:
        by_prec.setdefault(r.case.precision, []).append(r)
    lines.append("")
    for prec, rs in by_prec.items():
        good = [r for r in rs if r.ok]
        worst_loss = max((r.loss for r in good), default=0.0)
        worst_w = max((r.weights or 0.0 for r in good), default=0.0)
        lines.append(f"{prec}: {len(rs)} cases, {len(good)} match; over those, max loss deviation "
                     f"{worst_loss:.1e} (rel), max fp32 weight deviation {worst_w:.1e} (abs)")
    for r in results:
        for p in r.problems[:6]:
            lines.append(f"  {r.case.name}: {p}")
        if r.case.xfail:
            lines.append(f"  {r.case.name}: expected to deviate: {r.case.xfail}")
        for n in r.notes:
            lines.append(f"  {r.case.name}: note: {n}")
    return "\n".join(lines)
