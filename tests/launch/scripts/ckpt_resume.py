"""Launch-test worker: exact resume in fresh processes (run under torchrun).

    ckpt_resume.py save DIR     every config: K steps uninterrupted (the reference), then J steps
                                in a new engine and save_checkpoint(DIR/<config>)
    ckpt_resume.py resume DIR   fresh processes: load, K - J steps, compare bit for bit

The data comes from initialize(training_data=...) (its position is in the checkpoint) and the
model has dropout (the random generators are in the checkpoint too).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))

from engine_helpers import TINY, gathered_snapshot, make_config

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig

K, J = 8, 3
CONFIGS: dict[str, tuple[int, str, bool, int]] = {  # stage, precision, cpu offload, grad accumulation
    "s0-fp32": (0, "fp32", False, 1),
    "s0-bf16": (0, "bf16", False, 2),
    "s1-fp32": (1, "fp32", False, 2),
    "s1-bf16-offload": (1, "bf16", True, 1),
    "s2-fp32": (2, "fp32", False, 1),
    "s2-fp32-offload": (2, "fp32", True, 2),
    "s2-bf16": (2, "bf16", False, 2),
    "s2-fp16": (2, "fp16", False, 1),
    "s3-fp32": (3, "fp32", False, 2),
    "s3-bf16-offload": (3, "bf16", True, 1),
}


def config(stage: int, precision: str, offload: bool, gas: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:  # the tiny model's tensors are small: partition those above 100 elements
        zero["stage3_param_persistence_threshold"] = 100
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    extra: dict[str, Any] = {}
    if precision == "bf16":
        extra["bf16"] = {"enabled": True}
    if precision == "fp16":
        extra["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 3}
    sched = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "total_num_steps": 20,
                                                 "warmup_max_lr": 1e-2}}
    return make_config(gradient_accumulation_steps=gas, gradient_clipping=0.5, zero_optimization=zero,
                       scheduler=sched, **extra)


def dataset() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY.vocab_size, (30, TINY.block_size + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def build(name: str, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY.__dict__, "dropout": 0.1}))
    engine, _, loader, _ = zeroshard.initialize(model=model, training_data=dataset(),
                                                config=config(*CONFIGS[name]))
    return engine, loader


def train(engine: Any, loader: Any, steps: int) -> list[float]:
    losses = []
    it = iter(loader)
    for _ in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(loader)
                x, y = next(it)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def main(mode: str, out: Path) -> None:
    rank = zeroshard.init_distributed().rank
    for name in CONFIGS:
        if mode == "save":
            engine, loader = build(name, seed=0)
            torch.manual_seed(100 + rank)
            losses = train(engine, loader, K)
            params = gathered_snapshot(engine.module)  # whole parameters at every stage
            torch.save({"losses": losses, "params": params, "steps": engine.global_steps,
                        "scale": engine.get_loss_scale(), "lr": engine.get_lr()}, out / f"ref-{name}-{rank}.pt")
            engine, loader = build(name, seed=0)
            torch.manual_seed(100 + rank)
            train(engine, loader, J)
            engine.save_checkpoint(out / name, client_state={"config": name})
            print(f"SAVED {name}", flush=True)
        else:
            engine, loader = build(name, seed=12)  # another init: the load must overwrite it all
            _, client = engine.load_checkpoint(out / name, load_rng_state=True)
            if client != {"config": name}:
                raise AssertionError(f"{name}: client_state {client}")
            losses = train(engine, loader, K - J)
            ref = torch.load(out / f"ref-{name}-{rank}.pt", weights_only=True)
            if losses != ref["losses"][-len(losses):]:
                raise AssertionError(f"{name} rank {rank}: losses {losses} != {ref['losses'][-len(losses):]}")
            for i, (a, b) in enumerate(zip(gathered_snapshot(engine.module), ref["params"], strict=True)):
                if not torch.equal(a, b):
                    raise AssertionError(f"{name} rank {rank}: parameter {i} differs "
                                         f"(max {(a.float() - b.float()).abs().max():.3e})")
            got = (engine.global_steps, engine.get_loss_scale(), engine.get_lr())
            if got != (ref["steps"], ref["scale"], ref["lr"]):
                raise AssertionError(f"{name}: counters / loss scale / lr differ")
            print(f"RESUME OK {name} rank {rank}: {len(losses)} micro-batch losses and all parameters "
                  "bitwise equal", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
