"""A DeepSpeed tutorial-style training script, ported to zeroshard by its import line alone.

A small CNN learns to classify synthetic 32x32 RGB images (CIFAR-10's shape, no download). The
script does what DeepSpeed's tutorials do: `add_config_arguments`, `initialize(args=...,
model=..., model_parameters=...)`, `engine.backward` / `engine.step`, `save_checkpoint`,
`load_checkpoint` and reading the fp32 master weights with `safe_get_full_fp32_param`.

    torchrun --nproc-per-node=2 examples/deepspeed_port/train.py \
        --deepspeed --deepspeed_config examples/deepspeed_port/ds_config.json

To run it under DeepSpeed instead, change only the import below to `import deepspeed`
(tests/launch/test_deepspeed_example.py does, and compares the losses step by step).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as deepspeed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(8, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def get_args():
    parser = argparse.ArgumentParser(description="CNN on synthetic CIFAR-shaped data")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps before the checkpoint")
    parser.add_argument("--resume_steps", type=int, default=3, help="steps after it, run twice")
    parser.add_argument("--checkpoint_dir", type=str, default="checkpoints")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def micro_batch(step, micro, rank, world, size):
    """This rank's micro-batch `micro` of optimizer step `step`: the same global batch under any
    world size and engine (synthetic labels follow a fixed linear rule of the pixels)."""
    g = torch.Generator().manual_seed(1000 + step)
    n = size * world
    images = torch.randn(n * (micro + 1), 3, 32, 32, generator=g)[n * micro : n * (micro + 1)]
    labels = (images.mean(dim=(1, 2, 3)) * 40).long().clamp(-5, 4) + 5
    return images[rank * size : (rank + 1) * size], labels[rank * size : (rank + 1) * size]


def train_steps(engine, first, count, rank, world):
    for step in range(first, first + count):
        total = torch.zeros(1)
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = micro_batch(step, micro, rank, world, engine.train_micro_batch_size_per_gpu())
            loss = F.cross_entropy(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().cpu()
        total /= engine.gradient_accumulation_steps() * world
        deepspeed.comm.all_reduce(total)
        if rank == 0:
            print(f"step {step + 1} loss {total.item():.8f} lr {engine.get_lr()[0]:.8f}", flush=True)


def main():
    args = get_args()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters)
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()

    train_steps(engine, 0, args.steps, rank, world)
    engine.save_checkpoint(args.checkpoint_dir, client_state={"step": args.steps})
    train_steps(engine, args.steps, args.resume_steps, rank, world)

    _, client_state = engine.load_checkpoint(args.checkpoint_dir)
    if rank == 0:
        print(f"resumed at step {client_state['step']}", flush=True)
    train_steps(engine, client_state["step"], args.resume_steps, rank, world)

    norm = deepspeed.utils.safe_get_full_fp32_param(engine.module.fc2.weight).norm().item()  # every rank calls it
    if rank == 0:
        print(f"fc2.weight fp32 norm {norm:.8f}", flush=True)


if __name__ == "__main__":
    main()
