"""Issue 18's closing table from the DeepSpeedExamples-style comparison (tests/launch/test_deepspeed_examples.py).

Run the comparison with a report file, then render it:

    ZEROSHARD_DEEPSPEED_TESTS=1 ZS_DS_EXAMPLES_REPORT=/tmp/ds.jsonl OMP_NUM_THREADS=1 \\
        python -m pytest -q tests/launch/test_deepspeed_examples.py
    python bench/deepspeed_examples.py /tmp/ds.jsonl [more.jsonl ...] > table.md

Each report line is one comparison (case, world size, launcher, precision, max |loss deviation|
against DeepSpeed 0.19.8 over every rank and step of the save and resume phases, pass/fail). The
table lists every case x world x launcher the test defines; those with no line are "not run".
The accelerator section lists the public methods of zeroshard.accelerator.get_accelerator().
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "launch"))


def main(paths: list[str]) -> None:
    from test_deepspeed_examples import CASES, TOLERANCE  # the test's own case list

    results: dict[tuple[str, int, str], dict] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                results[(r["case"], r["world"], r["launcher"])] = r
    print("| case (script, stage, precision) | script | world | launcher | precision | tolerance (rel.) "
          "| steps | max abs loss deviation vs DeepSpeed | result |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        tol = case.tolerance if case.tolerance is not None else TOLERANCE[case.precision]
        for world in (1, 2):
            for launcher in ("torchrun", "zeroshard-launch"):
                r = results.get((case.name, world, launcher))
                if r is None:
                    print(f"| {case.name} | {case.script} | {world} | {launcher} | {case.precision} | {tol:g} "
                          "| - | not run | - |")
                else:
                    print(f"| {case.name} | {case.script} | {world} | {launcher} | {case.precision} | {tol:g} "
                          f"| {r['steps']} | {r['max_abs_deviation']:.3g} | {'pass' if r['ok'] else 'FAIL'} |")
    from zeroshard.accelerator import get_accelerator

    acc = get_accelerator()
    names = sorted(n for n in dir(acc) if not n.startswith("_"))
    print(f"\nAccelerator methods provided ({type(acc).__name__}, {len(names)}): "
          + ", ".join(f"`{n}`" for n in names))


if __name__ == "__main__":
    main(sys.argv[1:])
