"""Activation checkpointing on CUDA: `cpu_checkpointing` keeps checkpointed inputs in CPU memory,
and the recompute replays the CUDA generator (dropout) exactly."""

from __future__ import annotations

import torch
from torch import nn

import zeroshard.checkpointing as ckpt
from zeroshard.activation_checkpointing import _unconfigure


def _blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Dropout(0.1)) for _ in range(8)).cuda()


def _run(blocks: nn.ModuleList, checkpoint_in_cpu: bool | None) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(1)
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
    blocks.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    h = x
    for b in blocks:
        h = ckpt.checkpoint(b, h) if checkpoint_in_cpu is not None else b(h)
    held = torch.cuda.memory_allocated() - base  # what forward keeps for backward
    h.sum().backward()
    return held, [p.grad.clone() for p in blocks.parameters()]


def test_cpu_checkpointing_moves_checkpointed_inputs_off_the_device(groups) -> None:
    """With cpu_checkpointing the device holds no checkpointed inputs between forward and
    backward (8 x 16 MiB here), and the gradients are bitwise those without checkpointing."""
    blocks = _blocks()
    try:
        _, want = _run(blocks, None)
        ckpt.configure(None, checkpoint_in_cpu=False)
        on_device, got = _run(blocks, False)
        ckpt.configure(None, checkpoint_in_cpu=True)
        on_cpu, got_cpu = _run(blocks, True)
    finally:
        _unconfigure()
    layer_input = 4096 * 1024 * 4
    assert on_device >= 7 * layer_input, f"checkpointed inputs on the device: {on_device / 2**20:.0f} MiB"
    assert on_cpu <= on_device - 6 * layer_input, f"cpu_checkpointing kept {on_cpu / 2**20:.0f} MiB on the device"
    for a, b, c in zip(got, got_cpu, want):
        assert torch.equal(a, c) and torch.equal(b, c)
