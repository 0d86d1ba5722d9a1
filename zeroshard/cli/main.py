"""`zeroshard` command line: dispatches to one module per subcommand."""

from __future__ import annotations

import sys

USAGE = """usage: zeroshard <command> [options]

commands:
  train          train the built-in GPT example on the shipped corpus
  launch         launch a training script on one or many nodes
  config check   validate a ds_config.json and print it resolved
  estimate       model-state memory per device and per node for every ZeRO stage and offload
  plan           pick the fastest configuration that fits the hardware; write its ds_config.json
  to-fp32        consolidate a checkpoint into one fp32 state dict (CPU only)
  to-deepspeed   write a checkpoint as a DeepSpeed universal checkpoint (CPU only)
  bench-io       swap bandwidth on a directory for a grid of aio settings; prints the aio block
  report         plot the CSV monitor output of one or more runs (loss, lr, samples/s, memory)
  install-deepspeed-command
                 write a `deepspeed` launcher command that runs `zeroshard launch --as_deepspeed`

Run `zeroshard <command> --help` for a command's options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from zeroshard.cli.train import main as run
    elif command == "launch":
        from zeroshard.cli.launch import main as run
    elif command == "estimate":
        from zeroshard.cli.estimate import main as run
    elif command == "plan":
        from zeroshard.cli.plan import main as run
    elif command == "to-fp32":
        from zeroshard.cli.to_fp32 import main as run
    elif command == "to-deepspeed":
        from zeroshard.cli.to_deepspeed import main as run
    elif command == "bench-io":
        from zeroshard.cli.bench_io import main as run
    elif command == "report":
        from zeroshard.cli.report import main as run
    elif command == "install-deepspeed-command":
        from zeroshard.cli.deepspeed_command import main as run
    elif command == "config":
        if not rest or rest[0] != "check":
            print("usage: zeroshard config check FILE [--world-size N] [--hidden-size H]", file=sys.stderr)
            return 2
        from zeroshard.cli.config_cmd import main as run

        rest = rest[1:]
    else:
        print(f"zeroshard: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
