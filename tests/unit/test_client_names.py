"""Names the listed clients (docs/clients.md) reach that DeepSpeed 0.19.8 has: each one real where
zeroshard has the feature, refused by name when used where it does not, and each read the way
the client reads it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import zeroshard.activation_checkpointing as ac


@pytest.fixture()
def unconfigured() -> None:
    ac._unconfigure()
    yield
    ac._unconfigure()


def _draws(seed: int) -> torch.Tensor:
    return torch.rand(4, generator=torch.Generator().manual_seed(seed))


def test_tensor_parallel_seed_follows_the_configured_mpu(unconfigured: None) -> None:
    """Megatron-DeepSpeed (core/tensor_parallel/random.py) calls
    `deepspeed.checkpointing.model_parallel_reconfigure_tp_seed(seed)`: the tracker's state
    becomes seed + 2718 + the mpu's tensor-parallel rank; the default generator is untouched."""
    mpu = SimpleNamespace(get_tensor_model_parallel_rank=lambda: 1, get_tensor_model_parallel_world_size=lambda: 2,
                          get_data_parallel_rank=lambda: 0)
    ac.configure(mpu)
    ac.model_parallel_cuda_manual_seed(7)
    with ac.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), _draws(7 + 2718 + 1))
    default_before = torch.get_rng_state()
    ac.model_parallel_reconfigure_tp_seed(11)
    assert torch.equal(torch.get_rng_state(), default_before)
    with ac.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), _draws(11 + 2718 + 1))
    ac._unconfigure()
    ac.model_parallel_cuda_manual_seed(7)  # without an mpu the rank is 0
    with ac.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), _draws(7 + 2718))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16, bias=False) for _ in range(2)])
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x) * scale


def test_get_model_profile_counts_the_matrix_products(capsys: pytest.CaptureFixture[str]) -> None:
    """LLaMA-Factory's scripts/stat_utils/cal_flops.py: `flops, macs, params = get_model_profile(model,
    kwargs=inputs, print_profile=True, detailed=True)`. Every counted FLOP is half of a
    multiply-accumulate of a linear layer here: batch x (8x16 + 2 x 16x16 + 16x4) MACs."""
    from zeroshard.flops_profiler import FlopsProfiler, get_model_profile

    model, batch = _Net(), 3
    macs = batch * (8 * 16 + 2 * 16 * 16 + 16 * 4)
    params = sum(p.numel() for p in model.parameters())
    flops_n, macs_n, params_n = get_model_profile(model, kwargs={"x": torch.ones(batch, 8), "scale": 2.0},
                                                  print_profile=True, detailed=True, as_string=False)
    assert (flops_n, macs_n, params_n) == (2 * macs, macs, params)
    out = capsys.readouterr().out
    assert "blocks.1" in out and "fwd MACs per rank" in out
    as_text = get_model_profile(model, input_shape=(batch, 8), print_profile=False)
    assert as_text == ("4.22 K", "2.11 KMACs", "724")  # DeepSpeed 0.19.8's strings for 4224, 2112, 724
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[torch.nn.ModuleList])  # never called itself: its children are its FLOPs
    model(torch.ones(batch, 8))
    prof.stop_profile()
    assert prof.get_total_flops() == 2 * batch * (8 * 16 + 16 * 4)  # the blocks left out
    rows = {name: flops for name, _, flops in prof.module_rows(module_depth=1)}
    assert rows["head"] == 2 * batch * 16 * 4 and rows["blocks"] == 2 * batch * 2 * 16 * 16
    prof.end_profile()
    assert prof.get_total_flops() == 0
    with pytest.raises(ValueError, match="input_shape, args or kwargs"):
        get_model_profile(model, print_profile=False)


def test_env_report_prints_versions_and_op_features(capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron-DeepSpeed's pretrain_gpt.py calls `deepspeed.env_report.main()` at start-up."""
    from zeroshard.compat.env_report import main

    main()
    out = capsys.readouterr().out
    assert torch.__version__ in out and "cpu_adam" in out and "zeroshard version" in out
    main(hide_operator_status=True)
    assert "cpu_adam" not in capsys.readouterr().out


ALIAS_NAMES = """
import json, zeroshard.compat as c; c.install()
import deepspeed
from deepspeed.accelerator.real_accelerator import get_accelerator
from deepspeed.ops.op_builder.builder import OpBuilder
from deepspeed.runtime.pipe.schedule import TrainSchedule
from deepspeed.sequence.fpdt_layer import FPDT_Attention
from deepspeed.checkpoint import DeepSpeedCheckpoint, UNIVERSAL_CHECKPOINT_INFO, PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0
from deepspeed.module_inject.layers import GatherReplacedLayerParams
from deepspeed.profiling.flops_profiler import get_model_profile
from deepspeed.runtime.zero.partition_parameters import get_accelerator as pp_get_accelerator
import deepspeed.env_report
refused = {}
for name, make in [("OpBuilder", OpBuilder), ("TrainSchedule", TrainSchedule), ("FPDT_Attention", FPDT_Attention),
                   ("DeepSpeedCheckpoint", DeepSpeedCheckpoint)]:
    try:
        make()
    except Exception as e:
        refused[name] = type(e).__name__ + ": " + str(e)
print("PROBE" + json.dumps({
    "version": deepspeed.version, "pipe": deepspeed.PipelineEngine.__name__,
    "same_accelerator": get_accelerator is deepspeed.accelerator.get_accelerator is pp_get_accelerator,
    "uc": [UNIVERSAL_CHECKPOINT_INFO, PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0],
    "gather": GatherReplacedLayerParams.__name__, "profile": get_model_profile.__module__,
    "reconfigure": deepspeed.checkpointing.model_parallel_reconfigure_tp_seed.__name__,
    "env": deepspeed.env_report.main.__module__, "refused": refused}))
"""


def test_alias_serves_the_names_clients_import() -> None:
    from test_compat_alias import probe

    out, _ = probe({}, ALIAS_NAMES)
    assert out["version"].startswith("0.19.8") and out["pipe"] == "PipelineEngine" and out["same_accelerator"]
    assert out["uc"] == ["universal_checkpoint_info", "parameter_with_2_sub_params_cat_dim_0"]
    assert out["gather"] == "GatheredSplitParameters" and out["profile"] == "zeroshard.flops_profiler"
    assert out["reconfigure"] == "model_parallel_reconfigure_tp_seed" and out["env"] == "zeroshard.compat.env_report"
    assert set(out["refused"]) == {"OpBuilder", "TrainSchedule", "FPDT_Attention", "DeepSpeedCheckpoint"}
    for name, message in out["refused"].items():
        assert message.startswith("NotSupportedError: deepspeed.") and name in message, message


def test_checkpoint_constants_equal_deepspeeds() -> None:
    """The key names are DeepSpeed 0.19.8's own strings (compared where DeepSpeed is installed)."""
    ds = pytest.importorskip("deepspeed.checkpoint.constants", reason="compared against an installed DeepSpeed")
    if getattr(__import__("deepspeed"), "__served_by_zeroshard__", False):
        pytest.skip("`deepspeed` is zeroshard's alias here, not DeepSpeed")
    import importlib.util
    from pathlib import Path

    import zeroshard

    path = Path(zeroshard.__file__).parent / "compat/alias/deepspeed/checkpoint/constants.py"
    spec = importlib.util.spec_from_file_location("zs_constants", path)
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)
    names = [n for n in dir(mine) if n.isupper()]
    assert names and {n: getattr(mine, n) for n in names} == {n: getattr(ds, n) for n in names}


def test_deepspeed_command_runs_zeroshard_launch(tmp_path: Any) -> None:
    """DeepSpeed-Chat's training_scripts call `deepspeed main.py ...`: the command written by
    `zeroshard install-deepspeed-command` hands its arguments to `zeroshard launch --as_deepspeed`
    (shown with --dry_run), refuses to overwrite a file it did not write, and removes its own."""
    import subprocess
    import sys

    from zeroshard.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["install-deepspeed-command", "--dir", str(tmp_path)]) == 0
    run = subprocess.run([str(tmp_path / "deepspeed"), "--dry_run", "--num_gpus", "1", "--no_env_file", str(script),
                          "--zero_stage", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "ZEROSHARD_AS_DEEPSPEED=1" in run.stdout and f"{script} --zero_stage 2" in run.stdout
    assert sys.executable in (tmp_path / "deepspeed").read_text()
    assert main(["install-deepspeed-command", "--dir", str(tmp_path), "--remove"]) == 0
    assert not (tmp_path / "deepspeed").exists()
    (tmp_path / "deepspeed").write_text("#!/bin/sh\necho a real DeepSpeed\n")
    assert main(["install-deepspeed-command", "--dir", str(tmp_path)]) == 2
    assert main(["install-deepspeed-command", "--dir", str(tmp_path), "--remove"]) == 2
    assert "a real DeepSpeed" in (tmp_path / "deepspeed").read_text()


def test_utils_groups_is_reachable_after_import_deepspeed() -> None:
    """DeepSpeed's MoE tests read `deepspeed.utils.groups` after a bare `import deepspeed` (its
    utils package imports the module); the alias binds it the same way."""
    from test_compat_alias import probe

    out, _ = probe({}, "import json, zeroshard.compat as c; c.install()\nimport deepspeed\ng = deepspeed.utils.groups\n"
                       "print('PROBE' + json.dumps({'etp': g._get_expert_model_parallel_world_size(),"
                       " 'module': g.__name__}))")
    assert out == {"etp": 1, "module": "deepspeed.utils.groups"}
