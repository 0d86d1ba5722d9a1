"""`zeroshard.arguments`: DeepSpeed's add_config_arguments flags, parsed the same way."""

from __future__ import annotations

import argparse

import pytest

from zeroshard.arguments import add_config_arguments, config_path_from_args
from zeroshard.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.1)
    return add_config_arguments(p)


def test_returns_the_parser_with_a_zeroshard_group() -> None:
    p = argparse.ArgumentParser()
    assert add_config_arguments(p) is p
    assert "zeroshard" in [g.title for g in p._action_groups]


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = _parser().parse_args([])
    assert (args.deepspeed, args.deepspeed_config, args.zeroshard, args.zeroshard_config,
            args.local_rank) == (False, None, False, None, -1)
    assert config_path_from_args(args) is None


def test_deepspeed_command_line_parses_unchanged() -> None:
    args = _parser().parse_args(["--lr", "3", "--deepspeed", "--deepspeed_config", "ds.json",
                                 "--local_rank=2"])
    assert args.deepspeed and args.lr == 3.0 and args.local_rank == 2
    assert config_path_from_args(args) == "ds.json"


@pytest.mark.parametrize(
    "argv",
    [["--deepspeed-config", "c.json"], ["--zeroshard", "--zeroshard_config", "c.json"],
     ["--zeroshard-config=c.json"], ["--deepscale", "--deepscale_config", "c.json"],
     ["--deepspeed_config", "c.json", "--zeroshard_config", "c.json"]],
)
def test_config_path_spellings(argv: list[str]) -> None:
    assert config_path_from_args(_parser().parse_args(argv)) == "c.json"


def test_local_rank_defaults_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _parser().parse_args([]).local_rank == 3
    assert _parser().parse_args(["--local-rank", "1"]).local_rank == 1


def test_bad_local_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "zero")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK='zero': expected an integer"):
        _parser()


def test_flags_the_script_already_has_are_kept() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=7)
    p.add_argument("--deepspeed", type=str, default=None)  # HF's flag takes a path
    args = add_config_arguments(p).parse_args(["--deepspeed", "ds.json"])
    assert args.deepspeed == "ds.json" and args.local_rank == 7
    assert config_path_from_args(args) == "ds.json"


def test_conflicting_config_paths() -> None:
    args = _parser().parse_args(["--deepspeed_config", "a.json", "--zeroshard_config", "b.json"])
    with pytest.raises(ConfigError, match=r"conflicting config files.*--zeroshard_config b\.json"
                                          r", --deepspeed_config a\.json\. Pass one of them"):
        config_path_from_args(args)


def test_namespace_without_the_flags() -> None:
    assert config_path_from_args(argparse.Namespace(lr=1.0)) is None
