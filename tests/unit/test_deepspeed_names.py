"""DeepSpeed's public names exist in zeroshard where DeepSpeed users import them, with
DeepSpeed 0.19.8's parameter names and defaults (compared against the installed DeepSpeed
where there is one), plus the pure pieces behind them: zeroshard.comm without a process
group, leaf-module units, lr schedule names."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os

import pytest
import torch
from signatures import parameters
from torch import nn

import zeroshard

NAMES = {
    "zeroshard": ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "zero", "comm",
                  "utils", "get_accelerator", "ops", "compression"],
    "zeroshard.ops.adam": ["DeepSpeedCPUAdam", "FusedAdam"],
    "zeroshard.ops.adagrad": ["DeepSpeedCPUAdagrad"],
    "zeroshard.ops.lion": ["DeepSpeedCPULion", "FusedLion"],
    "zeroshard.compression.helper": ["recursive_getattr", "recursive_setattr"],
    "zeroshard.zero": ["Init", "GatheredParameters", "register_external_parameter", "ZeroParamStatus"],
    "zeroshard.utils": ["safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad",
                        "safe_get_full_optimizer_state", "safe_set_full_optimizer_state",
                        "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
                        "safe_set_full_grad", "safe_set_local_grad", "safe_set_local_fp32_param",
                        "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized",
                        "logger", "log_dist", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module",
                        "get_z3_leaf_modules", "see_memory_usage", "unwrap_model_for_generation",
                        "RepeatingLoader"],
    "zeroshard.comm": ["get_rank", "get_world_size", "get_local_rank", "is_initialized", "barrier",
                       "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                       "reduce", "init_distributed", "destroy_process_group", "new_group", "ReduceOp"],
    "zeroshard.runtime.lr_schedules": ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
                                       "VALID_LR_SCHEDULES"],
    "zeroshard.utils.zero_to_fp32": ["get_fp32_state_dict_from_zero_checkpoint",
                                     "load_state_dict_from_zero_checkpoint",
                                     "convert_zero_checkpoint_to_fp32_state_dict"],
    "zeroshard.runtime.zero.stage3": ["estimate_zero3_model_states_mem_needs_all_live",
                                      "estimate_zero3_model_states_mem_needs_all_cold"],
    "zeroshard.runtime.zero.stage_1_and_2": ["estimate_zero2_model_states_mem_needs_all_live",
                                             "estimate_zero2_model_states_mem_needs_all_cold"],
    "zeroshard.runtime.zero.partition_parameters": ["ZeroParamStatus", "GatheredParameters", "Init"],
    "zeroshard.runtime.utils": ["see_memory_usage"],
}


@pytest.mark.parametrize("module", sorted(NAMES))
def test_deepspeed_names_are_importable(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in NAMES[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"


def test_names_deepspeed_chat_imports_first() -> None:
    """DeepSpeed-Chat's step 1, ported by its import line: `from deepspeed.ops.adam import
    DeepSpeedCPUAdam, FusedAdam` and `from deepspeed import get_accelerator`, on the objects the
    alias serves (one implementation)."""
    from zeroshard import get_accelerator
    from zeroshard.accelerator import get_accelerator as accelerator_module_get
    from zeroshard.compat import optimizers
    from zeroshard.ops.adam import DeepSpeedCPUAdam, FusedAdam

    assert get_accelerator is accelerator_module_get and get_accelerator() is accelerator_module_get()
    assert (DeepSpeedCPUAdam, FusedAdam) == (optimizers.DeepSpeedCPUAdam, optimizers.FusedAdam)
    assert zeroshard.ops.adam.FusedAdam is FusedAdam and zeroshard.ops.lion.FusedLion is optimizers.FusedLion
    opt = FusedAdam(nn.Linear(2, 2).parameters(), lr=1e-3, betas=(0.9, 0.95))
    assert isinstance(opt, torch.optim.Adam)


def test_recursive_getattr_and_setattr_follow_module_names() -> None:
    """deepspeed.compression.helper's helpers, as DeepSpeed-Chat's LoRA code uses them: find a
    layer by its `named_modules()` name, put a replacement there (registered as a submodule)."""
    from zeroshard.compression.helper import recursive_getattr, recursive_setattr

    model = nn.Sequential(nn.Sequential(nn.Linear(2, 3), nn.ReLU()), nn.Linear(3, 1))
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert names == ["0.0", "1"] and recursive_getattr(model, "0.0") is model[0][0]
    assert recursive_getattr(model, "0.0.weight") is model[0][0].weight
    new = nn.Linear(2, 3, bias=False)
    recursive_setattr(model, "0.0", new)
    recursive_setattr(model, "1", nn.Identity())
    assert model[0][0] is new and dict(model.named_modules())["0.0"] is new and isinstance(model[1], nn.Identity)
    with pytest.raises(AttributeError):
        recursive_getattr(model, "0.9")


def test_zero_package_stays_light() -> None:
    import subprocess
    import sys

    code = ("import sys, zeroshard.zero; heavy = [m for m in ('zeroshard.runtime', 'zeroshard.checkpoint') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_lr_schedule_names() -> None:
    from zeroshard.runtime import lr_schedules

    assert sorted(lr_schedules.VALID_LR_SCHEDULES) == sorted(lr_schedules.SCHEDULERS)


# -- signatures against DeepSpeed 0.19 -----------------------------------------------------------

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

SIGNATURES = [
    # (zeroshard object path, DeepSpeed object path)
    ("zeroshard.runtime.engine:ZeroEngine.backward", "deepspeed.runtime.engine:DeepSpeedEngine.backward"),
    ("zeroshard.runtime.engine:ZeroEngine.load_checkpoint", "deepspeed.runtime.engine:DeepSpeedEngine.load_checkpoint"),
    ("zeroshard.runtime.engine:ZeroEngine.save_checkpoint", "deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint"),
    ("zeroshard.runtime.engine:ZeroEngine.set_gradient_accumulation_boundary",
     "deepspeed.runtime.engine:DeepSpeedEngine.set_gradient_accumulation_boundary"),
    ("zeroshard.runtime.engine:ZeroEngine.save_16bit_model",
     "deepspeed.runtime.engine:DeepSpeedEngine.save_16bit_model"),
    ("zeroshard.runtime.engine:ZeroEngine._zero3_consolidated_16bit_state_dict",
     "deepspeed.runtime.engine:DeepSpeedEngine._zero3_consolidated_16bit_state_dict"),
    ("zeroshard.runtime.engine:ZeroEngine.compile", "deepspeed.runtime.engine:DeepSpeedEngine.compile"),
    ("zeroshard:initialize", "deepspeed:initialize"),
    ("zeroshard.comm:init_distributed", "deepspeed.comm:init_distributed"),
    ("zeroshard.utils.zero_to_fp32:get_fp32_state_dict_from_zero_checkpoint",
     "deepspeed.utils.zero_to_fp32:get_fp32_state_dict_from_zero_checkpoint"),
    ("zeroshard.utils.zero_to_fp32:load_state_dict_from_zero_checkpoint",
     "deepspeed.utils.zero_to_fp32:load_state_dict_from_zero_checkpoint"),
    ("zeroshard.utils.zero_to_fp32:convert_zero_checkpoint_to_fp32_state_dict",
     "deepspeed.utils.zero_to_fp32:convert_zero_checkpoint_to_fp32_state_dict"),
    ("zeroshard.utils:set_z3_leaf_modules", "deepspeed.utils:set_z3_leaf_modules"),
    ("zeroshard.zero:register_external_parameter",
     "deepspeed.runtime.zero.partition_parameters:register_external_parameter"),
    ("zeroshard.runtime.utils:see_memory_usage", "deepspeed.runtime.utils:see_memory_usage"),
] + [
    (f"zeroshard.utils:{name}", f"deepspeed.utils:{name}") for name in NAMES["zeroshard.utils"]
    if name.startswith("safe_")
] + [
    (f"zeroshard.runtime.lr_schedules:{name}.__init__", f"deepspeed.runtime.lr_schedules:{name}.__init__")
    for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
] + [
    (f"zeroshard.comm:{name}", f"deepspeed.comm:{name}")
    for name in ("all_reduce", "broadcast", "all_gather", "barrier", "get_rank", "get_world_size")
]

# Parameters DeepSpeed has that zeroshard leaves out on purpose (docs/deepspeed-differences.md).
LEFT_OUT = {"prof", "log_name", "debug", "use_default_group"}
# Defaults that differ on purpose: distributed_port=None (MASTER_PORT wins; DeepSpeed: 29500).
DEFAULTS_DIFFER = {("zeroshard:initialize", "distributed_port")}


@pytest.fixture(scope="module")
def deepspeed_loaded() -> None:
    if not HAVE_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.mark.parametrize(("ours", "theirs"), SIGNATURES, ids=[s[0].rpartition(":")[2] for s in SIGNATURES])
def test_signature_matches_deepspeed(deepspeed_loaded: None, ours: str, theirs: str) -> None:
    mine, ref = parameters(ours, theirs)
    positional = [n for n, p in ref.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and n not in LEFT_OUT]
    mine_positional = [n for n, p in mine.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert mine_positional[: len(positional)] == positional, f"{ours}: positional parameters differ"
    for name, p in ref.items():
        if name in LEFT_OUT or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        assert name in mine, f"{ours} lacks DeepSpeed's parameter {name!r}"
        if (ours, name) in DEFAULTS_DIFFER or p.default is inspect.Parameter.empty:
            continue
        got = mine[name].default
        if isinstance(p.default, (bool, int, float, str, type(None))) or p.default == {}:
            assert got == p.default, f"{ours}({name}=...): default {got!r}, DeepSpeed {p.default!r}"


# -- zeroshard.comm without a process group -------------------------------------------------------


def test_comm_functions_without_a_process_group() -> None:
    import zeroshard.comm as comm

    assert not comm.is_initialized() and comm.get_rank() == 0 and comm.get_world_size() == 1
    t = torch.tensor([3.0])
    assert comm.all_reduce(t) is None and t.item() == 3.0
    assert comm.all_reduce(t, async_op=True).wait()
    comm.broadcast(t, src=0)
    out = [torch.zeros(1)]
    comm.all_gather(out, torch.tensor([7.0]))
    assert out[0].item() == 7.0
    comm.barrier()


def test_init_distributed_explicit_rendezvous_needs_rank_and_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's init_method/rank/world_size are taken (tests/unit/test_comm_env.py starts
    processes with them); without a launcher, rank= and world_size= must come together."""
    import zeroshard.comm.groups as groups_module
    from zeroshard.errors import CommError

    for key in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(groups_module, "_GROUPS", None)  # an earlier test's single-process groups are cached
    with pytest.raises(CommError, match="needs both rank= and world_size="):
        zeroshard.init_distributed(init_method="tcp://localhost:1")
    with pytest.raises(CommError, match="needs both rank= and world_size="):
        zeroshard.init_distributed(world_size=4)


# -- leaf modules -> units --------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))


def test_leaf_modules_become_units_and_hide_their_insides() -> None:
    from zeroshard.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
    from zeroshard.zero.leaf import leaf_units
    from zeroshard.zero.units import default_units

    model = _Model()
    assert len(default_units(model)) == 1 + 2 + 6  # root, blocks, experts
    marked = set_z3_leaf_modules(model, ["_Block"])
    assert marked == list(model.layers) and all(z3_leaf_module(b) for b in model.layers)
    units = leaf_units(model, default_units(model))
    assert units == [model, *model.layers], "each block one unit, no expert a unit of its own"
    assert get_z3_leaf_modules(model) == list(model.layers)
    unset_z3_leaf_modules(model, [_Block])
    assert leaf_units(model, default_units(model)) == default_units(model)
    with pytest.raises(ValueError, match="no module"):
        set_z3_leaf_modules(model, [nn.Conv2d])


def test_repeating_loader_restarts() -> None:
    from zeroshard.utils import RepeatingLoader

    it = RepeatingLoader([1, 2])
    assert [next(it) for _ in range(5)] == [1, 2, 1, 2, 1]


def test_see_memory_usage_logs_only_when_forced() -> None:
    from zeroshard.runtime.utils import see_memory_usage

    assert see_memory_usage("quiet") is None
    line = see_memory_usage("loud", force=True)
    assert line is not None and line.startswith("loud") and "RSS" in line
