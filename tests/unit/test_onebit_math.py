"""The 1-bit all-reduce's math (optim/onebit_allreduce.py), with the ranks simulated in one process: chunk
layout, pack/unpack of chunked signs, the error-feedback invariant, and 1-bit Adam's refusals."""

from __future__ import annotations

import pytest
import torch

from zeroshard.comm.codecs import pack_signs, unpack_signs
from zeroshard.errors import ConfigError
from zeroshard.optim.onebit_adam import OneBitAdam
from zeroshard.optim.onebit_allreduce import chunk_range, decode, padded_numel, server_combine, worker_compress


@pytest.mark.parametrize("numel,world", [(1, 1), (100, 2), (4099, 3), (64, 8), (8, 1)])
def test_padding_and_chunks_cover_the_tensor_once(numel: int, world: int) -> None:
    padded = padded_numel(numel, world)
    assert padded >= numel and padded % (8 * world) == 0 and padded - numel < 8 * world
    covered = []
    for r in range(world):
        start, end = chunk_range(numel, world, r)
        covered.extend(range(start, end))
    assert covered == list(range(numel))


def test_chunked_signs_unpack_like_the_whole() -> None:
    """Cutting the packed bytes into world-size rows (the all-to-all) decodes to the same signs."""
    x = torch.randn(48 * 3, generator=torch.Generator().manual_seed(0))
    packed = pack_signs(x)
    rows = packed.bits.view(3, -1)
    scales = packed.scale.repeat(3)
    assert torch.equal(decode(rows, scales, x.numel()), unpack_signs(packed))
    assert torch.equal(unpack_signs(packed) > 0, x >= 0)


def _simulate(inputs: list[list[torch.Tensor]], numel: int) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                      list[torch.Tensor]]:
    """Run the two phases for `world` simulated ranks over T steps; outputs, worker and server errors."""
    world = len(inputs[0])
    padded = padded_numel(numel, world)
    worker = [torch.zeros(numel) for _ in range(world)]
    ranges = [chunk_range(numel, world, r) for r in range(world)]
    server = [torch.zeros(e - s) for s, e in ranges]
    outputs = []
    for xs in inputs:
        sent = [worker_compress(x, worker[r], padded) for r, x in enumerate(xs)]
        scales = torch.stack([p.scale for p in sent])
        served = []
        for s in range(world):  # rank s receives chunk s of every rank's bits (the all-to-all)
            rows = torch.stack([p.bits.view(world, -1)[s] for p in sent])
            served.append(server_combine(rows, scales, server[s]))
        out = decode(torch.stack([p.bits for p in served]), torch.stack([p.scale for p in served]), numel)
        outputs.append(out)
    server_full = torch.cat(server)
    return outputs, worker, [server_full]


@pytest.mark.parametrize("world,numel", [(1, 37), (2, 100), (3, 1001)])
def test_error_feedback_invariant(world: int, numel: int) -> None:
    """sum_t out_t == sum_t mean_r x_{r,t} - mean_r e_r - f, with e, f the final errors: nothing
    the signs fail to carry is lost, it waits in an error buffer. fp32 sums of T=30 terms of
    magnitude ~1 round at ~T * 2^-24 * |terms| per element: 1e-4 absolute is well above that."""
    g = torch.Generator().manual_seed(world)
    steps = 30
    inputs = [[torch.randn(numel, generator=g) for _ in range(world)] for _ in range(steps)]
    outputs, worker, (server,) = _simulate(inputs, numel)
    total_out = torch.stack(outputs).sum(0)
    total_in = torch.stack([torch.stack(xs).mean(0) for xs in inputs]).sum(0)
    residual = torch.stack(worker).mean(0) + server
    torch.testing.assert_close(total_out, total_in - residual, atol=1e-4, rtol=0)
    # The errors stay bounded (a contraction, comm/codecs.py): far below the summed input.
    assert residual.norm() < 0.5 * total_in.abs().sum()


def test_constant_average_is_carried_in_the_long_run() -> None:
    """For constant inputs, the running mean of the 1-bit outputs tends to the true average
    (error feedback), while one 1-bit output alone is far from it."""
    numel, world, steps = 200, 3, 400
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(numel, generator=g) for _ in range(world)]
    outputs, _, _ = _simulate([xs] * steps, numel)
    want = torch.stack(xs).mean(0)
    first_err = (outputs[0] - want).norm() / want.norm()
    mean_err = (torch.stack(outputs).mean(0) - want).norm() / want.norm()
    assert first_err > 0.3, first_err
    assert mean_err < 0.05, mean_err


def test_onebit_adam_refuses_by_name() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ConfigError, match="freeze_step"):
        OneBitAdam(p, freeze_step=0)
    with pytest.raises(ConfigError, match="comm_backend_name: 'mpi' is not supported"):
        OneBitAdam(p, comm_backend_name="mpi")
    with pytest.raises(ConfigError, match="cuda_aware"):
        OneBitAdam(p, cuda_aware=True)
    with pytest.raises(RuntimeError, match=r"before attach\(\)"):
        OneBitAdam(p).step()
