"""Bytes moved per optimizer step and step time of a Hugging Face MoE model: dense ZeRO-3 against AutoEP.

    OMP_NUM_THREADS=1 python bench/moe_traffic.py                # 2 and 4 ranks, 3 rounds (~12-15 min, 2 loaded cores)
    OMP_NUM_THREADS=1 python bench/moe_traffic.py --smoke        # 2 ranks, a smaller model, 1 round (~40 s)
    python bench/moe_traffic.py --two-node                        # as root: EP inside a node against across the link

Issue 40 item 8. One tiny-but-not-trivial Mixtral, built from its config (nothing downloaded), the same
seed and batches in every case, trained by a torchrun job per case (gloo, CPU):

- ``dense_z3``: ZeRO-3 over every rank, no expert parallelism: every rank gathers each layer's
  whole expert bank (zeroshard's defaults keep it gathered from forward to backward at this size);
- ``dense_z3_regather``: the same with ``stage3_max_reuse_distance: 0``, so the bank is gathered
  again in backward, as a model too large to keep gathered does;
- ``ep_z3`` / ``ep_z2``: AutoEP with ``autoep_size`` = world size at ZeRO-3 / ZeRO-2: each rank holds
  its experts and the tokens move by all-to-all;
- ``ep_half_z3`` (4 ranks): ``autoep_size`` = world / 2, each expert held by an expert-data-parallel
  pair that ZeRO-3 partitions it over (expect EP x fewer gathered expert bytes than ``dense_z3``).

Bytes come from zeroshard's own comm log (the ``comms_logger`` config section: one record per
collective, its op, its group's label and its message size as nccl-tests counts it: all_gather the
gathered output, reduce_scatter and all_to_all the input, all_reduce the tensor); AutoEP's token
exchange records its all-to-alls there too, under its expert-parallel group's label. A record is
an *expert* byte when its group is an expert group (label ``ep:`` / ``edp:``) or, in the dense
cases, when it is a gather or gradient reduction of exactly one layer's expert bank (its size; without the
shared-memory collectives zeroshard all-reduces gradients on gloo instead of reduce-scattering); every other record is
*other* (attention, embeddings, norms, routers, the loss and norm scalars). Records of a group of one
rank (the expert-data-parallel group when ``autoep_size`` = world) move nothing and are left out.

Step time: the slowest rank's forward + backward + step, median over the timed steps of a job, then
median over rounds; rounds run the cases in alternating order (forward, then reversed), so a burst of
load on the shared box hits every case alike. Results: bench/moe_traffic.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out" / "moe_traffic"
RESULTS = REPO / "bench" / "moe_traffic.md"
CASES = ("dense_z3", "dense_z3_regather", "ep_z3", "ep_z2", "ep_half_z3")
TWO_NODE_CASES = ("dense_z3", "ep_half_z2", "ep_z2")
SIZES: dict[str, dict[str, int]] = {
    # hidden 256, 8 experts of intermediate 512, top-2, 2 layers: 6.3M expert parameters of 7.2M
    "default": {"vocab": 1024, "hidden": 256, "intermediate": 512, "layers": 2, "heads": 4, "kv_heads": 2,
                "experts": 8, "top_k": 2, "micro": 4, "seq": 128},
    # bank tensors above stage 3's persistence threshold (1e5 elements), so the bank is its own unit
    "smoke": {"vocab": 256, "hidden": 128, "intermediate": 256, "layers": 1, "heads": 2, "kv_heads": 1,
              "experts": 4, "top_k": 2, "micro": 2, "seq": 32},
}
BEGIN, END = "<!-- moe_traffic:begin (generated) -->", "<!-- moe_traffic:end -->"


# ---- one rank (torchrun) -------------------------------------------------------------------

def _model(size: dict[str, int]) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"], num_local_experts=size["experts"],
        num_experts_per_tok=size["top_k"], max_position_embeddings=max(256, size["seq"]))
    return transformers.MixtralForCausalLM(cfg)


def _config(case: str, world: int, size: dict[str, int]) -> dict[str, Any]:
    stage = 2 if case.endswith("_z2") else 3
    zero: dict[str, Any] = {"stage": stage}
    if case == "dense_z3_regather":
        zero["stage3_max_reuse_distance"] = 0
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": size["micro"], "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0, "steps_per_print": 10_000, "zero_optimization": zero,
        "comms_logger": {"enabled": True}}
    if case.startswith("ep_"):
        ep = world // 2 if case.startswith("ep_half") else world
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}
    return cfg


def _group_size(label: str, world: int) -> int:
    """Ranks in the group the comm log names `label` ("world", "dp", "ep:ep_size_N", "edp:ep_size_N")."""
    if label.startswith("ep:"):
        return int(label.rsplit("_", 1)[1])
    if label.startswith("edp:"):
        return world // int(label.rsplit("_", 1)[1])
    return world


def _classify(records: list[Any], world: int, bank_bytes: int, dense: bool) -> dict[str, dict[str, int]]:
    """Per kind ("expert", "other", "local"), per op: bytes of one step's records on this rank."""
    out: dict[str, dict[str, int]] = {"expert": {}, "other": {}, "local": {}}
    for rec in records:
        if _group_size(rec.group, world) == 1:
            kind = "local"
        elif rec.group.startswith(("ep:", "edp:")):
            kind = "expert"
        elif dense and rec.op in ("all_gather", "reduce_scatter", "all_reduce") and rec.bytes == bank_bytes:
            kind = "expert"  # one layer's whole bank gathered, or its gradient reduced (all-reduced on gloo)
        else:
            kind = "other"
        out[kind][rec.op] = out[kind].get(rec.op, 0) + rec.bytes
    return out


def _tx_bytes(dev: str) -> int:
    path = Path(f"/sys/class/net/{dev}/statistics/tx_bytes")
    return int(path.read_text()) if dev and path.exists() else 0


def worker(case: str, size_name: str, warmup: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard
    import zeroshard.moe.hf_experts as hf_experts

    torch.set_num_threads(1)
    size = SIZES[size_name]
    model = _model(size)
    bank = next(m for m in model.modules() if hf_experts.is_expert_bank(m))
    bank_bytes = sum(p.numel() * p.element_size() for p in bank.parameters())
    world = int(os.environ["WORLD_SIZE"])
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(case, world, size))
    rank, log = dist.get_rank(), engine.comm.log
    assert log is not None, "comms_logger.enabled should give the engine's Comm a log"

    per_step: list[dict[str, dict[str, int]]] = []
    times: list[float] = []
    losses: list[float] = []
    dev = os.environ.get("GLOO_SOCKET_IFNAME", "")
    tx = lo = 0
    for step in range(warmup + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, size["vocab"], (size["micro"], size["seq"]), generator=g)
        dist.barrier()
        if step == warmup:
            tx, lo = _tx_bytes(dev), _tx_bytes("lo")
        log.reset()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        took = torch.tensor([time.perf_counter() - start, loss.item()])
        records = list(log.records)
        dist.all_reduce(took[:1], op=dist.ReduceOp.MAX)  # the slowest rank's step
        dist.all_reduce(took[1:], op=dist.ReduceOp.SUM)
        if step >= warmup:
            times.append(float(took[0]))
            per_step.append(_classify(records, world, bank_bytes, case.startswith("dense")))
        losses.append(float(took[1]) / world)
    dist.barrier()
    tx, lo = _tx_bytes(dev) - tx, _tx_bytes("lo") - lo
    mine = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "bytes": per_step,
            "tx": tx, "lo": lo}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        print("RESULT " + json.dumps({
            "case": case, "world": world, "size": size_name, "steps": steps, "step_s": times, "losses": losses,
            "params": sum(p.numel() for p in _model(size).parameters()),
            "expert_params": size["layers"] * bank_bytes // 4, "bank_bytes": bank_bytes, "ranks": gathered}),
            flush=True)


# ---- the driver ----------------------------------------------------------------------------

def _per_rank_bytes(row: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per kind, per op: bytes per step, mean over the timed steps and over the ranks."""
    out: dict[str, dict[str, float]] = {"expert": {}, "other": {}, "local": {}}
    n = len(row["ranks"]) * row["steps"]
    for r in row["ranks"]:
        for step in r["bytes"]:
            for kind, ops in step.items():
                for op, nbytes in ops.items():
                    out[kind][op] = out[kind].get(op, 0.0) + nbytes / n
    return out


def _run_case(case: str, world: int, args: argparse.Namespace) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(Path(__file__).resolve()), "--worker", case, "--size", args.size,
           "--warmup", str(args.warmup), "--steps", str(args.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if args.gloo_only:
        env["ZEROSHARD_COMM_SHM"] = "0"
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        print(f"{case} @ {world}: failed (exit {done.returncode})\n{(done.stdout + done.stderr)[-3000:]}", flush=True)
        return None
    return json.loads(found[0][len("RESULT "):])


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    jobs = [(case, world) for world in args.worlds for case in args.cases
            if not (case.startswith("ep_half") and world < 4)]
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):
        for case, world in (jobs if rnd % 2 == 0 else jobs[::-1]):
            t0 = time.perf_counter()
            row = _run_case(case, world, args)
            if row is not None:
                rows.setdefault((case, world), []).append(row)
                print(f"round {rnd + 1}: {case} @ {world} ranks: step {statistics.median(row['step_s']):.3f} s "
                      f"({time.perf_counter() - t0:.0f} s job, load {os.getloadavg()[0]:.1f})", flush=True)
    return [_merge(runs) for (_, _), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], jobs.index(kv[0])))]


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a case's rounds: bytes from the first (they repeat: same seed, same batches),
    step time the median of the rounds' medians."""
    row = dict(runs[0])
    row["bytes"] = _per_rank_bytes(runs[0])
    row["round_step_s"] = [statistics.median(r["step_s"]) for r in runs]
    row["median_step_s"] = statistics.median(row["round_step_s"])
    row["bytes_repeat"] = all(_per_rank_bytes(r)["expert"] == row["bytes"]["expert"] for r in runs)
    row.pop("ranks")
    return row


OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}" if x else "0"


def _ops(ops: dict[str, float]) -> str:
    parts = [f"{op.replace('_', '-')} {_mb(ops[op])}" for op in OPS if ops.get(op)]
    parts += [f"{op} {_mb(v)}" for op, v in ops.items() if op not in OPS and v]
    return ", ".join(parts) or "0"


def _ratio(theirs: float | None, mine: float) -> str:
    """`theirs / mine`: "-" without a reference or when both are 0."""
    if theirs is None or mine == theirs == 0:
        return "-"
    return "inf (none left)" if mine == 0 else f"{theirs / mine:.2f}"


SCALAR_BYTES = 1024
"""An expert group's collectives under this many bytes per step are scalars (the expert part of the
gradient norm, overflow flags), counted as other bytes rather than expert weights."""


def _split(b: dict[str, dict[str, float]]) -> tuple[dict[str, float], float, dict[str, float]]:
    """(expert weight bytes by op, token all-to-all bytes, other bytes by op) of one row's per-rank bytes."""
    weights = {op: v for op, v in b["expert"].items() if op != "all_to_all" and v >= SCALAR_BYTES}
    other = dict(b["other"])
    for op, v in b["expert"].items():
        if op != "all_to_all" and v < SCALAR_BYTES:
            other[op] = other.get(op, 0.0) + v
    return weights, b["expert"].get("all_to_all", 0.0), other


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"Machine: {meta['machine']}. Measured {meta['started']} - {meta['ended']} UTC, load average "
             f"{meta['load_before']:.1f} before, {meta['load_after']:.1f} after; {meta['rounds']} rounds of "
             f"{meta['warmup']} warm-up + {meta['steps']} timed steps per job; size `{meta['size']}`; "
             + ("every collective over gloo (`ZEROSHARD_COMM_SHM=0`)." if meta.get("gloo_only") else
                "the data-parallel group's collectives through shared memory, the expert groups' and the "
                "token all-to-all over gloo (zeroshard's defaults)."), "",
             "MB per step per rank (10^6 bytes, the comm log's message sizes: all-gather output, reduce-scatter "
             "and all-to-all input, all-reduce tensor), mean over the timed steps and the ranks.", "",
             "| case | ranks | expert weights: gather + gradient reduction (by op) | expert tokens: all-to-all | "
             "other (by op) | step s (median of rounds) | expert weight bytes: dense_z3 / this | expert bytes "
             "(weights + tokens): dense_z3 / this | all bytes: dense_z3 / this | step: this / dense_z3 | last loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["world"]: r for r in rows if r["case"] == "dense_z3"}
    for r in rows:
        weights, tokens, others = _split(r["bytes"])
        ref = base.get(r["world"])
        rw = rt = ro = None
        if ref is not None:
            ref_weights, ref_tokens, ref_others = _split(ref["bytes"])
            rw = sum(ref_weights.values())
            rt, ro = rw + ref_tokens, rw + ref_tokens + sum(ref_others.values())
        w, other = sum(weights.values()), sum(others.values())
        step = "-" if ref is None else f"{r['median_step_s'] / ref['median_step_s']:.2f}"
        lines.append(f"| `{r['case']}` | {r['world']} | {_ops(weights)} | {_mb(tokens)} | "
                     f"{_ops(others)} | "
                     f"{r['median_step_s']:.3f} | {_ratio(rw, w)} | {_ratio(rt, w + tokens)} | "
                     f"{_ratio(ro, w + tokens + other)} | {step} | {r['losses'][-1]:.5f} |")
    lines += ["", "Per-round step medians (s): " + "; ".join(
        f"`{r['case']}` @ {r['world']}: " + "/".join(f"{t:.3f}" for t in r["round_step_s"]) for r in rows) + "."]
    return "\n".join(lines)


def _machine() -> str:
    import torch
    import transformers

    return (f"{platform.node() or 'host'}, {os.cpu_count()} CPU cores (shared), {platform.platform()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
            "gloo, OMP_NUM_THREADS=1")


def _write(text: str, results: Path, marker: str = "") -> None:
    begin, end = BEGIN.replace("begin", f"begin{marker}"), END.replace("end", f"end{marker}")
    old = results.read_text() if results.exists() else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in old and end in old:
        new = old.split(begin)[0] + block + old.split(end, 1)[1]
    else:
        new = old + ("\n" if old else "") + block + "\n"
    results.write_text(new)


def drive(args: argparse.Namespace) -> int:
    meta = {"started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg()[0],
            "gloo_only": args.gloo_only, "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps,
            "size": args.size,
            "machine": _machine()}
    rows = run_all(args)
    meta.update(ended=datetime.now(timezone.utc).strftime("%H:%M"), load_after=os.getloadavg()[0])
    OUT.mkdir(parents=True, exist_ok=True)
    name = "results_gloo.json" if args.gloo_only else "results.json"
    (args.out_dir / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = render(rows, meta)
    print(table)
    if args.results is not None:
        _write(table, args.results, marker=" gloo-only" if args.gloo_only else "")
    return 0 if rows else 1


# ---- EP inside a node against across the link (root, network namespaces) ------------------------

def drive_two_node(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "bench"))
    from two_node import SKIP_EXIT, TwoNodeCluster, unavailable

    why = unavailable()
    if why is not None:
        print(f"SKIP two-node cluster: {why}", file=sys.stderr)
        return SKIP_EXIT
    meta = {"started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg()[0],
            "machine": _machine(), "rate": args.rate}
    rows = []
    with TwoNodeCluster(rate=None if args.rate == "none" else args.rate, delay_ms=0) as cluster:
        meta["shaping"] = cluster.shaping
        for case in args.two_node_cases:
            argv = [str(Path(__file__).resolve()), "--worker", case, "--size", args.size,
                    "--warmup", str(args.warmup), "--steps", str(args.steps)]
            # Both namespaces share the host's /dev/shm, so zeroshard's shared-memory collectives (Note:
            # [shared-memory collectives] in comm/shm.py) would join the two "nodes" past the veth: the
            # data-parallel group's bytes would never reach the link. Real nodes share no memory.
            results = cluster.run(argv, 2, timeout_s=args.timeout_s, env={"ZEROSHARD_COMM_SHM": "0"})
            found = [line for _, out in results for line in out.splitlines() if line.startswith("RESULT ")]
            if not found:
                print(f"{case}: failed\n" + "\n".join(out[-1500:] for _, out in results), flush=True)
                continue
            row = json.loads(found[0][len("RESULT "):])
            node_first = [r for r in row["ranks"] if r["local_rank"] == 0]
            row["inter_node_bytes"] = sum(r["tx"] for r in node_first) / row["steps"]
            row["intra_node_bytes"] = sum(r["lo"] for r in node_first) / row["steps"]
            row["bytes"] = _per_rank_bytes(row)
            row["median_step_s"] = statistics.median(row["step_s"])
            row.pop("ranks")
            rows.append(row)
            print(f"{case}: link {row['inter_node_bytes'] / 1e6:.2f} MB/step, step {row['median_step_s']:.2f} s",
                  flush=True)
    meta.update(ended=datetime.now(timezone.utc).strftime("%H:%M"), load_after=os.getloadavg()[0])
    OUT.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "two_node.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    where = {"dense_z3": "ZeRO-3 over 4 ranks, across the link", "ep_half_z2": "EP 2 inside each node, "
             "expert-data-parallel pairs and ZeRO-2 across", "ep_z2": "EP 4 across the link, ZeRO-2 over 4"}
    lines = [f"Machine: {meta['machine']}. Measured {meta['started']} - {meta['ended']} UTC, load average "
             f"{meta['load_before']:.1f} before, {meta['load_after']:.1f} after; link {args.rate} "
             f"({meta['shaping']}); every collective over gloo (`ZEROSHARD_COMM_SHM=0`); one job per case, "
             f"{args.warmup} warm-up + {args.steps} timed steps.", "",
             "| case | layout (node 0 = ranks 0-1) | inter-node MB/step (veth) | intra-node MB/step (lo) | "
             "logged expert MB/step per rank | step s (median) | link bytes: this / dense_z3 | step: this / dense_z3 |",
             "|---|---|---|---|---|---|---|---|"]
    ref = next((r for r in rows if r["case"] == "dense_z3"), None)
    for r in rows:
        link = "-" if ref is None else f"{r['inter_node_bytes'] / ref['inter_node_bytes']:.3f}"
        step = "-" if ref is None else f"{r['median_step_s'] / ref['median_step_s']:.2f}"
        lines.append(f"| `{r['case']}` | {where.get(r['case'], '')} | {_mb(r['inter_node_bytes'])} | "
                     f"{_mb(r['intra_node_bytes'])} | {_mb(sum(r['bytes']['expert'].values()))} | "
                     f"{r['median_step_s']:.2f} | {link} | {step} |")
    table = "\n".join(lines)
    print(table)
    if args.results is not None:
        _write(table, args.results, marker=" two-node")
    return 0 if rows else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=CASES + TWO_NODE_CASES, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # zeroshard launch passes it
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--size", choices=tuple(SIZES), default="default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--smoke", action="store_true",
                    help="2 ranks, dense_z3 and ep_z3, the smoke size, 1 round of 1 + 1 steps; no results.md")
    ap.add_argument("--gloo-only", action="store_true",
                    help="ZEROSHARD_COMM_SHM=0: every collective over gloo's sockets (the default puts the "
                         "data-parallel group's through shared memory); its own section of the results")
    ap.add_argument("--two-node", action="store_true", help="the netns cluster (root): EP inside a node vs across")
    ap.add_argument("--two-node-cases", nargs="+", default=list(TWO_NODE_CASES), choices=TWO_NODE_CASES)
    ap.add_argument("--rate", default="1gbit", help="tc rate per direction of the inter-node link, or 'none'")
    ap.add_argument("--render-only", action="store_true", help="rewrite the table from OUT_DIR/results.json")
    ap.add_argument("--out-dir", type=Path, default=OUT)
    ap.add_argument("--results", type=Path, default=RESULTS, help="the .md whose generated section is rewritten")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.size, args.warmup, args.steps)
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.cases, args.worlds, args.size, args.rounds, args.warmup, args.steps = (
            ["dense_z3", "ep_z3"], [2], "smoke", 1, 1, 1)
        if args.results == RESULTS:
            args.results = None
    if args.two_node:
        return drive_two_node(args)
    if args.render_only:
        raw = json.loads((args.out_dir / ("results_gloo.json" if args.gloo_only else "results.json")).read_text())
        table = render(raw["rows"], raw["meta"])
        print(table)
        if args.results is not None:
            _write(table, args.results, marker=" gloo-only" if args.gloo_only else "")
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
