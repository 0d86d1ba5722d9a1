"""Monitor sinks (CSV, wandb offline) and `zeroshard report`."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest

from zeroshard.cli.report import main as report_main
from zeroshard.cli.report import read_run
from zeroshard.config import load_config
from zeroshard.errors import ConfigError
from zeroshard.runtime.monitor import CsvSink, build_sinks


def _metrics(step: int, ranks: int = 2, extra: dict[str, float] | None = None) -> dict[str, float]:
    out = {"loss": 5.0 / step, "lr": 1e-3 * step, "loss_scale": 1.0, "skipped_steps": 0.0, "grad_norm": 1.0,
           "samples_per_s": 100.0 + step, "samples": 8.0 * step}
    for r in range(ranks):
        out[f"model_state_bytes_rank{r}"] = 1e6 * (r + 1)
        out[f"peak_memory_bytes_rank{r}"] = 3e6 * (r + 1)
    out.update(extra or {})
    return out


def test_csv_sink_widens_its_header_when_a_metric_appears(tmp_path: Path) -> None:
    sink = CsvSink(str(tmp_path), "job")
    sink.write(1, _metrics(1))
    sink.write(2, _metrics(2, extra={"time_forward_ms": 3.0}))
    sink.close()
    rows = list(csv.DictReader((tmp_path / "job" / "metrics.csv").open()))
    assert [r["step"] for r in rows] == ["1", "2"]
    assert rows[0]["time_forward_ms"] == "" and rows[1]["time_forward_ms"] == "3.0"


def test_report_draws_png_and_html_from_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the [report] extra is not installed")
    for name in ("a", "b"):
        sink = CsvSink(str(tmp_path / name), "job")
        for step in range(1, 6):
            sink.write(step, _metrics(step))
        sink.close()
    run = read_run(tmp_path / "a")
    assert run.ranks() == [0, 1] and run.steps == [1, 2, 3, 4, 5] and run.label == "a"
    png, page = tmp_path / "r.png", tmp_path / "r.html"
    assert report_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert report_main([str(tmp_path / "a"), "--out", str(page), "--labels", "stage 2"]) == 0
    text = page.read_text()
    assert "data:image/png;base64," in text and "stage 2" in text


def test_report_names_a_directory_without_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics.csv found" in capsys.readouterr().err


def test_wandb_sink_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="the [wandb] extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config({"train_batch_size": 2, "wandb": {"enabled": True, "project": "p", "group": "g"}},
                      dp_world_size=1)
    (sink,) = build_sinks(cfg, rank=0)
    sink.write(1, _metrics(1))
    sink.write(2, _metrics(2))
    sink.close()
    files = [f for f in (tmp_path / "wandb").rglob("*.wandb")]
    assert files, "an offline run file was written"
    assert build_sinks(cfg, rank=1) == [], "only rank 0 logs"


def test_wandb_missing_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def fake(name: str, *a: object, **k: object) -> object:
        if name == "wandb":
            raise ImportError("no wandb")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    cfg = SimpleNamespace(csv_monitor=SimpleNamespace(enabled=False), tensorboard=SimpleNamespace(enabled=False),
                          wandb=SimpleNamespace(enabled=True, project="p", group=None, team=None),
                          zero_optimization=SimpleNamespace(stage=0), precision="fp32", train_batch_size=1,
                          dp_world_size=1)
    with pytest.raises(ConfigError, match=r"wandb.enabled.*zeroshard\[wandb\]"):
        build_sinks(cfg, rank=0)


def test_comet_is_refused_by_name() -> None:
    from zeroshard.errors import NotSupportedError

    with pytest.raises(NotSupportedError, match="comet"):
        load_config({"train_batch_size": 2, "comet": {"enabled": True}}, dp_world_size=1)
