"""Accelerate's FP8 and zeroshard's `fp8` section through the `deepspeed` alias (docs/precision.md).

Accelerate 1.16's `mixed_precision="fp8"` with DeepSpeed needs torchao or Transformer Engine: without
either, `accelerate launch` refuses before any process starts, so nothing reaches zeroshard. With
torchao, Accelerate converts the model itself and writes only `bf16.enabled` into the ds_config
(measured by hand: docs/precision.md). What does reach zeroshard is the ds_config file: an `fp8`
section in it turns zeroshard's float8 layers on under `accelerate launch --use_deepspeed`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "hf_accelerate_fp8.py"
HAS_FP8_BACKEND = any(importlib.util.find_spec(m) is not None for m in ("torchao", "transformer_engine"))


def _launch(tmp: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", ZEROSHARD_ALIAS_QUIET="1", ZEROSHARD_AS_DEEPSPEED="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "1",
           "--main_process_port", "0", *flags, str(SCRIPT), "--results", str(tmp / "results.json")]
    return subprocess.run(cmd, cwd=tmp, env=env, text=True, capture_output=True, timeout=600)


def test_fp8_section_in_the_ds_config_reaches_zeroshard(tmp_path: Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
                               "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                               "fp8": {"enabled": True, "recipe": "rowwise"}}))
    proc = _launch(tmp_path, "--deepspeed_config_file", str(cfg))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "results.json").read_text())
    assert got["engine"] == "zeroshard.runtime.engine.ZeroEngine" and got["bf16"] == {"enabled": True}
    float8 = sorted(n for n, c in got["classes"].items() if c == "zeroshard.runtime.fp8.Float8Linear")
    # 2 layers x 7 projections; the first (layers.0 q_proj) and the last (lm_head) stay high precision
    assert len(float8) == 13 and "model.layers.0.self_attn.q_proj" not in float8 and "lm_head" not in float8
    losses = got["losses"]
    assert len(losses) == 6 and all(4.0 < loss < 5.5 for loss in losses), losses


def test_mixed_precision_fp8_without_a_backend_is_refused_by_accelerate(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "--zero_stage", "2", "--mixed_precision", "fp8")
    if HAS_FP8_BACKEND:  # torchao / TE installed: Accelerate converts the model itself (docs/precision.md)
        assert proc.returncode == 0 or "fp8_enable_fsdp_float8_all_gather" in proc.stderr, proc.stderr[-4000:]
        return
    assert proc.returncode != 0 and "FP8 is not available on this machine" in proc.stderr, proc.stderr[-4000:]
    assert not (tmp_path / "results.json").exists()
