"""`engine.compile()` against the eager engine: the same per-step losses (fp32, 1e-6 relative) and
weights at ZeRO stages 0 and 3, with the graph breaks counted and logged.

Compiling costs ~15 s per stage on two cores, so the sweep is the two ends (stage 0: no module
hooks, one graph; stage 3: the gather/release hooks stay eager, a graph break at each);
bench/compile_step.py times all four stages. Runs at 1 and 2 ranks (skipped at 3).
"""

from __future__ import annotations

import pytest
from engine_helpers import (
    assert_params_close,
    capture_zeroshard_log,
    global_batches,
    init_engine,
    make_config,
    make_model,
    train_engine,
)

from zeroshard.comm import ProcessGroups

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
