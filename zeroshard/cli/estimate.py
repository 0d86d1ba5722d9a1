"""`zeroshard estimate`: model-state memory per device and per node for every stage and offload.

No GPU needed and no weights: a config is built on the meta device. Exit status 0, or 2 with
one line on stderr when the input is wrong. Imports `zeroshard.estimate`, `zeroshard.config`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import cast

from zeroshard.config import load_config
from zeroshard.errors import ConfigError, ZeroshardError
from zeroshard.estimate.activations import SCHEDULES, ActivationOptions, activation_bytes
from zeroshard.estimate.deepspeed_compat import format_rows, zero2_rows, zero3_rows
from zeroshard.estimate.expert_states import estimate_rank_ep
from zeroshard.estimate.model_source import load_model_spec
from zeroshard.estimate.parallel import Layout, estimate_layout
from zeroshard.estimate.spec import ModelSpec, parse_count, spec_from_counts
from zeroshard.estimate.states import Precision, Setup
from zeroshard.estimate.table import format_table, table_rows

MODEL_HELP = ("gpt:<tiny|small|25m> (zeroshard's GPT), a GPT config JSON, or a Hugging Face config.json "
              "(or its directory), built on the meta device")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, or --params with --largest-layer; --hf-class. Shared with `zeroshard plan`."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=MODEL_HELP)
    src.add_argument("--params", help="total parameter count instead of a model, e.g. 2.78B (DeepSpeed's 'all cold')")
    p.add_argument("--largest-layer", default=None,
                   help="with --params: parameters of the largest layer, e.g. 65.8M (what stage 3 gathers)")
    p.add_argument("--hf-class", default="AutoModel",
                   help="transformers class for a Hugging Face config (default AutoModel, as DeepSpeed's "
                   "example; AutoModelForCausalLM counts the LM head)")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    if args.model is not None:
        if args.largest_layer is not None:
            raise ZeroshardError("--largest-layer goes with --params; --model reads it from the model")
        return load_model_spec(args.model, args.hf_class)
    largest = parse_count(args.largest_layer) if args.largest_layer is not None else None
    return spec_from_counts(parse_count(args.params), largest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zeroshard estimate", description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--devices", type=int, default=1, help="devices (GPUs) per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32", "both"], default=None,
                   help="training precision; 'both' prints bf16 mixed and fp32 (the default without --config)")
    p.add_argument("--config", help="a ds_config.json: buckets, optimizer, precision and gradient dtype from it")
    p.add_argument("--deepspeed", action="store_true",
                   help="also print DeepSpeed's own estimator tables (its formulas), for comparison")
    p.add_argument("--seq-len", type=int, help="sequence length, for the activation estimate")
    p.add_argument("--micro-batch", type=int, default=1, help="micro batch per device (activations)")
    g = p.add_argument_group("tensor and pipeline parallelism (a per-stage table per ZeRO stage)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (data-parallel size: the rest)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b", help="pipeline schedule (default 1f1b)")
    g.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per step (gradient accumulation; default: the stage count)")
    g.add_argument("--virtual-stages", type=int, default=None, help="stages per rank (interleaved; default 2 there)")
    g.add_argument("--sequence-parallel", action="store_true", help="TP's sequence parallelism")
    g.add_argument("--sp", type=int, default=1,
                   help="Ulysses / ring sequence-parallel size (sequence_parallel_size): activations per rank / sp")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size (expert_parallel.autoep_size) for a Hugging Face MoE model: model "
                   "states per rank for ZeRO 0-3, experts cut over --ep of the data-parallel ranks (with --tp / "
                   "--pp: of each stage's and TP rank's)")
    return p


def _base_setups(args: argparse.Namespace, spec: ModelSpec) -> list[Setup]:
    hw = {"devices_per_node": args.devices, "nodes": args.nodes}
    if args.config:
        hidden = spec.shape.hidden_size if spec.shape else None
        cfg = load_config(args.config, dp_world_size=args.devices * args.nodes, hidden_size=hidden)
        base = Setup.from_config(cfg, **hw)
        precisions: list[Precision] = [base.precision] if args.precision in (None, "both") else [args.precision]
        return [replace(base, precision=p) for p in precisions]
    chosen: str = args.precision or "both"
    precisions = ["bf16", "fp32"] if chosen == "both" else [cast(Precision, chosen)]
    return [Setup(zero_stage=0, precision=p, **hw) for p in precisions]


def _activation_lines(spec: ModelSpec, args: argparse.Namespace, precision: Precision) -> list[str]:
    if args.seq_len is None:
        return []
    if spec.shape is None:
        return ["activations: unknown for a model given by counts (give --model with a transformer config)"]
    lines = []
    for ckpt in (False, True):
        opt = ActivationOptions(seq_len=args.seq_len, micro_batch=args.micro_batch, checkpointing=ckpt,
                                act_bytes=4 if precision == "fp32" else 2, sp=args.sp)
        n = activation_bytes(spec.shape, opt)
        lines.append(f"activations per device, seq {args.seq_len} x micro batch {args.micro_batch}, "
                     f"{'with' if ckpt else 'without'} activation checkpointing"
                     f"{f', sequence-parallel size {args.sp}' if args.sp > 1 else ''}: {n / 2**30:.2f} GB")
    return lines


def _parallel_lines(spec: ModelSpec, args: argparse.Namespace, base: Setup) -> list[str]:
    """Per-stage memory of one rank for ZeRO 0-3 under --tp / --pp (estimate/parallel.py)."""
    world = args.devices * args.nodes
    if world % (args.tp * args.pp):
        raise ZeroshardError(f"--tp {args.tp} x --pp {args.pp} does not divide the {world} devices")
    dp = world // (args.tp * args.pp)
    if args.ep > 1 and (spec.experts is None or dp % args.ep or spec.experts.num_experts % args.ep):
        raise ZeroshardError(f"--ep {args.ep} needs a Hugging Face MoE --model and must divide the data-parallel size "
                             f"({dp}: the devices / (--tp x --pp); expert groups are made inside each stage's and TP "
                             "rank's data-parallel ranks) and the experts")
    virtual = args.virtual_stages or (2 if args.schedule.startswith("interleaved") else 1)
    layout = Layout.for_world(world, tp=args.tp, pp=args.pp, ep=args.ep, schedule=args.schedule,
                              micro_batches=args.micro_batches or args.pp, virtual=virtual,
                              sequence_parallel=args.sequence_parallel)
    act = None
    if args.seq_len is not None and spec.shape is not None:
        act = ActivationOptions(seq_len=args.seq_len, micro_batch=args.micro_batch,
                                act_bytes=4 if base.precision == "fp32" else 2, sp=args.sp)
    acts = f"of seq {args.seq_len}" if act else "not estimated: give --seq-len"
    lines = [f"{layout.label()}, {layout.micro_batches} micro-batches: one rank of each pipeline stage, GB "
             f"({base.precision}; activations {acts})",
             "  ZeRO  stage  layers  params/rank |  states  buffers  pipeline  activations = device"]
    for zero in (0, 1, 2, 3):
        for e in estimate_layout(spec, replace(base, zero_stage=zero), layout, act):
            lines.append(f"  {zero:>4}  {e.stage:>5}  {e.layers:6.1f}  {e.spec.total_params + e.expert_params:>11,} |"
                         f"{e.rank.device.total / 2**30:8.2f} {e.rank.device_buffers / 2**30:8.2f} "
                         f"{e.pipeline_buffers / 2**30:9.2f} {e.activations / 2**30:12.2f} "
                         f"{e.device_peak / 2**30:8.2f}")
    lines.append("pipeline: the batch's gradient kept aside until the last micro-batch (and stage 3's parameters "
                 "gathered for the batch)")
    if layout.ep > 1:
        lines.append(f"experts: 1/{layout.ep} of each of the stage's banks per rank, whole on every TP rank, under "
                     f"ZeRO over the {layout.dims.expert_dp} expert-data-parallel rank(s); dense share under ZeRO over "
                     f"{layout.dp}")
    return lines


def _expert_lines(spec: ModelSpec, args: argparse.Namespace, base: Setup) -> list[str]:
    """Model states per rank for ZeRO 0-3 with the experts cut over --ep ranks (estimate/expert_states.py)."""
    split = spec.experts
    if split is None:
        raise ZeroshardError(f"--ep {args.ep}: {spec.name} has no expert bank (give a Hugging Face MoE config.json "
                             "with --model)")
    world = args.devices * args.nodes
    if world % args.ep or split.num_experts % args.ep:
        raise ZeroshardError(f"--ep {args.ep} must divide the {world} devices and the {split.num_experts} experts")
    dense, experts = split.dense.total_params, split.expert_params
    lines = [f"{spec.name}: {dense:,} dense + {experts:,} expert parameters ({split.num_experts} experts per bank); "
             f"EP {args.ep} x expert-data-parallel {world // args.ep} ({base.precision}), one rank, GB",
             "  ZeRO  experts/rank |  EP 1 states  EP 1 device | states  buffers  device"]
    for zero in (0, 1, 2, 3):
        setup = replace(base, zero_stage=zero)
        one = estimate_rank_ep(split, setup, 1)
        est = estimate_rank_ep(split, setup, args.ep)
        lines.append(f"  {zero:>4}  {experts // args.ep:>12,} | {one.device.total / 2**30:11.2f} "
                     f"{one.device_peak / 2**30:12.2f} | {est.device.total / 2**30:6.2f} "
                     f"{est.device_buffers / 2**30:8.2f} {est.device_peak / 2**30:7.2f}")
    lines.append("dense parameters under ZeRO over every data-parallel rank; each rank's experts under ZeRO over the "
                 f"{world // args.ep} rank(s) holding the same experts")
    return lines


def run(args: argparse.Namespace) -> str:
    if args.devices < 1 or args.nodes < 1:
        raise ZeroshardError("--devices and --nodes must be >= 1")
    spec = model_spec(args)
    if args.ep > 1 and args.tp == args.pp == 1:
        return "\n".join(_expert_lines(spec, args, _base_setups(args, spec)[0]))
    if args.tp > 1 or args.pp > 1:
        return "\n".join(_parallel_lines(spec, args, _base_setups(args, spec)[0]))
    out: list[str] = []
    for base in _base_setups(args, spec):
        out += [format_table(spec, base, table_rows(spec, base)), *_activation_lines(spec, args, base.precision), ""]
    if args.deepspeed:
        out.append("DeepSpeed 0.19's estimator for the same model (its formulas: 16-bit params and gradients):")
        for rows, largest in ((zero2_rows(spec, args.devices, args.nodes, 1.5, "deepspeed"), False),
                              (zero3_rows(spec, args.devices, args.nodes, 1.5, "deepspeed"), True)):
            out += [format_rows(spec, rows, args.devices, args.nodes, "deepspeed", with_largest=largest), ""]
    return "\n".join(out).rstrip()


def main(argv: list[str] | None = None) -> int:
    """Run `zeroshard estimate`; returns the exit status.

    Example:
        $ zeroshard estimate --model gpt:25m --devices 8
        $ zeroshard estimate --params 2.78B --largest-layer 65.8M --deepspeed
    """
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        print(run(args))
    except (ZeroshardError, ConfigError) as e:
        print(f"zeroshard estimate: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
