"""`zeroshard config check FILE`: validate a ds_config.json and print it resolved.

Exit status 0 when the config loads (the resolved listing and "OK" are printed), 2 when it does
not (the error is printed). Imports only `zeroshard.config` and `zeroshard.errors`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zeroshard.config import load_config
from zeroshard.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroshard config check",
        description="Validate a DeepSpeed ds_config.json as zeroshard reads it, and print the "
        "resolved values with where each came from.",
    )
    p.add_argument("file", help="path to the ds_config.json")
    p.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="data-parallel world size to solve the batch sizes for (default: 1)")
    p.add_argument("--hidden-size", type=int, default=None, metavar="H",
                   help='model hidden size, for "auto" bucket sizes (h*h, 0.9*h*h, 10*h)')
    p.add_argument("--auto", action="append", default=[], metavar="KEY=VALUE",
                   help='value for a key the file sets to "auto", as initialize() would pass it; '
                   "VALUE is JSON (e.g. --auto optimizer.params.lr=1e-4). Repeatable.")
    p.add_argument("--changed", action="store_true", help="print only values that differ from the defaults")
    return p


def _auto_values(items: list[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--auto {item}: expected KEY=VALUE, e.g. optimizer.params.lr=1e-4.")
        try:
            values[key] = json.loads(text)
        except json.JSONDecodeError:
            values[key] = text  # a bare word: a string value such as cpu
    return values


def main(argv: list[str]) -> int:
    """Run `zeroshard config check`; `argv` excludes the `config check` words (accepted if present).

    Returns:
        0 when the config is valid, 2 when it is not.

    Example:
        $ zeroshard config check ds_config.json --world-size 8 --hidden-size 4096
    """
    args_list = list(argv)
    if args_list[:1] == ["config"]:
        args_list = args_list[1:]
    if args_list[:1] == ["check"]:
        args_list = args_list[1:]
    args = _parser().parse_args(args_list)
    try:
        cfg = load_config(args.file, dp_world_size=args.world_size, hidden_size=args.hidden_size,
                          auto_values=_auto_values(args.auto))
    except ConfigError as err:
        print(f"{args.file}: error: {err}", file=sys.stderr)
        return 2
    print(cfg.describe(non_default_only=args.changed))
    for note in cfg.notes:  # what initialize() logs once at start-up
        print(f"note: {note}")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
