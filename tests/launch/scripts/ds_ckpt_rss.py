"""Peak memory of loading a DeepSpeed checkpoint vs zeroshard's own, same model (a manual measurement).

    torchrun --nproc-per-node=2 ds_ckpt_rss.py ds-save DIR CASE   DeepSpeed: 1 step of the 25M GPT, save DIR/CASE
    python ds_ckpt_rss.py load DIR CASE STAGE [zs]               zeroshard at world 1: load DIR/CASE (or,
                                                                 with zs, DIR/CASE-zs, saving it first if absent)

Prints "RSS <what>: load peak +X MiB over the process before the load (model states Y MiB)".
The kernel's peak-RSS counter is reset just before the load (/proc/self/clear_refs), so the peak
is the load's own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ds_ckpt_common import ds_config, parse_case

from zeroshard.examples.gpt import GPT, GPTConfig


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("25m"))


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def ds_save(root: Path, case: str) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    cfg = {**ds_config(case, world), "gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 1}
    net = model()
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)
    x = torch.randint(0, 256, (1, 32))
    engine.backward(engine(x, x))
    engine.step()
    engine.save_checkpoint(str(root / case))


def load(root: Path, case: str, stage: int, own: bool) -> None:
    import zeroshard

    cfg = {**ds_config(case, 1, stage), "gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 1}
    engine, _, _, _ = zeroshard.initialize(model=model(), config=cfg)
    src = root / case
    if own:
        zs = root / f"{case}-zs"
        if not zs.exists():
            engine.load_checkpoint(src)
            engine.save_checkpoint(zs)
            print("saved", zs)
            return
        src = zs
    n = sum(p.numel() for p in engine.module.parameters())
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    engine.load_checkpoint(src)
    peak = _status("VmHWM")
    _, precision, _ = parse_case(case)
    states = n * (2 if precision != "fp32" else 0) + n * 4 * 3  # lp weights + fp32 master + 2 moments
    print(f"RSS {'zeroshard' if own else 'DeepSpeed'} checkpoint {case} -> stage {stage}: load peak "
          f"+{peak - before:.0f} MiB over the process before the load (model states {states / 2**20:.0f} MiB, "
          f"{n / 1e6:.1f}M params)", flush=True)


if __name__ == "__main__":
    mode, root, case = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if mode == "ds-save":
        ds_save(root, case)
    else:
        load(root, case, int(sys.argv[4]), len(sys.argv) > 5 and sys.argv[5] == "zs")
