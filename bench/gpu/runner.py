"""One process of one GPU benchmark row: build one engine, time warm-up + measured steps, write JSON.

Started by bench/gpu/run.py as
    torchrun --standalone --nproc-per-node N bench/gpu/runner.py --engine zs3 --spec '{...}' --out F
Rank 0 writes the row. A row the engine refuses ("not supported yet", out of memory) is recorded
with its reason instead of failing the whole table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from zeroshard.examples.gpt import GPT, GPTConfig

# ~1.2B parameters: 24 blocks of width 2048 (12 * 24 * 2048^2 = 1.21e9), byte vocabulary, 1024
# tokens of context. "tiny" lets the harness itself run on a CPU (tests/launch).
MODELS = {
    "1b": GPTConfig(vocab_size=256, block_size=1024, n_layer=24, n_head=16, n_embd=2048),
    "350m": GPTConfig(vocab_size=256, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    # the 25M GPT of bench/ (8 blocks of width 512): the NVMe rows compare swap against CPU offload on it
    "25m": GPTConfig(vocab_size=256, block_size=1024, n_layer=8, n_head=8, n_embd=512),
}


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    model: str = "1b"
    micro_batch: int = 8
    seq_len: int = 1024
    steps: int = 10
    warmup: int = 3
    lr: float = 1e-4
    seed: int = 1234
    bucket_numel: int = 500_000_000

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N for the dense layers (forward + backward) plus the
        attention score and value matmuls, 12 * layers * seq_len * width (PaLM's accounting)."""
        cfg = MODELS[self.model]
        n = 12 * cfg.n_layer * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd
        return 6 * n + 12 * cfg.n_layer * self.seq_len * cfg.n_embd


def ds_config(spec: GpuSpec, stage: int, offload: str, device: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": spec.bucket_numel,
                            "allgather_bucket_size": spec.bucket_numel}
    if stage == 3:
        zero.pop("allgather_bucket_size")
        zero["stage3_prefetch_bucket_size"] = spec.bucket_numel // 10
    pin = device == "cuda"
    if offload in ("optimizer", "both", "delayed"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if offload == "delayed":  # zeroshard's extension; warm-up 1 so the timed steps are delayed ones
        zero["offload_optimizer"].update(delayed_update=True, delayed_update_warmup_steps=1)
    if offload == "nvme":  # swap files under $ZS_BENCH_NVME_PATH (bench/nvme.md)
        path = os.environ.get("ZS_BENCH_NVME_PATH", "/tmp/zeroshard-nvme-bench")
        os.makedirs(path, exist_ok=True)
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "pin_memory": pin, "buffer_count": 4}
    if offload == "both":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if offload == "lean":  # FSDP2's lifetimes: reshard after forward, no gradients between steps
        zero.update(stage3_max_reuse_distance=0, stage3_release_grads=True)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if offload.startswith("fp8"):  # docs/precision.md; "fp8_ag": stage 3 gathers the float8 weights
        cfg["fp8"] = {"enabled": True, "recipe": "rowwise" if offload == "fp8_rowwise" else "tensorwise",
                      "float8_all_gather": offload == "fp8_ag"}
    return cfg


ROWS: dict[str, tuple[str, int, str]] = {
    **{f"zs{s}": ("zeroshard", s, "none") for s in range(4)},
    "zs2_offload": ("zeroshard", 2, "optimizer"),
    "zs3_offload": ("zeroshard", 3, "both"),
    "zs3_offload_opt": ("zeroshard", 3, "optimizer"),
    "zs3_lean": ("zeroshard", 3, "lean"),  # bench/fsdp_memory.md
    "zs2_compile": ("zeroshard", 2, "compile"),  # engine.compile(), inductor
    "zs3_compile": ("zeroshard", 3, "compile"),
    "zs2_fp8": ("zeroshard", 2, "fp8"),  # fp8 tensorwise against zs2's bf16
    "zs2_fp8_rowwise": ("zeroshard", 2, "fp8_rowwise"),
    "zs3_fp8_ag": ("zeroshard", 3, "fp8_ag"),  # fp8 tensorwise + float8 all-gather against zs3
    "zs2_offload_delayed": ("zeroshard", 2, "delayed"),
    "zs3_offload_delayed": ("zeroshard", 3, "delayed"),
    "zs2_nvme": ("zeroshard", 2, "nvme"),
    "zs3_nvme": ("zeroshard", 3, "nvme"),
    **{f"ds{s}": ("deepspeed", s, "none") for s in range(4)},
    "ds2_offload": ("deepspeed", 2, "optimizer"),
    "ds3_offload": ("deepspeed", 3, "both"),
    "fsdp2": ("fsdp2", 3, "none"),
}


def build(row: str, spec: GpuSpec, device: torch.device):  # engine-specific
    kind, stage, offload = ROWS[row]
    torch.manual_seed(spec.seed)
    model = GPT(MODELS[spec.model])
    if kind == "zeroshard":
        import zeroshard

        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(spec, stage, offload, device.type))
        if offload == "compile":
            engine.compile()  # compiled on the first forward: its time is in time_to_first_step_s
        return engine, engine.backward, engine.step
    if kind == "deepspeed":
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        cfg = ds_config(spec, stage, offload, device.type)
        if os.environ.get("ZS_DS_TORCH_ADAM") == "1":  # DeepSpeed without its CUDA ops (bench/gpu/README.md)
            cfg["optimizer"]["params"]["torch_adam"] = True
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return engine, engine.backward, engine.step
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model.to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)

    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, backward, step


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
        try:
            import subprocess

            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except Exception as e:  # recorded, not fatal
            info["driver"] = f"unknown ({e})"
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception:
        info["deepspeed"] = None
    return info


def run(row: str, spec: GpuSpec) -> dict[str, Any]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) \
        if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    out: dict[str, Any] = {"row": row, "world_size": world, "device": str(device), **machine()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    try:
        model, backward, step = build(row, spec, device)
        g = torch.Generator().manual_seed(spec.seed)
        times, losses = [], []
        for s in range(spec.warmup + spec.steps):
            tokens = torch.randint(0, MODELS[spec.model].vocab_size, (spec.micro_batch, spec.seq_len + 1), generator=g)
            x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
            t = time.perf_counter()
            loss = model(x, y)
            backward(loss)
            step()
            sync()
            if s == 0:
                out["time_to_first_step_s"] = time.perf_counter() - start
            if s >= spec.warmup:
                times.append(time.perf_counter() - t)
            losses.append(float(loss))
    except Exception as e:  # the row records why
        oom = isinstance(e, torch.OutOfMemoryError)
        out.update(status="oom" if oom else "error", message=f"{type(e).__name__}: {str(e)[:400]}",
                   traceback=traceback.format_exc(limit=6))
        return out
    times.sort()
    median = times[len(times) // 2]
    tokens_per_s = world * spec.micro_batch * spec.seq_len / median
    out.update(status="ok", step_s=median, tokens_per_s=tokens_per_s, losses=losses,
               achieved_tflops=tokens_per_s * spec.flops_per_token() / 1e12 / world,
               peak_allocated_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True, choices=sorted(ROWS))
    p.add_argument("--spec", default="{}", help="GpuSpec fields as JSON")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    spec = GpuSpec(**json.loads(args.spec))
    result = run(args.engine, spec)
    result["spec"] = asdict(spec)
    if int(os.environ.get("RANK", "0")) == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if result["status"] == "error":
        print(f"[gpu bench] {args.engine}: {result['message']}\n{result['traceback']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
