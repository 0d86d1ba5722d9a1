"""`zeroshard train`: the built-in example, a small GPT on the shipped corpus, end to end.

With `--nproc N > 1` outside a distributed job it re-launches itself under torch's elastic
launcher (one node, N processes); inside a job it trains on the group the launcher made.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from zeroshard.errors import ZeroshardError


def example_config_path(name: str) -> Path:
    """Path of a shipped example config, e.g. "stage0_fp32" (see zeroshard/examples/configs)."""
    path = Path(str(resources.files("zeroshard.examples").joinpath(f"configs/{name}.json")))
    if not path.exists():
        names = sorted(p.stem for p in path.parent.glob("*.json"))
        raise ZeroshardError(f"no example config {name!r}; shipped: {', '.join(names)}")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zeroshard train", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True,
                   help="a ds_config.json path, or the name of a shipped example (e.g. stage0_fp32)")
    p.add_argument("--nproc", type=int, default=1, help="processes (ranks) on this machine")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    p.add_argument("--model", default="small", choices=["tiny", "small", "25m"], help="GPT size preset")
    p.add_argument("--seed", type=int, default=1234)
    return p


def _relaunch(args: argparse.Namespace) -> int:
    # Forward the parsed options in full spelling: torch.distributed.run's own parser would
    # take an abbreviation such as --nproc as one of its options.
    forwarded = ["--config", args.config, "--steps", str(args.steps), "--model", args.model,
                 "--seed", str(args.seed)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "-m", "zeroshard.cli.train", *forwarded]
    return subprocess.call(cmd)


def train(args: argparse.Namespace) -> int:
    from zeroshard import initialize
    from zeroshard.examples.gpt import GPT, CharDataset, GPTConfig, load_corpus

    config = args.config if args.config.endswith(".json") else str(example_config_path(args.config))
    torch.manual_seed(args.seed)
    gpt_cfg = GPTConfig.preset(args.model)
    model = GPT(gpt_cfg)
    dataset = CharDataset(load_corpus(), gpt_cfg.block_size)
    engine, _, loader, _ = initialize(model=model, model_parameters=model.parameters(),
                                      training_data=dataset, config=config)
    n_params = sum(p.numel() for p in model.parameters())
    if engine.rank == 0:
        print(f"[zeroshard] training GPT ({args.model}, {n_params / 1e6:.2f}M params) for "
              f"{args.steps} steps on {len(dataset)} samples", flush=True)
    engine.train()
    while engine.global_steps < args.steps:
        for x, y in loader:
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            if engine.global_steps >= args.steps:  # only ever reached at a step boundary
                break
    engine.print_summary()
    _print_model_state_saving(engine, n_params)
    # Leave the process group explicitly, after every rank is done: left to interpreter exit,
    # the teardown of gloo and the comm watcher can race with a peer that already exited.
    from zeroshard.comm import destroy_distributed

    engine.comm.barrier()
    destroy_distributed()
    return 0


def _print_model_state_saving(engine: Any, n_params: int) -> None:
    """What ZeRO saved: this run's model-state bytes per rank against plain data parallelism.

    Every rank must call it (one all-gather). The stage-0 figure is the estimator's exact
    stage-0 accounting for the same precision, gradient dtype and optimizer.
    """
    from zeroshard.estimate.spec import spec_from_counts
    from zeroshard.estimate.states import Setup, estimate_rank
    from zeroshard.runtime.monitor import format_bytes

    held = engine.model_state_bytes()
    mine = torch.tensor([sum(s.total for s in held)], dtype=torch.int64, device=engine.device)
    every = torch.zeros(engine.world_size, dtype=torch.int64, device=engine.device)
    engine.comm.all_gather(every, mine)
    setup = dataclasses.replace(Setup.from_config(engine.zs_config), zero_stage=0,
                                offload_optimizer="none", offload_param="none")
    zero_stage0_bytes = estimate_rank(spec_from_counts(n_params), setup).device.total
    if engine.rank != 0:
        return
    homes = " + ".join(f"{format_bytes(s.total)} {s.device}" for s in held if s.total)
    ranks = ", ".join(f"rank {r}: {format_bytes(int(b))}" for r, b in enumerate(every.tolist()))
    ratio = zero_stage0_bytes / max(1, int(every.max()))
    print(f"[zeroshard] model states per rank (stage {engine.zs_config.zero_optimization.stage}): "
          f"{ranks} (rank 0: {homes}) | stage 0 would hold {format_bytes(zero_stage0_bytes)} on every rank "
          f"({ratio:.1f}x the largest rank here)", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.nproc < 1:
        print("zeroshard train: --nproc must be >= 1", file=sys.stderr)
        return 2
    if args.nproc > 1 and "RANK" not in os.environ:
        return _relaunch(args)
    try:
        code = train(args)
    except ZeroshardError as e:
        print(f"zeroshard train: {e}", file=sys.stderr)
        return 2
    # A normal interpreter exit: the abort at teardown that os._exit used to hide here is fixed
    # where it came from (Note: [watcher shutdown] in comm/divergence.py).
    return code


if __name__ == "__main__":
    sys.exit(main())
