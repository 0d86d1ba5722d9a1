"""The estimator's expert split (estimate/expert_states.py) and `zeroshard estimate --ep`: which
parameters are experts, one rank's share of them, and the CLI's table against the function.
The per-rank bytes against the engine itself: tests/dist/test_autoep.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zeroshard.cli.estimate import build_parser, run
from zeroshard.errors import ZeroshardError
from zeroshard.estimate import Setup, spec_from_module
from zeroshard.estimate.expert_states import estimate_rank_ep, split_experts
from zeroshard.estimate.model_source import load_model_spec

transformers = pytest.importorskip("transformers")

CONFIG = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 24,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 4,
          "num_experts_per_tok": 2, "max_position_embeddings": 64}


def tiny() -> torch.nn.Module:
    cfg = dict(CONFIG)
    cfg.pop("model_type")
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**cfg))


def test_split_counts_every_parameter_once_and_cuts_the_banks() -> None:
    model = tiny()
    split = split_experts(model)
    assert split is not None and split.num_experts == 4
    banks = [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]
    assert split.banks == tuple(tuple(p.numel() for p in b.parameters()) for b in banks)
    assert split.dense.total_params + split.expert_params == spec_from_module(model).total_params
    share = split.share(2)
    assert share.total_params * 2 == split.expert_params and share.unit_params[0] == ()
    with pytest.raises(ZeroshardError, match="must divide the 4 experts"):
        split.share(3)
    assert split_experts(torch.nn.Linear(4, 4)) is None


def test_experts_shard_over_the_expert_data_parallel_ranks() -> None:
    """At ZeRO 1 a rank holds its 1 / ep of the experts whole, and their optimizer states over the
    dp / ep ranks holding them: parameters shrink with ep, optimizer states do not (up to padding)."""
    split = split_experts(tiny())
    setup = Setup(zero_stage=1, precision="fp32", devices_per_node=4, optimizer_state_bytes=8)
    one, two, four = (estimate_rank_ep(split, setup, ep) for ep in (1, 2, 4))
    assert one.device.params > two.device.params > four.device.params
    pad = 4 * 16 * 8  # fp32 bytes of 16-element alignment over a few buckets
    assert abs((one.device.params - two.device.params) - 4 * split.expert_params // 2) <= pad
    assert abs((two.device.params - four.device.params) - 4 * split.expert_params // 4) <= pad
    assert abs(one.device.optimizer_states - four.device.optimizer_states) <= 2 * pad
    with pytest.raises(ZeroshardError, match="must divide the data-parallel size"):
        estimate_rank_ep(split, setup, 3)


def test_cli_table_is_the_function(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = build_parser().parse_args(["--model", str(tmp_path), "--hf-class", "AutoModelForCausalLM",
                                      "--devices", "4", "--ep", "2", "--precision", "bf16"])
    text = run(args)
    split = load_model_spec(str(tmp_path), "AutoModelForCausalLM").experts
    assert split is not None
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    for zero, row in zip(range(4), rows):
        est = estimate_rank_ep(split, Setup(zero_stage=zero, precision="bf16", devices_per_node=4), 2)
        assert float(row[-1]) == pytest.approx(round(est.device_peak / 2**30, 2), abs=0.006)
        assert int(row[1].replace(",", "")) == split.expert_params // 2
    with pytest.raises(ZeroshardError, match="must divide"):
        run(build_parser().parse_args(["--model", str(tmp_path), "--devices", "4", "--ep", "3"]))
