"""The issue-10 table: each Hugging Face flow on zeroshard (the `deepspeed` alias) and on DeepSpeed 0.19.8.

Runs tests/launch/test_hf_flows.py::TestAgainstDeepSpeed (real DeepSpeed on CPU; minutes per flow)
with ZEROSHARD_HF_FLOWS_REPORT set, then prints flow | world size | zeroshard result | largest
relative deviation from DeepSpeed per logged quantity | wall time of both, as Markdown.

    PYTHONPATH=$PWD DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/work/.ds_build python bench/hf_flows.py
    python bench/hf_flows.py --render report.json [more.json ...]   # only print from saved reports
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def render(reports: list[Path]) -> str:
    times: dict[str, float] = {}
    devs: dict[str, dict[str, float]] = {}
    for r in reports:  # later reports win
        data = json.loads(r.read_text())
        times.update(data["times"])
        devs.update(data["deviations"])
    rows = ["| flow | world size | zeroshard result | equal to DeepSpeed? (max relative deviation) "
            "| zeroshard s | DeepSpeed s |", "|---|---|---|---|---|---|"]
    flows = sorted({k.split("|", 1)[1] for k in times})
    for flow in flows:
        name, ws = flow.rsplit("|", 1)
        zs, ds = times.get(f"zeroshard|{flow}"), times.get(f"deepspeed|{flow}")
        dev = devs.get(flow)
        if dev is None:
            verdict = "not compared (DeepSpeed run failed)" if ds is not None else "not compared"
        else:
            ok = all(v <= 1e-5 for v in dev.values())
            verdict = ("yes" if ok else "NO") + ": " + ", ".join(f"{k} {v:.1e}" for k, v in dev.items())
        rows.append(f"| {name} | {ws} | {'ran' if zs is not None else '-'} | {verdict} "
                    f"| {zs:.1f} | {ds:.1f} |" if zs is not None and ds is not None else
                    f"| {name} | {ws} | {'ran' if zs is not None else '-'} | {verdict} | "
                    f"{'' if zs is None else f'{zs:.1f}'} | {'' if ds is None else f'{ds:.1f}'} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--render", nargs="*", type=Path)
    args = p.parse_args()
    if args.render:
        print(render(args.render))
        return
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = {**os.environ, "ZEROSHARD_DEEPSPEED_TESTS": "1", "ZEROSHARD_HF_FLOWS_REPORT": str(report),
               "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/launch/test_hf_flows.py", "-k", "TestAgainstDeepSpeed"], cwd=ROOT, env=env)
        print(render([report]))


if __name__ == "__main__":
    main()
