"""`zeroshard report RUN_DIR... [--out report.png|.html]`: plot the CSV monitor output of runs.

Reads each run's `metrics.csv` (written by the `csv_monitor` sink, Note: [monitor events] in
runtime/monitor.py) and draws loss, lr, samples/s and memory per rank against steps, the runs
overlaid; with MoE layers also their routing (imbalance, dropped routes, aux loss, tokens per
expert). matplotlib is an optional extra (`pip install 'zeroshard[report]'`).
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
from typing import TYPE_CHECKING

from zeroshard.errors import ZeroshardError

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.gridspec import GridSpec

_RANK_COLUMN = re.compile(r"^(model_state_bytes|peak_memory_bytes)_rank(\d+)$")
_MOE_TOKENS = re.compile(r"^moe(\d+)_tokens_expert(\d+)$")


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

    def moe_layers(self) -> dict[int, int]:
        """MoE layer index -> experts, from the `moe{L}_tokens_expert{E}` columns."""
        layers: dict[int, int] = {}
        for c in self.columns:
            if m := _MOE_TOKENS.match(c):
                layers[int(m.group(1))] = max(layers.get(int(m.group(1)), 0), int(m.group(2)) + 1)
        return dict(sorted(layers.items()))

    def moe_tokens(self, layer: int, experts: int) -> list[list[float]]:
        """[expert][step] routes per expert of one MoE layer (nan where a step has none)."""
        nan = [float("nan")] * len(self.steps)
        return [self.columns.get(f"moe{layer}_tokens_expert{e}", nan) for e in range(experts)]

    def moe_dropped_percent(self, layer: int, experts: int) -> list[float]:
        """Dropped routes as a percentage of the layer's routes, per step."""
        totals = [sum(col) for col in zip(*self.moe_tokens(layer, experts))]
        dropped = self.columns.get(f"moe{layer}_dropped", [float("nan")] * len(self.steps))
        return [100 * d / t if t > 0 else float("nan") for d, t in zip(dropped, totals)]


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
    norm), two rows more with MoE layers (`_draw_moe`), as PNG, or an HTML page around it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ZeroshardError("zeroshard report needs matplotlib: pip install 'zeroshard[report]'") from e
    moe = any(run.moe_layers() for run in runs)
    fig = plt.figure(figsize=(13, 14 if moe else 7), dpi=80)
    grid = fig.add_gridspec(4 if moe else 2, 3)
    axes = [[fig.add_subplot(grid[r, c]) for c in range(3)] for r in range(2)]
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
    if moe:
        _draw_moe(fig, grid, runs, colors, styles)
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


def _draw_moe(fig: "Figure", grid: "GridSpec", runs: list[Run], colors: list[str], styles: list[str]) -> None:
    """Row 3: imbalance, dropped routes (%) and aux loss per MoE layer, the runs overlaid; row 4:
    the first run's tokens per expert over steps, each relative to the layer's mean (1 = balanced)."""
    lines = [fig.add_subplot(grid[2, c]) for c in range(3)]
    titles = ["MoE imbalance (max / mean tokens per expert)", "MoE dropped routes (% of routes)", "MoE aux loss"]
    for i, run in enumerate(runs):
        for layer, experts in run.moe_layers().items():
            series = [run.columns.get(f"moe{layer}_imbalance"), run.moe_dropped_percent(layer, experts),
                      run.columns.get(f"moe{layer}_aux_loss")]
            for ax, values in zip(lines, series):
                if values is not None:
                    ax.plot(run.steps, values, color=colors[layer % len(colors)], linestyle=styles[i % len(styles)],
                            label=f"{run.label}, moe{layer}")
    for ax, title in zip(lines, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    first = next(run for run in runs if run.moe_layers())
    rows, labels = [], []
    for layer, experts in first.moe_layers().items():
        tokens = first.moe_tokens(layer, experts)
        means = [sum(col) / experts for col in zip(*tokens)]
        rows += [[v / m if m > 0 else float("nan") for v, m in zip(values, means)] for values in tokens]
        labels += [f"moe{layer} e{e}" for e in range(experts)]
    heat = fig.add_subplot(grid[3, :])
    image = heat.imshow(rows, aspect="auto", interpolation="nearest", cmap="viridis",
                        extent=(first.steps[0] - 0.5, first.steps[-1] + 0.5, len(rows) - 0.5, -0.5))
    if len(labels) <= 32:
        heat.set_yticks(range(len(labels)), labels, fontsize=7)
    heat.set_xlabel("step")
    heat.set_title(f"{first.label}: tokens per expert / layer mean", fontsize=10)
    fig.colorbar(image, ax=heat, fraction=0.03)


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
