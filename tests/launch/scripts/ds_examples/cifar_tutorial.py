"""In the style of DeepSpeedExamples' CIFAR-10 tutorial (training/cifar/cifar10_deepspeed.py), written
anew: the tutorial's small CNN, a synthetic CIFAR-shaped dataset, the data loader from
`deepspeed.initialize`, fp32/fp16/bf16 from the config; save, then a new process loads and continues.

    torchrun --nproc-per-node=2 cifar_tutorial.py --deepspeed_config ds.json --out DIR --phase save|resume
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from common import check_framework, import_deepspeed, record_losses

deepspeed = import_deepspeed()
# The tutorial's `from deepspeed.accelerator import get_accelerator` and
# `from deepspeed.moe.utils import ...` need a module named "deepspeed" (the compatibility alias);
# attribute access reaches the same functions through the renamed import.
get_accelerator = deepspeed.accelerator.get_accelerator
split_params_into_different_moe_groups_for_optimizer = (
    deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer)


class Net(nn.Module):
    """The tutorial's LeNet-style CNN for 3x32x32 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def synthetic_cifar(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    images = torch.rand(n, 3, 32, 32, generator=g) * 2 - 1  # as Normalize((0.5,)*3, (0.5,)*3) gives
    labels = torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def create_moe_param_groups(model: nn.Module) -> list[dict]:
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", choices=("save", "resume"), required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    trainset = synthetic_cifar(256)
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    args.deepspeed_config = None  # given as config= below, as the tutorial does
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=create_moe_param_groups(net), training_data=trainset,
        config=ds_config)

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    ckpt = f"{args.out}/ckpt"
    if args.phase == "resume":
        model_engine.load_checkpoint(ckpt)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for step, (inputs, labels) in enumerate(trainloader):
        if step == args.steps:
            break
        inputs, labels = inputs.to(local_device), labels.to(local_device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    if args.phase == "save":
        model_engine.save_checkpoint(ckpt)
    check_framework(deepspeed)
    record_losses(args.out, args.phase, deepspeed.comm.get_rank(), losses)
    print(f"rank {local_rank} {args.phase} losses {losses}", flush=True)


if __name__ == "__main__":
    main()
