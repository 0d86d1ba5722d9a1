"""The opt-in `deepspeed` alias: off by default, on by ZEROSHARD_AS_DEEPSPEED=1 / install() /
`zeroshard launch --as-deepspeed`, with metadata and submodules as the HF libraries read them."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroshard.compat as compat
from zeroshard.errors import NotSupportedError

PROBE = """
import importlib.metadata as md, importlib.util as u, json, sys
spec = u.find_spec("deepspeed")
out = {"origin": spec.origin if spec else None}
try:
    import deepspeed
    out.update(file=deepspeed.__file__, version=deepspeed.__version__, meta=md.version("deepspeed"),
               served=getattr(deepspeed, "__served_by_zeroshard__", False))
except ImportError as e:
    out["error"] = str(e)
print("PROBE" + json.dumps(out))
"""


def probe(env_extra: dict[str, str], code: str = PROBE) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROSHARD_AS_DEEPSPEED", "RANK")}
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True,
                          timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE"))
    return json.loads(line[len("PROBE"):]), proc.stderr


def test_pth_hook_is_installed() -> None:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    found = [d for d in dirs if (Path(d) / "zeroshard_as_deepspeed.pth").exists()]
    assert found, (f"zeroshard_as_deepspeed.pth not in {dirs}: the ZEROSHARD_AS_DEEPSPEED switch needs "
                   "it; reinstall zeroshard (pip install -e .) so setup.py installs the hook")


def test_env_var_serves_deepspeed_from_zeroshard() -> None:
    out, err = probe({"ZEROSHARD_AS_DEEPSPEED": "1"})
    alias = str(compat.ALIAS_DIR)
    assert out["origin"].startswith(alias) and out["file"].startswith(alias), out
    assert out["served"] and out["version"] == out["meta"] == compat.DEEPSPEED_VERSION
    from packaging.version import Version

    assert Version(out["meta"]) >= Version("0.16.4")  # accelerate's floor; transformers needs 0.9.3
    assert err.count("`deepspeed` is served by zeroshard") == 1, err


def test_only_rank0_announces_it() -> None:
    _, err = probe({"ZEROSHARD_AS_DEEPSPEED": "1", "RANK": "1"})
    assert "served by zeroshard" not in err


@pytest.mark.parametrize("value", [None, "0", "false"])
def test_off_unless_asked(value: str | None) -> None:
    out, err = probe({} if value is None else {"ZEROSHARD_AS_DEEPSPEED": value})
    assert not out.get("served"), out
    assert out["origin"] is None or not out["origin"].startswith(str(compat.ALIAS_DIR))
    assert "served by zeroshard" not in err


def test_install_in_code_and_eager_submodules() -> None:
    code = ("import zeroshard.compat as c; c.install(); import deepspeed, os;"
            "print('PROBE' + __import__('json').dumps({"
            "'chain': sorted(deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES),"
            " 'env': os.environ.get('ZEROSHARD_AS_DEEPSPEED'),"
            " 'engine': deepspeed.runtime.engine.DeepSpeedEngine.__name__,"
            " 'runner': deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME}))")
    out, _ = probe({}, code)
    assert out["env"] == "1", "children of this process must get the alias too"
    assert "WarmupLR" in out["chain"] and out["engine"] == "ZeroEngine"
    assert out["runner"] == ".deepspeed_env"


def test_install_refuses_after_a_real_deepspeed_import() -> None:
    pytest.importorskip("deepspeed", reason="needs a real DeepSpeed installed to import first")
    code = ("import os; os.environ['DS_ACCELERATOR']='cpu'; import deepspeed, zeroshard.compat as c\n"
            "try:\n    c.install(); r='installed'\nexcept ImportError as e:\n    r=str(e)\n"
            "print('PROBE' + __import__('json').dumps({'r': r}))")
    out, _ = probe({}, code)
    assert "already imported" in out["r"] and "ZEROSHARD_AS_DEEPSPEED=1" in out["r"]


def test_unknown_name_says_zeroshard_lacks_it() -> None:
    from zeroshard.compat._names import reexport

    getattr_, _ = reexport("deepspeed.x", {"there": "zeroshard.compat:ENV_VAR", "gone": "zeroshard.compat:NOPE"})
    assert getattr_("there") == "ZEROSHARD_AS_DEEPSPEED"
    with pytest.raises(AttributeError, match="does not provide this DeepSpeed name"):
        getattr_("missing")
    with pytest.raises(AttributeError, match="not available in this zeroshard version"):
        getattr_("gone")


def test_deepspeed_adam_classes_are_torch_adam() -> None:
    from zeroshard.compat.optimizers import DeepSpeedCPUAdam, DeepSpeedCPULion, FusedAdam

    p = torch.nn.Parameter(torch.ones(4))
    opt = DeepSpeedCPUAdam([p], lr=0.1, weight_decay=0.1)
    assert isinstance(opt, torch.optim.Adam) and opt.defaults["fused"] and opt.defaults["decoupled_weight_decay"]
    ref = torch.optim.AdamW([q := torch.nn.Parameter(torch.ones(4))], lr=0.1, weight_decay=0.1)
    for o, t in ((opt, p), (ref, q)):
        t.grad = torch.arange(4.0)
        o.step()
    assert torch.equal(p, q)
    assert not FusedAdam([torch.nn.Parameter(torch.ones(2))], adam_w_mode=False).defaults["decoupled_weight_decay"]
    with pytest.raises(NotSupportedError, match="bias_correction"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))], bias_correction=False)
    with pytest.raises(NotSupportedError, match="Lion"):
        DeepSpeedCPULion([p])


def test_launch_as_deepspeed_sets_the_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.cli.launch import plan_launch

    monkeypatch.delenv("ZEROSHARD_AS_DEEPSPEED", raising=False)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    plan = plan_launch(["--as_deepspeed", "--dry_run", "--nproc_per_node", "1", "--no_env_file", str(script)])
    assert plan.commands[0].env.get("ZEROSHARD_AS_DEEPSPEED") == "1"
    plan = plan_launch(["--dry_run", "--nproc_per_node", "1", "--no_env_file", str(script)])
    assert "ZEROSHARD_AS_DEEPSPEED" not in plan.commands[0].env


def test_every_listed_name_resolves() -> None:
    """No alias module advertises (in dir()) a name that then fails: each maps onto real code."""
    code = ("import importlib, json, zeroshard.compat as c; c.install(); import deepspeed\n"
            "mods = [m for m in ['deepspeed', 'deepspeed.comm', 'deepspeed.zero', 'deepspeed.utils',\n"
            " 'deepspeed.utils.zero_to_fp32', 'deepspeed.runtime.lr_schedules', 'deepspeed.runtime.utils',\n"
            " 'deepspeed.runtime.zero', 'deepspeed.runtime.zero.partition_parameters',\n"
            " 'deepspeed.runtime.activation_checkpointing.checkpointing', 'deepspeed.checkpointing',\n"
            " 'deepspeed.accelerator', 'deepspeed.moe.utils', 'deepspeed.ops.adam', 'deepspeed.checkpoint.utils']]\n"
            "bad = [f'{m}.{n}' for m in mods for n in dir(importlib.import_module(m))\n"
            "       if not n.startswith('_') and not hasattr(importlib.import_module(m), n)]\n"
            "n = sum(1 for m in mods for x in dir(importlib.import_module(m)) if not x.startswith('_'))\n"
            "print('PROBE' + json.dumps({'bad': bad, 'n': n}))")
    out, _ = probe({}, code)
    assert out["bad"] == [] and out["n"] > 60, out


def test_swap_tensor_size_constant() -> None:
    """DeepSpeed's fragment tests size their models by `deepspeed.runtime.swap_tensor.MIN_SWAPPABLE_BYTES`."""
    code = ("import json, zeroshard.compat as c; c.install()\n"
            "from deepspeed.runtime.swap_tensor import MIN_SWAPPABLE_BYTES\n"
            "print('PROBE' + json.dumps({'min': MIN_SWAPPABLE_BYTES}))")
    out, _ = probe({}, code)
    assert out["min"] == 1024**2, out
