"""Command-line flags for training scripts, compatible with ``deepspeed.add_config_arguments``.

Imports nothing of ours but `zeroshard.errors`. A script written for DeepSpeed::

    parser = deepspeed.add_config_arguments(parser)

ports as ``parser = zeroshard.arguments.add_config_arguments(parser)`` and parses the same
command lines (``--deepspeed --deepspeed_config ds.json``, ``--local_rank``).
"""

from __future__ import annotations

import argparse
import os

from zeroshard.errors import ConfigError

__all__ = ["add_config_arguments", "config_path_from_args"]


def _has_option(parser: argparse.ArgumentParser, *names: str) -> bool:
    return any(n in parser._option_string_actions for n in names)


def _local_rank_default() -> int:
    value = os.environ.get("LOCAL_RANK", "-1")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"LOCAL_RANK={value!r}: expected an integer; unset it or let "
                          f"the launcher set it.") from None


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "zeroshard" argument group to ``parser`` and return the parser.

    Flags (dash spellings accepted too):

    * ``--deepspeed`` / ``--zeroshard``: store_true, "train with zeroshard" (both mean the
      same; ``--deepspeed`` keeps DeepSpeed scripts working).
    * ``--deepspeed_config PATH`` / ``--zeroshard_config PATH``: the ds_config JSON file.
    * ``--local_rank N``: default ``$LOCAL_RANK``, else -1. torchrun and ``zeroshard launch``
      set ``LOCAL_RANK``; the flag exists for scripts that read ``args.local_rank``.
    * ``--deepscale``, ``--deepscale_config``, ``--deepspeed_mpi``: DeepSpeed's deprecated
      spellings, accepted silently.

    A flag the parser already has (a script's own ``--local_rank``, HF's ``--deepspeed``) is
    left as the script defined it.

    Args:
        parser: the script's parser.

    Returns:
        The same parser, for chaining.

    Raises:
        ConfigError: ``LOCAL_RANK`` in the environment is not an integer.

    Example::

        >>> p = add_config_arguments(argparse.ArgumentParser())
        >>> args = p.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
        >>> config_path_from_args(args)
        'ds.json'
    """
    group = parser.add_argument_group("zeroshard", "zeroshard / DeepSpeed configuration")

    def add(*names: str, **kwargs: object) -> None:
        # A flag the script already defines (HF's --deepspeed, its own --local_rank) is kept:
        # argparse would raise on the duplicate, and the script's meaning wins.
        if not _has_option(parser, *names):
            group.add_argument(*names, **kwargs)  # type: ignore[arg-type]

    add("--deepspeed", action="store_true", default=False,
        help="train with zeroshard (DeepSpeed's flag, kept for its scripts)")
    add("--deepspeed_config", "--deepspeed-config", default=None, metavar="PATH",
        help="ds_config JSON file")
    add("--zeroshard", action="store_true", default=False, help="train with zeroshard")
    add("--zeroshard_config", "--zeroshard-config", default=None, metavar="PATH",
        help="ds_config JSON file (same as --deepspeed_config)")
    add("--deepscale", action="store_true", default=False, help=argparse.SUPPRESS)
    add("--deepscale_config", default=None, help=argparse.SUPPRESS)
    add("--deepspeed_mpi", action="store_true", default=False, help=argparse.SUPPRESS)
    add("--local_rank", "--local-rank", type=int, default=_local_rank_default(), metavar="N",
        help="local rank of this process (default: $LOCAL_RANK, else -1)")
    return parser


def config_path_from_args(args: argparse.Namespace) -> str | None:
    """The ds_config path given on the command line, or None.

    Reads ``--zeroshard_config``, ``--deepspeed_config``, the deprecated ``--deepscale_config``,
    and ``--deepspeed`` when the script's own parser makes it take a path (HF Trainer's
    ``--deepspeed ds.json``); attributes missing from ``args`` count as not given.

    Raises:
        ConfigError: two of them name different files.

    Example::

        >>> config_path_from_args(argparse.Namespace(deepspeed_config="ds.json"))
        'ds.json'
    """
    given = {
        flag: value
        for flag in ("zeroshard_config", "deepspeed_config", "deepscale_config")
        if (value := getattr(args, flag, None)) is not None
    }
    if isinstance(getattr(args, "deepspeed", None), str):
        given["deepspeed"] = args.deepspeed
    if len(set(given.values())) > 1:
        listed = ", ".join(f"--{k} {v}" for k, v in given.items())
        raise ConfigError(f"conflicting config files on the command line: {listed}. "
                          f"Pass one of them.")
    return next(iter(given.values()), None)
