"""zeroshard.progress: tqdm on a terminal, one line per stage otherwise."""

from __future__ import annotations

import io

import pytest

from zeroshard.progress import Progress, progress_iter


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_line_per_stage_when_not_a_terminal() -> None:
    out = io.StringIO()
    assert list(progress_iter(["a.safetensors", "b.safetensors", "c.safetensors"], "load shards",
                              unit="file", stream=out)) == ["a.safetensors", "b.safetensors", "c.safetensors"]
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("load shards [") and "100.0%" in lines[-1]
    assert lines[0].endswith("a.safetensors") and "1/3" in lines[0]


def test_many_updates_print_at_most_a_line_per_tenth() -> None:
    out = io.StringIO()
    with Progress(1000 * 2**20, "to-fp32", stream=out) as bar:
        for i in range(1000):
            bar.advance(2**20, f"t{i}")
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 11 and "1,000.0 MiB/1,000.0 MiB" in lines[-1]


def test_terminal_gets_a_tqdm_bar() -> None:
    pytest.importorskip("tqdm", reason="the [progress] extra is not installed")
    out = Tty()
    with Progress(4, "plan --probe", unit="candidate", stream=out) as bar:
        for i in range(4):
            bar.advance(1, f"stage {i}")
    text = out.getvalue()
    assert "\r" in text and "4/4" in text and "plan --probe" in text


def test_disabled_draws_nothing() -> None:
    out = Tty()
    with Progress(4, "x", enabled=False, stream=out) as bar:
        bar.advance(4)
    assert out.getvalue() == ""


def test_checkpoint_save_and_load_report_progress_for_large_states(
        monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import zeroshard.checkpoint.load as load_mod
    import zeroshard.checkpoint.save as save_mod

    monkeypatch.setattr(save_mod, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(load_mod, "PROGRESS_MIN_BYTES", 0)
    import torch

    import zeroshard
    from zeroshard.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2}})
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    capsys.readouterr()
    engine.save_checkpoint(tmp_path)
    err = capsys.readouterr().err
    assert "save global_step1" in err and "published" in err and "100.0%" in err
    engine.load_checkpoint(tmp_path)
    err = capsys.readouterr().err
    assert "load global_step1" in err and "mp_rank_00_model_states.pt" in err
