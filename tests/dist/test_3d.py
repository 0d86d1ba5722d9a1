"""3D parallelism: a PipelineModule with AutoTP on each stage and ZeRO over the data-parallel ranks,
against the same layers trained in one process (fp32, gradient clipping on).

World 8 (tests/run.py's dist8 stage): PP 2 x DP 2 x TP 2. World 4 (dist4): PP 2 x DP 1 x TP 2.
Other world sizes skip (3D needs pp * tp = 4 to divide the world). Per-step losses, the global
gradient norm and the final whole weights agree within 1e-5 relative; a save after step 2 loaded
into a fresh engine continues exactly as the uninterrupted run. engine.compile() equals the eager
engine at PP 2 x TP 2.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_layers import Embed
from torch import Tensor, nn

import zeroshard
from zeroshard.comm import Comm, ProcessGroups
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.pipe import LayerSpec, PipelineModule, PipeModelDataParallelTopology, TiedLayerSpec
from zeroshard.tensor_parallel import ColumnParallelLinear, RowParallelLinear

VOCAB, DIM, HEADS, SEQ = 16, 16, 4, 6
MICRO, GAS, STEPS = 2, 2, 4
BASE_SEED, LR, CLIP = 1234, 1e-2, 0.05
PP, TP = 2, 2
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-5
"""Final whole weights: max |difference| relative to the parameter's largest value."""

LAYER_SPECS = [  # tensor_parallel.partition_config: Megatron's pairs, and one standalone layer gathered
    {"patterns": [r".*\.attn\.[qkv]\.weight$", r".*\.mlp\.fc\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.attn\.o\.weight$", r".*\.mlp\.proj\.weight$"], "partition_type": "row"},
    {"patterns": [r"5\.weight$"], "partition_type": "column", "gather_output": True},
]


class Attention(nn.Module):
    """Causal self-attention; the heads it runs are the ones its (possibly split) q holds."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        # No bias on k: its gradient is zero in exact arithmetic (a constant per query row under the
        # softmax), so Adam would amplify round-off noise into lr-sized steps of either sign.
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=name != "k") for name in "qkvo")

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        head = DIM // HEADS

        def heads(y: Tensor) -> Tensor:
            return y.view(b, t, -1, head).transpose(1, 2)  # [b, local heads, t, head]

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(dim), Attention(dim), nn.LayerNorm(dim), Mlp(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def tied_head(embed: Embed, x: Tensor) -> Tensor:
    return F.layer_norm(x, (DIM,)) @ embed.weight.t()


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def specs() -> list[Any]:
    """Embedding (tied), 4 blocks, a standalone Linear (split as a layer of its own), the tied head:
    the uniform partition puts layers 0-3 on stage 0 and 4-6 on stage 1."""
    return [TiedLayerSpec("embed", Embed, VOCAB, DIM), *[LayerSpec(Block, DIM) for _ in range(4)],
            LayerSpec(nn.Linear, DIM, DIM), TiedLayerSpec("embed", Embed, VOCAB, DIM, forward_fn=tied_head)]


def reference_model() -> nn.ModuleDict:
    layers = nn.ModuleDict()
    for idx, spec in enumerate(specs()):
        torch.manual_seed(BASE_SEED + idx)
        if isinstance(spec, TiedLayerSpec):
            if "tied_modules" not in layers:
                layers["tied_modules"] = nn.ModuleDict({spec.key: spec.build()})
            continue
        layers[str(idx)] = spec.build()
    return layers


def reference_forward(model: nn.ModuleDict, ids: Tensor) -> Tensor:
    embed = model["tied_modules"]["embed"]
    x = embed(ids)
    for idx in range(1, 6):
        x = model[str(idx)](x)
    return tied_head(embed, x)


def data(dp: int) -> list[list[list[tuple[Tensor, Tensor]]]]:
    """[step][dp rank][micro-batch] -> (ids, labels)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (dp, GAS, MICRO, SEQ + 1), generator=g)
        out.append([[(tokens[d, m, :, :-1], tokens[d, m, :, 1:]) for m in range(GAS)] for d in range(dp)])
    return out


_REFERENCE: dict[int, tuple[list[float], list[float], dict[str, Tensor]]] = {}


def reference(dp: int) -> tuple[list[float], list[float], dict[str, Tensor]]:
    """One process: per-step losses, pre-clip global norms and the final weights (cached)."""
    if dp not in _REFERENCE:
        model = reference_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        losses, norms = [], []
        for batch in data(dp):
            total = 0.0
            for rank_batches in batch:
                for ids, labels in rank_batches:
                    loss = loss_fn(reference_forward(model, ids), labels)
                    (loss / (GAS * dp)).backward()
                    total += loss.item() / (GAS * dp)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
            losses.append(total)
        _REFERENCE[dp] = (losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return _REFERENCE[dp]


def config(zero: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": CLIP, "steps_per_print": 1000,
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 64},
        "tensor_parallel": {"autotp_size": TP, "partition_config": {"layer_specs": LAYER_SPECS}},
    }
    cfg.update(extra)
    return cfg


def build(groups: ProcessGroups, cfg: dict[str, Any], *, seed: int = BASE_SEED, topology: bool = False) -> Any:
    dp = groups.world_size // (PP * TP)
    kwargs: dict[str, Any] = ({"topology": PipeModelDataParallelTopology(num_pp=PP, num_mp=TP, num_dp=dp)}
                              if topology else {"num_stages": PP})
    net = PipelineModule(specs(), loss_fn=loss_fn, seed_layers=True, base_seed=seed, partition_method="uniform",
                         **kwargs)
    return zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)[0]


def train(engine: Any, steps: list[Any]) -> tuple[list[float], list[float]]:
    dp_rank = engine.parallel.mesh.coord["dp"]
    losses, norms = [], []
    for batch in steps:
        losses.append(float(engine.train_batch(iter(batch[dp_rank]))))
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def whole_weights(engine: Any) -> dict[str, Tensor] | None:
    """The stage's whole weights (tensor-parallel pieces joined, stage-3 shards gathered) on the
    stage's first rank; None on the others (every rank of the stage takes part)."""
    return engine._zero3_consolidated_16bit_state_dict()


def check_weights(got: dict[str, Tensor] | None, want: dict[str, Tensor], rtol: float) -> float:
    """Max relative deviation of a stage's whole weights from `want` (0 where `got` is None)."""
    if got is None:
        return 0.0
    worst = 0.0
    for name, value in got.items():
        ref = want[name]
        assert value.shape == ref.shape, (name, value.shape, ref.shape)
        err = (value.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        assert err < rtol, f"{name}: max relative deviation {err:.2e}"
        worst = max(worst, err)
    return worst


@pytest.fixture(autouse=True)
def _needs_3d(groups: ProcessGroups) -> None:
    if groups.world_size % (PP * TP):
        pytest.skip(f"3D (pp {PP} x tp {TP}) needs a multiple of {PP * TP} ranks (this run has {groups.world_size})")


def test_stages_are_split_over_tp(groups: ProcessGroups) -> None:
    engine = build(groups, config(1), topology=True)
    topo = engine.parallel.mesh.topology
    assert (topo.pp, topo.dp, topo.tp) == (PP, groups.world_size // (PP * TP), TP)
    assert engine.dp_world_size == topo.dp and engine.mp_world_size == TP
    module = engine.module
    local = dict(module.local_layers())
    for layer in local.values():
        if isinstance(layer, Block):
            assert isinstance(layer.attn.q, ColumnParallelLinear) and isinstance(layer.attn.o, RowParallelLinear)
            assert layer.mlp.fc.weight.shape == (2 * DIM // TP, DIM)
    if engine.is_last_stage():  # the standalone Linear layer (5) runs as its split replacement
        assert isinstance(local[5], ColumnParallelLinear) and local[5].gather_output
    assert module.tied_parameters("embed")[0].shape == (VOCAB, DIM)  # a tied weight stays whole
    # Tensor-parallel ranks are adjacent; a stage is a contiguous block (DeepSpeed's axis order).
    coord = engine.parallel.mesh.coord
    assert groups.rank == (coord["pp"] * topo.dp + coord["dp"]) * TP + coord["tp"]
    assert engine.stage_id == coord["pp"]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_matches_one_process_and_resumes(groups: ProcessGroups, shared_dir: Path, zero: int) -> None:
    """Uninterrupted 4 steps equal one process (losses, clipped global norms, weights); a save after
    step 2 loaded into a fresh engine continues with the same losses and weights."""
    dp = groups.world_size // (PP * TP)
    want_losses, want_norms, want = reference(dp)
    batches = data(dp)
    engine = build(groups, config(zero))
    losses, norms = train(engine, batches[:2])
    engine.save_checkpoint(shared_dir, tag="mid")
    more, more_norms = train(engine, batches[2:])
    losses, norms = losses + more, norms + more_norms
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses, strict=True))
    assert worst <= LOSS_RTOL, f"losses {losses} != one process {want_losses}"
    for a, b in zip(norms, want_norms, strict=True):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"global norm {a} != one process {b}"
    assert want_norms[-1] > CLIP  # the clip was active
    worst_weight = check_weights(whole_weights(engine), want, WEIGHT_RTOL)
    if groups.rank == 0:
        path = shared_dir / "mid"
        assert (path / "layer_00-model_01-model_states.pt").exists() and (path / "pipe_stage_01").is_dir()

    resumed = build(groups, config(zero), seed=BASE_SEED + 99)  # other initial values: the load replaces them
    loaded, _ = resumed.load_checkpoint(shared_dir, tag="mid")
    assert loaded is not None and resumed.global_steps == 2
    after, _ = train(resumed, batches[2:])
    for a, b in zip(after, losses[2:], strict=True):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7), f"resumed loss {a} != uninterrupted {b}"
    ref = whole_weights(engine)
    got = whole_weights(resumed)
    if got is not None and ref is not None:
        check_weights(got, ref, 1e-6)
    print(f"\n3D pp {PP} x dp {dp} x tp {TP}, ZeRO-{zero}: max |dloss|/loss vs one process {worst:.1e}, "
          f"max |dloss| {max(abs(a - b) for a, b in zip(losses, want_losses)):.1e}, weights (stage "
          f"{engine.stage_id}) {worst_weight:.1e}; resumed losses {after} vs uninterrupted {losses[2:]}")


def test_compiled_equals_eager(groups: ProcessGroups) -> None:
    """engine.compile() on 3D (PP 2 x TP 2, ZeRO 1): each layer of the stage compiled, the
    tensor-parallel collectives eager (a graph break at each), the schedule eager; the same losses
    (1e-6 relative) and whole weights as the eager engine."""
    if groups.world_size != PP * TP:
        pytest.skip(f"compiled 3D runs at PP {PP} x TP {TP} only (compile time budget; this run has "
                    f"{groups.world_size})")
    batches = data(1)
    eager = build(groups, config(1))
    want, _ = train(eager, batches)
    engine = build(groups, config(1))
    engine.compile()
    got, _ = train(engine, batches)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst <= 1e-6, f"compiled losses {got} != eager {want}"
    want_weights = whole_weights(eager)
    if want_weights is not None:
        check_weights(whole_weights(engine), want_weights, 1e-5)
    else:
        assert whole_weights(engine) is None
    stats = engine.compile_stats
    assert stats is not None and stats.regions >= 2 and stats.regions_run == stats.regions, stats
    sources = {r.rpartition("(")[2].rstrip(")") for r in stats.break_reasons}
    assert sources <= {"copy_to_tp", "reduce_from_tp", "gather_from_tp"}, stats.break_reasons


def test_fp16_overflow_on_one_rank_skips_everywhere(groups: ProcessGroups) -> None:
    cfg = config(1, fp16={"enabled": True, "initial_scale_power": 8})
    engine = build(groups, cfg)
    if groups.rank == groups.world_size - 1:  # the last stage's last tp rank: a replicated weight
        layer = dict(engine.module.local_layers())[4]
        layer.ln1.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    dp_rank = engine.parallel.mesh.coord["dp"]
    engine.train_batch(iter(data(groups.world_size // (PP * TP))[0][dp_rank]))
    assert engine.skipped_steps == 1 and not engine.was_step_applied()
    Comm(groups).barrier()


def test_refusals_name_what_is_missing(groups: ProcessGroups) -> None:
    with pytest.raises(ConfigError, match="model .tensor-parallel. axis of 2, but the tensor-parallel size is 4"):
        net = PipelineModule(specs(), loss_fn=loss_fn, partition_method="uniform",
                             topology=PipeModelDataParallelTopology(1, TP, groups.world_size // TP))
        zeroshard.initialize(model=net, model_parameters=list(net.parameters()),
                             config=config(1, tensor_parallel={"autotp_size": 4}))

    class Mpu:
        def __getattr__(self, name: str) -> Any:
            return lambda: 1

    with pytest.raises(NotSupportedError, match="PipelineModule together with mpu=.*PipeModelDataParallelTopology"):
        net = PipelineModule(specs(), loss_fn=loss_fn, num_stages=PP, partition_method="uniform")
        cfg = config(1)
        del cfg["tensor_parallel"]
        zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=cfg, mpu=Mpu())


def _split_by_hand(groups: ProcessGroups, seed: int) -> tuple[PipelineModule, Any]:
    """DeepSpeed's own 3D: a PipeModelDataParallelTopology with a model axis and layers the script
    split itself over its own tensor-parallel groups (Megatron's layers, here cut with the same plan),
    split parameters marked `tensor_model_parallel`; no tensor_parallel section."""
    from zeroshard.comm.groups import subgroup
    from zeroshard.comm.topology import Topology
    from zeroshard.config import load_config
    from zeroshard.tensor_parallel import resolve_plan, shard_model

    dp = groups.world_size // (PP * TP)
    tp_groups = subgroup(groups, Topology(pp=PP, dp=dp, tp=TP).axis_groups("tp"))
    net = PipelineModule(specs(), loss_fn=loss_fn, seed_layers=True, base_seed=seed, partition_method="uniform",
                         topology=PipeModelDataParallelTopology(num_pp=PP, num_mp=TP, num_dp=dp))
    section = config(0)["tensor_parallel"]
    plan = resolve_plan(net, load_config({"train_batch_size": 1, "tensor_parallel": section},
                                         dp_world_size=1).tensor_parallel)
    state = shard_model(net, plan, Comm(tp_groups), keep_whole=frozenset(map(id, net.tied_modules.parameters())))
    net.adopt_replaced_layers()
    for name, p in net.named_parameters():
        p.tensor_model_parallel = name in state.split
    return net, state


def test_layers_split_by_the_script(groups: ProcessGroups, shared_dir: Path) -> None:
    """A model axis in the PipelineModule's topology and no tensor_parallel section: ZeRO over dp, the
    norm over tp by the `tensor_model_parallel` marks; each TP rank's pieces checkpointed on their own."""
    dp = groups.world_size // (PP * TP)
    want_losses, want_norms, want = reference(dp)
    batches = data(dp)
    cfg = config(2)
    del cfg["tensor_parallel"]
    net, state = _split_by_hand(groups, BASE_SEED)
    engine = zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)[0]
    assert engine.dp_world_size == dp and engine.mp_world_size == TP
    losses, norms = train(engine, batches[:2])
    engine.save_checkpoint(shared_dir, tag="mid")
    more, more_norms = train(engine, batches[2:])
    for a, b in zip(losses + more, want_losses, strict=True):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"loss {a} != one process {b}"
    for a, b in zip(norms + more_norms, want_norms, strict=True):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"global norm {a} != one process {b}"
    whole = {name: state.full(name, p.detach()) for name, p in engine.module.named_parameters()}
    check_weights(whole, want, WEIGHT_RTOL)
    stage = f"pipe_stage_{engine.stage_id:02d}-model_{engine.parallel.mesh.coord['tp']:02d}"
    assert (shared_dir / "mid" / stage).is_dir()

    net2, _ = _split_by_hand(groups, BASE_SEED + 99)
    resumed = zeroshard.initialize(model=net2, model_parameters=list(net2.parameters()), config=cfg)[0]
    loaded, _ = resumed.load_checkpoint(shared_dir, tag="mid")
    assert loaded is not None and resumed.global_steps == 2
    after, _ = train(resumed, batches[2:])
    for a, b in zip(after, more, strict=True):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7), f"resumed loss {a} != uninterrupted {b}"


# -- checkpoints across layouts (issue 27 item 5) ----------------------------------------------------
#
# Every layer of a 3D checkpoint speaks global names (AutoTP pieces as ranges of whole parameters,
# stages as global layer indices), so one saved at PP 2 x TP 2 loads, with its optimizer state, into
# other pipeline and tensor-parallel degrees, ZeRO stages, and a run without a pipeline, and back.
# The global batch is the same in every layout (the same token draws regrouped), so each continuation
# must equal the one-process run's steps 3-4.


def regrouped(dp: int, gas: int, micro: int) -> list[list[list[tuple[Tensor, Tensor]]]]:
    """data()'s token draws split as [step][dp rank][micro-batch] for another (dp, gas, micro) with the
    same global batch (the generator fills the same values whatever the shape)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (dp, gas, micro, SEQ + 1), generator=g)
        out.append([[(tokens[d, m, :, :-1], tokens[d, m, :, 1:]) for m in range(gas)] for d in range(dp)])
    return out


def build_layout(groups: ProcessGroups, pp: int, tp: int, zero: int, gas: int, micro: int) -> Any:
    """A PipelineModule of the same layers at `pp` stages with AutoTP over `tp` (tp 1: no section),
    other initial values (a load must replace them all)."""
    cfg = config(zero, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)
    if tp == 1:
        del cfg["tensor_parallel"]
    else:
        cfg["tensor_parallel"] = {"autotp_size": tp, "partition_config": {"layer_specs": LAYER_SPECS}}
    net = PipelineModule(specs(), loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED + 7,
                         partition_method="uniform", num_stages=pp)
    return zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)[0]


def build_plain(groups: ProcessGroups, zero: int) -> Any:
    """The same layers without a pipeline (PipelineModule.to_sequential()), data parallel over the world."""
    net = PipelineModule(specs(), loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED + 11,
                         partition_method="uniform", num_stages=1).to_sequential()
    cfg = config(zero, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    del cfg["tensor_parallel"]
    return zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)[0]


def train_plain(engine: Any, groups: ProcessGroups, steps: list[Any]) -> list[float]:
    comm, losses = Comm(groups), []
    for batch in steps:
        (ids, labels), = batch[groups.rank]
        loss = loss_fn(engine(ids), labels)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().reshape(1).clone()
        comm.all_reduce(mean)
        losses.append(float(mean) / groups.world_size)
    return losses


def assert_continues(got: list[float], want: list[float], case: str) -> float:
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst <= LOSS_RTOL, f"{case}: continued losses {got} != one process {want}"
    return worst


def test_checkpoint_reshards_across_layouts(groups: ProcessGroups, shared_dir: Path) -> None:
    """3D PP 2 x TP 2 (ZeRO-1) -> PP 1 x TP 4 (ZeRO-2), PP 4 x TP 1 (ZeRO-3), no pipeline (ZeRO-1); and
    the run without a pipeline -> back into 3D (ZeRO-2): each continues as the one-process run."""
    world = groups.world_size
    dp = world // (PP * TP)
    want_losses, _, _ = reference(dp)
    engine = build(groups, config(1))
    train(engine, data(dp)[:2])
    engine.save_checkpoint(shared_dir, tag="3d")
    rows = []
    for pp, tp, zero, gas, micro in ((1, 4, 2, GAS, MICRO), (4, 1, 3, GAS * MICRO, 1)):  # 1F1B: micro-batches >= pp
        target = build_layout(groups, pp, tp, zero, gas, micro)
        assert target.load_checkpoint(shared_dir, tag="3d")[0] is not None and target.global_steps == 2
        got, _ = train(target, regrouped(world // (pp * tp), gas, micro)[2:])
        rows.append((f"PP2xTP2 z1 -> PP{pp}xTP{tp} z{zero}", assert_continues(got, want_losses[2:], f"pp{pp} tp{tp}")))
    plain = build_plain(groups, 1)
    assert plain.load_checkpoint(shared_dir, tag="3d")[0] is not None and plain.global_steps == 2
    plain.save_checkpoint(shared_dir, tag="plain")  # the same state in the format without a pipeline
    plain_batches = regrouped(world, 1, 1)
    got = train_plain(plain, groups, plain_batches[2:])
    rows.append((f"PP2xTP2 z1 -> plain DP{world} z1", assert_continues(got, want_losses[2:], "plain")))
    back = build(groups, config(2), seed=BASE_SEED + 5)
    assert back.load_checkpoint(shared_dir, tag="plain")[0] is not None and back.global_steps == 2
    got, _ = train(back, data(dp)[2:])
    rows.append((f"plain DP{world} z1 -> PP2xTP2 z2", assert_continues(got, want_losses[2:], "back into 3D")))
    print("\n" + "\n".join(f"{case}: max |dloss|/loss vs one process {dev:.1e}" for case, dev in rows))
