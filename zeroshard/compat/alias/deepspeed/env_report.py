"""deepspeed.env_report -> zeroshard.compat.env_report (`main`, `cli_main`)."""

from zeroshard.compat.env_report import cli_main, main

__all__ = ["main", "cli_main"]
