"""One probe run: a few real training steps of one candidate config, on every rank of a job.

Started by estimate/probe.py under `python -m torch.distributed.run`; rank 0 writes a JSON
result (samples/s from the median step, peak memory per rank), and any rank that runs out of memory writes
`{"status": "oom"}` to its own file and exits with status 3. On CUDA a `--device-memory`
below the device's size caps the allocator (`set_per_process_memory_fraction`), so the probe
honours the budget it plans for. Imports `zeroshard` (initialize) and the built-in GPT.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

OOM_EXIT = 3


def _build_model(model: str) -> tuple[nn.Module, int, int, bool]:
    """(model, vocab size, max sequence length or 0, is a Hugging Face model)."""
    if model.startswith("gpt:"):
        from zeroshard.examples.gpt import GPT, GPTConfig

        cfg = GPTConfig.preset(model[4:])
        return GPT(cfg), cfg.vocab_size, cfg.block_size, False
    raw = json.loads(Path(model if model.endswith(".json") else os.path.join(model, "config.json")).read_text())
    if "model_type" not in raw:
        from zeroshard.examples.gpt import GPT, GPTConfig

        cfg = GPTConfig(**raw)
        return GPT(cfg), cfg.vocab_size, cfg.block_size, False
    import transformers  # optional extra [hf]

    model_type = raw.pop("model_type")
    hf_cfg = transformers.AutoConfig.for_model(model_type, **raw)
    cls = transformers.AutoModelForSeq2SeqLM if hf_cfg.is_encoder_decoder else transformers.AutoModelForCausalLM
    max_len = getattr(hf_cfg, "max_position_embeddings", 0) or 0
    built: nn.Module = cls.from_config(hf_cfg)  # type: ignore[no-untyped-call]
    return built, int(hf_cfg.vocab_size), int(max_len), True


def _loss(engine: Any, x: Tensor, hf: bool) -> Tensor:
    out = engine(input_ids=x, labels=x).loss if hf else engine(x, x)
    if not isinstance(out, Tensor):
        raise TypeError(f"the model returned {type(out).__name__}, expected a loss tensor")
    return out


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from zeroshard.runtime.initialize import initialize

    if torch.cuda.is_available() and args.device_memory:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(local).total_memory
        if args.device_memory < total:
            torch.cuda.set_per_process_memory_fraction(args.device_memory / total, local)
    torch.manual_seed(0)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # interpreter + torch, before the model
    model, vocab, max_len, hf = _build_model(args.model)
    seq = min(args.seq_len, max_len) if max_len else args.seq_len
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=args.config)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    gen = torch.Generator().manual_seed(engine.rank)
    batch = torch.randint(0, vocab, (micro, seq), generator=gen).to(engine.device)
    engine.train()
    step_s: list[float] = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        for _ in range(gas):
            engine.backward(_loss(engine, batch, hf))
            engine.step()  # the step's collectives keep the ranks in lockstep
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        if step >= args.warmup:
            step_s.append(time.perf_counter() - start)
    summary = engine.summary()  # collective: peak memory of every rank
    # The median step: robust to a step slowed by something else on the machine.
    median = statistics.median(step_s)
    return {"status": "ok", "samples_per_s": engine.train_batch_size() / max(median, 1e-9), "step_s": median,
            "peak_memory_bytes_per_rank": summary["peak_memory_bytes_per_rank"],
            "baseline_bytes": baseline if engine.device.type == "cpu" else 0,
            "model_state_bytes": [s.total for s in engine.model_state_bytes()], "seq_len": seq,
            "train_batch_size": engine.train_batch_size(), "rank": engine.rank}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zeroshard.estimate.probe_worker")
    p.add_argument("--config", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device-memory", type=int, default=0)
    p.add_argument("--out", required=True, help="result path; rank r > 0 writes OUT.rank<r> on failure")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out if rank == 0 else f"{args.out}.rank{rank}")
    try:
        result = run(args)
    except Exception as err:  # reported to the planner, which decides; never swallowed silently
        status = "oom" if _is_oom(err) else "error"
        out.write_text(json.dumps({"status": status, "error": f"{type(err).__name__}: {err}"[:500], "rank": rank}))
        print(f"[probe rank {rank}] {status}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return OOM_EXIT if status == "oom" else 1
    if rank == 0:
        out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
