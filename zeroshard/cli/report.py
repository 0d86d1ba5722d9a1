"""`zeroshard report RUN_DIR... [--out report.png|.html]`: plot the CSV monitor output of runs.

Reads each run's `metrics.csv` (written by the `csv_monitor` sink, Note: [monitor events] in
runtime/monitor.py) and draws loss, lr, samples/s and memory per rank against steps, the runs
overlaid. matplotlib is an optional extra (`pip install 'zeroshard[report]'`).
"""

from __future__ import annotations

import argparse
import base64
import csv
import html
import io
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from zeroshard.errors import ZeroshardError

_RANK_COLUMN = re.compile(r"^(model_state_bytes|peak_memory_bytes)_rank(\d+)$")


@dataclass
class Run:
    """One run's metrics: column name -> values, aligned with `steps`."""

    label: str
    path: Path
    steps: list[int]
    columns: dict[str, list[float]]

    def series(self, name: str) -> list[float] | None:
        values = self.columns.get(name)
        if values is None or all(math.isnan(v) for v in values):
            return None
        return values

    def ranks(self) -> list[int]:
        return sorted({int(m.group(2)) for c in self.columns if (m := _RANK_COLUMN.match(c))})


def find_metrics(path: Path) -> Path:
    """`path` itself (a CSV file), `path/metrics.csv`, or the one metrics.csv below `path`."""
    if path.is_file():
        return path
    if (path / "metrics.csv").is_file():
        return path / "metrics.csv"
    found = sorted(path.rglob("metrics.csv")) if path.is_dir() else []
    if len(found) == 1:
        return found[0]
    if not found:
        raise ZeroshardError(f"{path}: no metrics.csv found. Enable the CSV monitor in the run's config "
                             '("csv_monitor": {"enabled": true, "output_path": DIR}) and pass DIR.')
    raise ZeroshardError(f"{path}: {len(found)} metrics.csv files below it ({', '.join(map(str, found[:3]))}, "
                         "...); pass one run directory per run.")


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def read_run(path: Path, label: str | None = None) -> Run:
    """Parse one run's metrics.csv."""
    file = find_metrics(path)
    with file.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "step" not in rows[0]:
        raise ZeroshardError(f"{file}: no rows with a 'step' column (is it a zeroshard csv_monitor file?)")
    columns = {k: [_number(r.get(k) or "nan") for r in rows] for k in rows[0] if k != "step"}
    name = label or (path.name if path.is_dir() else file.parent.name)
    return Run(label=name, path=file, steps=[int(float(r["step"])) for r in rows], columns=columns)


def _mib(values: list[float]) -> list[float]:
    return [v / 2**20 for v in values]


def draw(runs: list[Run], out: Path, title: str | None = None) -> None:
    """Write a 2 x 3 figure (loss, lr, samples/s; peak memory and model states per rank, grad
    norm) as PNG, or an HTML page around it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ZeroshardError("zeroshard report needs matplotlib: pip install 'zeroshard[report]'") from e
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), dpi=80)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", "-.", ":"]
    markers = ["o", "s", "^", "x", "d", "v", "*", "+"]
    panels = [(axes[0][0], "loss", "loss"), (axes[0][1], "lr", "learning rate"),
              (axes[0][2], "samples_per_s", "samples / s"), (axes[1][2], "grad_norm", "gradient norm (pre-clip)")]
    memory = [(axes[1][0], "peak_memory_bytes", "peak memory per rank (MiB)"),
              (axes[1][1], "model_state_bytes", "model states per rank on the device (MiB)")]
    for i, run in enumerate(runs):
        color, style = colors[i % len(colors)], styles[i % len(styles)]
        for ax, column, _ in panels:
            values = run.series(column)
            if values is not None:
                ax.plot(run.steps, values, color=color, linestyle=style, label=run.label)
        every = max(1, len(run.steps) // 8)
        for ax, prefix, _ in memory:
            for r in run.ranks():
                values = run.series(f"{prefix}_rank{r}")
                if values is not None:
                    ax.plot(run.steps, _mib(values), color=color, linestyle=style, marker=markers[r % len(markers)],
                            markevery=every, markersize=4, label=f"{run.label}, rank {r}")
    for ax, _, name in panels + memory:
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    for ax, _, _ in memory:
        low, high = ax.get_ylim()
        ax.set_ylim(0, max(high, 1.0) * 1.1)
    axes[0][1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    fig.suptitle(title or "zeroshard report: " + " vs ".join(r.label for r in runs))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() in (".html", ".htm"):
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        out.write_text(_html(runs, base64.b64encode(buf.getvalue()).decode()))
    else:
        fig.savefig(out)
    plt.close(fig)


def _html(runs: list[Run], png_b64: str) -> str:
    rows = []
    for run in runs:
        last = {k: v[-1] for k, v in run.columns.items() if v}
        rows.append(f"<tr><td>{html.escape(run.label)}</td><td>{run.steps[-1]}</td>"
                    f"<td>{last.get('loss', float('nan')):.4f}</td>"
                    f"<td>{last.get('samples_per_s', float('nan')):.1f}</td>"
                    f"<td>{html.escape(str(run.path))}</td></tr>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>zeroshard report</title></head><body>"
            "<h1>zeroshard report</h1><table border='1' cellpadding='4'><tr><th>run</th><th>last step</th>"
            "<th>loss</th><th>samples/s</th><th>file</th></tr>" + "".join(rows) + "</table>"
            f"<p><img alt='loss, lr, samples/s and memory per rank' src='data:image/png;base64,{png_b64}'></p>"
            "</body></html>")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zeroshard report", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (the csv_monitor output_path or its "
                   "job_name folder) or metrics.csv files; runs are overlaid")
    p.add_argument("--out", type=Path, default=Path("report.png"), help="report.png (default) or report.html")
    p.add_argument("--labels", default=None, help="comma-separated run names (default: the directory names)")
    p.add_argument("--title", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    labels = args.labels.split(",") if args.labels else [None] * len(args.runs)
    if len(labels) != len(args.runs):
        print(f"zeroshard report: --labels has {len(labels)} names for {len(args.runs)} runs", file=sys.stderr)
        return 2
    try:
        runs = [read_run(p, label) for p, label in zip(args.runs, labels)]
        draw(runs, args.out, args.title)
    except ZeroshardError as e:
        print(f"zeroshard report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0
