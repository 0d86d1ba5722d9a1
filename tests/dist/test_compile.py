"""`engine.compile()` against the eager engine: the same per-step losses (fp32, 1e-6 relative) and
weights at ZeRO stages 0 and 3, with AutoTP and with a pipeline, the graph breaks counted and logged.

Compiling costs ~15 s per stage on two cores, so the sweep is the two ends (stage 0: no module
hooks, one graph; stage 3: the gather/release hooks stay eager, a graph break at each);
bench/compile_step.py times all four stages. Runs at 1 and 2 ranks (skipped at 3). AutoTP (TP 2,
and TP 2 x DP 2 at 4 ranks: tests/run.py's dist4) at ZeRO 0 and 3, and with its sequence
parallelism at ZeRO 1: the collectives stay eager, a graph break at each. A pipeline (one stage at
1 rank, PP 2, and PP 2 x DP 2 at 4 ranks) at ZeRO 0, 1 and 3, tied embedding and head: each layer
of the stage is compiled, the schedule stays eager.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from engine_helpers import (
    assert_params_close,
    capture_zeroshard_log,
    global_batches,
    init_engine,
    make_config,
    make_model,
    train_engine,
)
from test_pipeline import BASE_SEED, data, loss_fn, pipe_config, specs
from tp_helpers import batches, lm_loss, tiny_llama, tp_config

import zeroshard
from zeroshard.comm import ProcessGroups
from zeroshard.pipe import PipelineModule
from zeroshard.runtime.compile import CompileStats

STEPS = 3


@pytest.mark.parametrize("stage", [0, 3])
def test_compiled_steps_equal_eager(groups: ProcessGroups, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    if world > 2:  # the same on every rank; compiling costs ~15 s a stage, so 1 and 2 ranks only
        pytest.skip("compiled-vs-eager parity runs at world sizes 1 and 2 (compile time budget)")
    zero = {"stage": stage, "reduce_bucket_size": 500}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every unit gathered and released by its hooks
    cfg = make_config(zero_optimization=zero)
    batches = global_batches(STEPS, 2 * world)
    want_losses, want_params = train_engine(init_engine(make_model(), cfg), batches, rank, world)

    engine = init_engine(make_model(), cfg)
    assert not engine.is_compiled and engine.compile_stats is None
    engine.compile()
    engine.compile()  # a second call does nothing, as in DeepSpeed
    assert engine.is_compiled
    with capture_zeroshard_log() as log:
        losses, params = train_engine(engine, batches, rank, world)

    for step, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
        assert abs(got - want) <= 1e-6 * abs(want), f"step {step}: compiled loss {got!r} != eager {want!r}"
    assert_params_close(params[-1], want_params[-1], rtol=1e-5, what=f"stage {stage} compiled vs eager")
    stats = engine.compile_stats
    assert stats is not None and stats.forwards == STEPS and stats.recompiles == 0, stats
    assert stats.first_forward_s is not None and stats.graphs >= 1
    if stage == 0:
        assert stats.graph_breaks == 0 and stats.graphs == 1, stats.summary()
    else:  # only zeroshard's unit hooks break the graph
        hooks = {r.rpartition("(")[2].rstrip(")") for r in stats.break_reasons}
        assert hooks == {"Stage3Strategy._pre_forward", "Stage3Strategy._post_forward"}, stats.break_reasons
        assert stats.graph_breaks >= 2 and stats.graphs >= 2, stats.summary()
    if rank == 0:
        text = log.getvalue()
        assert text.count("engine.compile: first forward compiled") == 1, text
        assert f"{stats.graph_breaks} graph break(s)" in text, text


def _whole_close(got: dict[str, torch.Tensor] | None, want: dict[str, torch.Tensor] | None, what: str) -> None:
    """The whole weights (world rank 0's consolidated state_dict; None elsewhere) within 1e-5 relative."""
    assert (got is None) == (want is None), what
    if got is not None and want is not None:
        assert got.keys() == want.keys() and got, what
        assert_params_close([got[k].float() for k in want], [want[k].float() for k in want], rtol=1e-5, what=what)


def _sources(stats: CompileStats) -> set[str]:
    """The functions the graph breaks name (`_short`'s parenthesis)."""
    return {r.rpartition("(")[2].rstrip(")") for r in stats.break_reasons}


STAGE3_HOOKS = {"Stage3Strategy._pre_forward", "Stage3Strategy._post_forward"}
TP_COLLECTIVES = {"copy_to_tp", "reduce_from_tp", "gather_from_tp"}  # a Llama's q/k/v + gate/up, o + down, head
SP_COLLECTIVES = {"_split", "_gather_in", "_join", "reduce_scatter_seq"}  # tensor_parallel/sequence.py


@pytest.mark.parametrize("stage, sequence_parallel", [(0, False), (3, False), (1, True)])
def test_compiled_tensor_parallel_equals_eager(groups: ProcessGroups, stage: int, sequence_parallel: bool) -> None:
    """AutoTP at TP 2 (2 ranks) and TP 2 x DP 2 (4 ranks), and with its sequence parallelism:
    compiled == eager, every graph break at a tensor-parallel collective (or stage 3's hooks), the
    collectives' numbers unchanged."""
    world = groups.world_size
    if world not in (2, 4):
        pytest.skip(f"compiled AutoTP runs at TP 2 (2 ranks) and TP 2 x DP 2 (4 ranks); this run has {world}")
    tp, dp = 2, world // 2
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = tp_config(tp, stage, dp, zero_optimization=zero)
    data_ = batches(STEPS, dp)

    def run(compiled: bool) -> tuple[Any, list[float], dict[str, torch.Tensor] | None]:
        model = tiny_llama()
        if sequence_parallel:
            model = zeroshard.tp_model_init(model, tp, torch.float32, sequence_parallel=True)
        engine, *_ = zeroshard.initialize(model=model, config=cfg)
        assert engine.parallel.tp.sequence_parallel == sequence_parallel
        if compiled:
            engine.compile()
        rank = engine.parallel.dp.rank
        losses = []
        for step in data_:
            loss = lm_loss(engine, step[rank])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return engine, losses, engine._zero3_consolidated_16bit_state_dict()

    _, want, want_w = run(False)
    with capture_zeroshard_log() as log:
        engine, got, got_w = run(True)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-6 * abs(w), f"step {step}: compiled loss {g!r} != eager {w!r}"
    _whole_close(got_w, want_w, f"TP {tp} x DP {dp} stage {stage} compiled vs eager")
    stats = engine.compile_stats
    assert stats is not None and stats.forwards == STEPS and stats.recompiles == 0, stats
    # Only what this engine traced is counted: code Dynamo compiled for an earlier engine of the same
    # classes in this process (the stage-0 case) is reused, its breaks not reported again.
    sources = _sources(stats)
    collectives = SP_COLLECTIVES if sequence_parallel else TP_COLLECTIVES
    assert sources & collectives and sources <= TP_COLLECTIVES | SP_COLLECTIVES | STAGE3_HOOKS, stats.break_reasons
    assert bool(sources & STAGE3_HOOKS) == (stage == 3), stats.break_reasons
    if groups.rank == 0:
        assert f"{stats.graph_breaks} graph break(s)" in log.getvalue(), log.getvalue()


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_compiled_pipeline_equals_eager(groups: ProcessGroups, zero: int) -> None:
    """PP 2 (2 ranks) and PP 2 x DP 2 (4 ranks), a tied embedding / head: each layer of the stage
    compiled, the schedule's sends and receives eager; compiled == eager. One rank: one stage, the
    micro-batches run without a schedule through the same compiled layers."""
    world = groups.world_size
    if world not in (1, 2, 4):
        pytest.skip(f"the compiled pipeline runs at PP 1, PP 2 (2 ranks) and PP 2 x DP 2 (4 ranks); this run has "
                    f"{world}")
    stages, blocks = min(world, 2), 2
    dp = world // stages
    cfg = pipe_config(zero, clip=0.0)
    if zero == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0

    def run(compiled: bool) -> tuple[Any, list[float], dict[str, torch.Tensor] | None]:
        net = PipelineModule(specs(blocks, True), num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                             base_seed=BASE_SEED)
        engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)
        if compiled:
            engine.compile()
        losses = [float(engine.train_batch(iter(batch[groups.rank % dp]))) for batch in data(STEPS, dp)]
        return engine, losses, engine._zero3_consolidated_16bit_state_dict()

    _, want, want_w = run(False)
    with capture_zeroshard_log() as log:
        engine, got, got_w = run(True)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(g, w, rel_tol=1e-6), f"step {step}: compiled loss {g!r} != eager {w!r}"
    _whole_close(got_w, want_w, f"PP {stages} x DP {dp} ZeRO {zero} compiled vs eager")
    stats = engine.compile_stats
    # Each stage's modules and the tied head's forward_fn: embed + block / block + head (4 on one stage)
    assert stats is not None and stats.regions == 4 // stages and stats.regions_run == stats.regions, stats
    assert stats.forwards >= STEPS * engine.micro_batches and stats.recompiles == 0, stats
    assert _sources(stats) <= STAGE3_HOOKS, stats.break_reasons
    if groups.rank == 0:
        assert log.getvalue().count("engine.compile: first forward compiled") == 1, log.getvalue()
