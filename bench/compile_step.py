"""`engine.compile()` against eager at ZeRO stages 0-3, world size 1, and with AutoTP (TP 2) and a
pipeline (PP 2) at 2 ranks: first-step time (tracing and compiling), steady step time, graphs and
graph breaks, and the largest loss difference.

    OMP_NUM_THREADS=1 python bench/compile_step.py [--steps 12] [--preset small] [--micro 8] [--layouts 0,1,2,3,tp,pp]

The TP row trains a 2-layer Llama (hidden 128, 4 heads, the GPT preset's vocabulary and context)
split over 2 ranks at ZeRO 1; the PP row the GPT preset's blocks as a 2-stage PipelineModule
(embedding, blocks, head; no position embedding), 4 micro-batches per step, ZeRO 1. Both run under
torchrun with 2 processes; rank 0's numbers are printed (its stage for PP: the embedding and the
first half of the blocks; graphs and breaks are rank 0's).

Each stage runs in a fresh process with an empty inductor cache (TORCHINDUCTOR_CACHE_DIR), so its
first compiled step pays the whole compile (a warm cache makes a second run's first step a few
seconds). Two engines from the same seed train on the same batches in lockstep, one eager step then
one compiled step, so both see the same machine load. Steady step time is the median of the steps
after the second. One thread: on a shared 2-core box, two OpenMP threads spin against other jobs
and the step times swing 2-4x. Prints a Markdown table (the one in bench/README.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig


def _engine(preset: str, stage: int, micro: int) -> Any:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset))
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every unit behind its gather/release hooks
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _tp_engine(preset: str, micro: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = GPTConfig.preset(preset)
    cfg = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.n_embd, intermediate_size=2 * shape.n_embd,
                      num_hidden_layers=2, num_attention_heads=shape.n_head, num_key_value_heads=shape.n_head,
                      max_position_embeddings=shape.block_size, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = zeroshard.initialize(model=LlamaForCausalLM(cfg).float(), config=config)
    return engine


PP_MICRO_BATCHES = 4


def _head_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _pp_engine(preset: str, micro: int) -> Any:
    from zeroshard.examples.gpt import Block
    from zeroshard.pipe import LayerSpec, PipelineModule

    shape = GPTConfig.preset(preset)
    layers = [LayerSpec(torch.nn.Embedding, shape.vocab_size, shape.n_embd),
              *[LayerSpec(Block, shape) for _ in range(shape.n_layer)],
              LayerSpec(torch.nn.Linear, shape.n_embd, shape.vocab_size, bias=False)]
    net = PipelineModule(layers, num_stages=2, loss_fn=_head_loss, seed_layers=True, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": PP_MICRO_BATCHES,
              "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
    engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=config)
    return engine


def _step(engine: Any, x: torch.Tensor, y: torch.Tensor, layout: str) -> tuple[float, float]:
    start = time.perf_counter()
    if layout == "pp":
        loss = engine.train_batch(iter(zip(x.chunk(PP_MICRO_BATCHES), y.chunk(PP_MICRO_BATCHES))))
    else:
        loss = engine(input_ids=x, labels=x).loss if layout == "tp" else engine(x, y)
        engine.backward(loss)
        engine.step()
    return time.perf_counter() - start, float(loss)


def run_stage(layout: str, args: argparse.Namespace) -> str:
    """One layout (a ZeRO stage at world size 1, or "tp" / "pp" under torchrun), in this process: the
    table's row (rank 0's)."""
    shape = GPTConfig.preset(args.preset)
    g = torch.Generator().manual_seed(1)
    make = {"tp": lambda: _tp_engine(args.preset, args.micro), "pp": lambda: _pp_engine(args.preset, args.micro)}.get(
        layout, lambda: _engine(args.preset, int(layout), args.micro))
    eager, compiled = make(), make()
    compiled.compile()
    batch = args.micro * (PP_MICRO_BATCHES if layout == "pp" else 1)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    dev = 0.0
    for _ in range(args.steps):
        tokens = torch.randint(0, shape.vocab_size, (batch, shape.block_size + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        t_e, loss_e = _step(eager, x, y, layout)
        t_c, loss_c = _step(compiled, x, y, layout)
        times["eager"].append(t_e)
        times["compiled"].append(t_c)
        dev = max(dev, abs(loss_c - loss_e) / abs(loss_e))
    stats = compiled.compile_stats
    e, c = times["eager"], times["compiled"]
    steady_e, steady_c = statistics.median(e[2:]), statistics.median(c[2:])
    name = {"tp": "TP 2, ZeRO 1", "pp": "PP 2, ZeRO 1"}.get(layout, layout)
    return (f"| {name} | {e[0]:.2f} | {c[0]:.1f} | {steady_e * 1e3:.0f} | {steady_c * 1e3:.0f} "
            f"| {steady_e / steady_c:.2f}x | {stats.graphs} | {stats.graph_breaks} | {dev:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--preset", default="small", help="GPTConfig preset (small: ~0.8M parameters)")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--layouts", default="0,1,2,3,tp,pp",
                        help="ZeRO stages at world size 1, and tp / pp (2 ranks), comma-separated")
    parser.add_argument("--layout", default=None, help="run one layout here (the parent runs --layouts)")
    args = parser.parse_args()
    if args.layout is not None:
        row = run_stage(args.layout, args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(row, flush=True)
        return
    rows = []
    for layout in args.layouts.split(","):
        launch = [sys.executable] if layout.isdigit() else [sys.executable, "-m", "torch.distributed.run",
                                                             "--standalone", "--nproc-per-node=2"]
        with tempfile.TemporaryDirectory(prefix="zeroshard-compile-bench-") as cache:
            out = subprocess.run([*launch, __file__, "--layout", layout, "--steps", str(args.steps),
                                  "--preset", args.preset, "--micro", str(args.micro)], check=True, text=True,
                                 capture_output=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        rows.append(next(line for line in out.stdout.splitlines() if line.startswith("| ")))
        print(rows[-1], flush=True)
    shape = GPTConfig.preset(args.preset)
    print(f"\nGPT preset {args.preset!r}, micro-batch {args.micro} x {shape.block_size} tokens (PP: {PP_MICRO_BATCHES} "
          f"micro-batches a step), fp32, world size 1 (TP, PP: 2), {args.steps} steps, torch {torch.__version__}, "
          f"backend inductor, {torch.get_num_threads()} thread(s) a rank, load average {os.getloadavg()[0]:.1f}\n")
    print("| layout | eager first step (s) | compiled first step (s) | eager step (ms) | compiled step (ms) "
          "| speed-up | graphs | graph breaks | max loss rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
