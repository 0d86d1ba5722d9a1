"""`zeroshard plan`: the fastest ZeRO configuration expected to fit, and its ds_config.json.

Walks stage 0 -> 1 -> 2 -> 2 + optimizer offload -> 3 -> 3 + parameter offload -> + optimizer
offload -> NVMe with one line per decision, then raises the micro batch. `--probe` runs a few
real steps of every candidate that fits (most frugal first) and keeps the fastest that ran.
`--3d` searches tensor x pipeline x data-parallel layouts instead (estimate/plan3d.py): TP inside
a node, PP across nodes, ZeRO over DP, expert parallelism over DP for a MoE model, each layout's
memory per rank and step time from the cluster's link bandwidths, and prints why the fastest that
fits beats the best of each other kind.
Exit status 0 when a configuration was chosen, 1 when none fits, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from zeroshard.cli.estimate import add_model_arguments, model_spec
from zeroshard.config import load_config, read_config_file
from zeroshard.errors import ConfigError, ZeroshardError
from zeroshard.estimate.plan import Decision, Hardware, Plan, Workload, format_gb, make_plan, raise_batch
from zeroshard.estimate.plan3d import Cluster, Training, make_3d_plan, report_3d
from zeroshard.estimate.spec import ModelSpec

_UNITS = {"": 2**30, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """"80GB" -> 80 * 2**30. GB means 2**30 bytes, as DeepSpeed's estimator prints; a bare number is GB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 80GB, 512GiB or 500MB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zeroshard plan", description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--devices", type=int, required=True, help="devices (GPUs; processes on a CPU machine) per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--device-memory", type=parse_bytes, required=True, help="memory per device, e.g. 80GB")
    p.add_argument("--cpu-memory", type=parse_bytes, required=True, help="CPU memory per node, e.g. 512GB")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the model's longest, else 512)")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step over all devices")
    p.add_argument("--max-micro-batch", type=int, default=None,
                   help="largest micro batch tried (default 64; 8 with --3d, where layouts multiply)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None,
                   help="training precision (default: the --config's, else bf16)")
    p.add_argument("--config", help="base ds_config.json: its optimizer, scheduler, etc. are kept")
    p.add_argument("--activation-checkpointing", nargs="?", const="on", default="auto", choices=["on", "off", "auto"],
                   help="on: the model recomputes activations in backward (torch.utils.checkpoint, HF "
                        "gradient_checkpointing_enable); off: it does not; auto (default): a planned choice, "
                        "tried from stage 2 on before a slower candidate, at ~33%% more compute")
    p.add_argument("--nvme-path", help="a directory on NVMe, to allow the ZeRO-Infinity candidate; its read and "
                   "write bandwidth is measured (a 256 MiB scratch file) unless --nvme-bandwidth gives it")
    p.add_argument("--nvme-bandwidth", metavar="READ,WRITE", type=_bandwidth,
                   help="disk bandwidth of --nvme-path per node, bytes per second, e.g. 1.1GB,2GB "
                        "(as `zeroshard bench-io` prints it); bounds the NVMe candidates' step time")
    p.add_argument("--reserve", type=float, default=0.10,
                   help="fraction of each memory kept free for the allocator and runtime (default 0.10)")
    p.add_argument("--out", help="write the chosen ds_config.json here")
    p.add_argument("--probe", action="store_true", help="run a few real steps of each candidate that fits")
    p.add_argument("--probe-steps", type=int, default=10, help="timed steps per probe (after 3 warm-up steps)")
    p.add_argument("--probe-max", type=int, default=None,
                   help="probe at most this many candidates (the most frugal ones); default: all that fit")
    p.add_argument("--probe-timeout", type=float, default=300.0, help="seconds per probe run")
    g = p.add_argument_group("3D layouts (--3d)")
    g.add_argument("--3d", dest="three_d", action="store_true",
                   help="search TP x PP x DP layouts (TP inside a node, PP across nodes, ZeRO over DP) with a "
                        "step-time model; needs --global-batch and a --model with a transformer config")
    g.add_argument("--intra-node-bandwidth", type=parse_bytes, default=300 * 2**30, metavar="BYTES",
                   help="per device, each way, inside a node, e.g. 300GB (A100 NVLink; the default)")
    g.add_argument("--inter-node-bandwidth", type=parse_bytes, default=25 * 2**30, metavar="BYTES",
                   help="per device, each way, across nodes, e.g. 25GB (one 200 Gbit/s NIC per GPU; the default)")
    g.add_argument("--device-tflops", type=float, default=150.0,
                   help="achieved TFLOP/s per device (default 150: about half an A100's bf16 peak)")
    g.add_argument("--tp", type=int, nargs="+", help="only these tensor-parallel sizes (default: every divisor of "
                   "--devices that divides the attention heads)")
    g.add_argument("--pp", type=int, nargs="+", help="only these pipeline sizes (default: every one)")
    g.add_argument("--ep", type=int, nargs="+", help="only these expert-parallel sizes (default, for a Hugging Face "
                   "MoE --model: 1 and every divisor of the data-parallel size that divides the experts, beside every "
                   "TP and PP size: expert groups inside each (stage, TP rank)'s data-parallel ranks)")
    return p


def _bandwidth(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"--nvme-bandwidth: expected READ,WRITE (e.g. 1.1GB,2GB), got {text!r}")
    return parse_bytes(parts[0]), parse_bytes(parts[1])


def _disk(args: argparse.Namespace) -> tuple[float | None, float | None]:
    """(read, write) bytes/s of --nvme-path: given, else measured with `zero/offload/nvme_bench.py`."""
    if args.nvme_bandwidth is not None:
        return args.nvme_bandwidth
    if args.nvme_path is None:
        return None, None
    from zeroshard.zero.offload.nvme_bench import measure
    from zeroshard.zero.offload.nvme_io import IOOptions, check_swap_dir

    root = check_swap_dir(Path(args.nvme_path), 256 << 20, key="--nvme-path", direct=None)
    point = measure(root, IOOptions(block_size=1 << 20, queue_depth=8), file_bytes=256 << 20, request_bytes=64 << 20)
    print(f"disk: {point.read_bytes_per_s / 2**30:.2f} GB/s read, {point.write_bytes_per_s / 2**30:.2f} GB/s write "
          f"on {args.nvme_path} (256 MiB, 1 MiB blocks x 8 in flight)", flush=True)
    return point.read_bytes_per_s, point.write_bytes_per_s


def _workload(args: argparse.Namespace, spec: ModelSpec) -> Workload:
    base = read_config_file(args.config) if args.config else {}
    precision = args.precision
    if precision is None:
        precision = ("bf16" if base.get("bf16", {}).get("enabled") else
                     "fp16" if base.get("fp16", {}).get("enabled") else "fp32" if args.config else "bf16")
    seq = args.seq_len or (spec.shape.max_seq_len if spec.shape and spec.shape.max_seq_len else None)
    if seq is None and spec.shape is not None:
        seq = 512
    return Workload(precision=precision, seq_len=seq, global_batch=args.global_batch,
                    max_micro_batch=args.max_micro_batch or 64,
                    checkpointing={"on": True, "off": False, "auto": "auto"}[args.activation_checkpointing],
                    base_config=base)


def _write(d: Decision, hw: Hardware, spec: ModelSpec, path: str) -> str:
    if d.ds_config is None:
        raise ZeroshardError(f"{d.name}: no ds_config")
    load_config(d.ds_config, dp_world_size=hw.world_size,  # the file must load as it is
                hidden_size=spec.shape.hidden_size if spec.shape else None)
    Path(path).write_text(json.dumps(d.ds_config, indent=2) + "\n")
    return f"wrote {path} ({d.name}, micro batch {d.micro_batch}; checked by zeroshard.config.load_config)"


def _probe(args: argparse.Namespace, plan: Plan, spec: ModelSpec, work: Workload, hw: Hardware) -> Decision | None:
    from zeroshard.estimate.probe import probe_all

    if args.model is None:
        raise ZeroshardError("--probe needs --model (a model to build and train), not --params")
    fitting = [raise_batch(spec, work, hw, d) for d in plan.decisions if d.status == "fits"]
    fitting = sorted(fitting, key=lambda d: d.device_need)[: args.probe_max]
    if not fitting:
        return None
    print(f"probing {len(fitting)} candidate(s) that fit, most frugal first "
          f"({args.probe_steps} timed steps each, under python -m torch.distributed.run):", flush=True)
    results, best = probe_all(fitting, args.model, work.seq_len or 512, hw, steps=args.probe_steps,
                              warmup=3, timeout_s=args.probe_timeout, report=lambda line: print(line, flush=True))
    if best is None:
        print("probe: no candidate ran; keeping the estimate's choice")
        return None
    print(f"probe choice: {best.decision.name}, micro batch {best.decision.micro_batch}: "
          f"{best.samples_per_s:.1f} samples/s, peak {format_gb(best.peak_bytes)} per rank "
          f"({len([r for r in results if r.status == 'ok'])} of {len(results)} ran)")
    return best.decision


def run_3d(args: argparse.Namespace, spec: ModelSpec, work: Workload) -> int:
    """`--3d`: the layout search of estimate/plan3d.py, printed with its reasons."""
    if args.global_batch is None:
        raise ZeroshardError("--3d needs --global-batch (sequences per optimizer step): it sets the micro-batch count "
                             "that decides the pipeline bubble")
    if work.seq_len is None:
        raise ZeroshardError("--3d needs a --model with a transformer config (or --seq-len and such a model)")
    for flag in ("out", "probe", "nvme_path"):
        if getattr(args, flag):
            raise ZeroshardError(f"--{flag.replace('_', '-')} does not go with --3d yet; drop it (the 3D search prints "
                                 "the layout; offload and NVMe are the plan without --3d)")
    train = Training(seq_len=work.seq_len, global_batch=args.global_batch, precision=work.precision,
                     max_micro_batch=args.max_micro_batch or 8,
                     checkpointing=work.checkpointing, tp_sizes=tuple(args.tp) if args.tp else None,
                     pp_sizes=tuple(args.pp) if args.pp else None, ep_sizes=tuple(args.ep) if args.ep else None)
    cluster = Cluster(nodes=args.nodes, devices_per_node=args.devices, device_memory=args.device_memory,
                      intra_bandwidth=args.intra_node_bandwidth, inter_bandwidth=args.inter_node_bandwidth,
                      device_flops=args.device_tflops * 1e12, reserve=args.reserve)
    plan = make_3d_plan(spec, train, cluster)
    print(report_3d(plan), flush=True)
    return 0 if plan.chosen is not None else 1


def run(args: argparse.Namespace) -> int:
    if args.devices < 1 or args.nodes < 1 or not 0 <= args.reserve < 1:
        raise ZeroshardError("--devices and --nodes must be >= 1 and --reserve in [0, 1)")
    spec = model_spec(args)
    if args.three_d:
        return run_3d(args, spec, _workload(args, spec))
    work = _workload(args, spec)
    hw = Hardware(devices_per_node=args.devices, nodes=args.nodes, device_memory=args.device_memory,
                  cpu_memory=args.cpu_memory, reserve=args.reserve, nvme_path=args.nvme_path,
                  **dict(zip(("disk_read", "disk_write"), _disk(args))))
    print(f"plan for {spec.name} ({spec.total_params / 1e6:,.1f}M params) on {hw.nodes} node(s) x "
          f"{hw.devices_per_node} device(s) of {format_gb(hw.device_memory)}, {format_gb(hw.cpu_memory)} CPU "
          f"per node; {work.precision}, sequence length {work.seq_len or 'n/a'}"
          f"{', global batch ' + str(work.global_batch) if work.global_batch else ''}", flush=True)
    plan = make_plan(spec, work, hw, evaluate_all=args.probe)
    print(plan.report(), flush=True)
    chosen = plan.chosen
    if args.probe:
        chosen = _probe(args, plan, spec, work, hw) or chosen
    if chosen is None:
        return 1
    if args.out:
        print(_write(chosen, hw, spec, args.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run `zeroshard plan`; returns the exit status.

    Example:
        $ zeroshard plan --model config.json --devices 8 --device-memory 80GB --cpu-memory 512GB \\
              --seq-len 2048 --global-batch 256 --out ds_config.json
    """
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except (ZeroshardError, ConfigError) as e:
        print(f"zeroshard plan: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
