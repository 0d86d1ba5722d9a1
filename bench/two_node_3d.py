"""ZeRO-3 across the link against TP inside the node and PP across the link, on the simulated
two-node cluster (bench/two_node.py: 2 nodes x 2 ranks, a rate-limited veth between them).

    python bench/two_node_3d.py [--rate 300mbit] [--steps 3] [--cases zero3_llama tp2_dp2 ...]

Each case is one `zeroshard launch` per node. Inside, every node's first rank reads its veth's
tx_bytes counter around the timed steps (after a barrier), so the bytes are those of the steps
only: inter-node bytes per step, both directions summed. The prediction is the estimator's
traffic model (estimate/plan3d.py's volumes, with gloo's ring: a group of g ranks over 2 nodes
crosses the link on 2 of its g ring hops, each hop carrying (g - 1) / g of the message).

Cases (the two models have ~5-6M parameters; with a per-rank budget of 64 MB of model states
neither fits plain data parallelism, 18 bytes/param in bf16 with fp32 masters and Adam):
- zero3_llama: a tiny Llama (HF, built from its config), ZeRO-3 over the 4 ranks (across the link).
- tp2_dp2: the same Llama, AutoTP 2 inside each node, ZeRO-1 over DP 2 across the link.
- tp4_across: TP 4 over both nodes (DP 1): the control, every TP all-reduce crosses the link.
- zero3_pipe: a layer stack (embedding, 8 MLP blocks, head), ZeRO-3 over the 4 ranks.
- pp2_dp2: the same layers as a PipelineModule, 2 stages across the link, ZeRO-1 over DP 2
  inside each node (issue 26 item 11: pipeline stages across the link against ZeRO-3 across it).
- pp2_tp2: the same PipelineModule with AutoTP 2 inside each node (3D: PP across x TP inside,
  ZeRO-1, DP 1); partition_config splits each block's MLP (fc column, proj row).
Each case reports where its groups sit (a group "inside" when its ranks share a namespace) and,
per node, the loopback's bytes too (intra-node traffic). `--gas` is micro-batches per replica, so
layouts with less DP train fewer tokens; `--global-batch N` gives every case N sequences per step.
Writes bench/out/two_node_3d.json; the table is in bench/README.md ("3D on two nodes").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VOCAB, DIM, SEQ, MICRO, BLOCKS = 4000, 256, 64, 2, 8
CASES = ("zero3_llama", "tp2_dp2", "tp4_across", "zero3_pipe", "pp2_dp2", "pp2_tp2")
LAYOUTS = {"pp2_dp2": (2, 1), "pp2_tp2": (2, 2), "tp2_dp2": (1, 2), "tp4_across": (1, 4)}
"""(pp, tp) of each case; dp is what the 4 ranks leave; the others are (1, 1)."""
PIPE_TP_SPECS = [  # tensor_parallel.partition_config for pp2_tp2: each block's MLP pair, column then row
    {"patterns": [r"^\d+\.fc\.weight$"], "partition_type": "column"},
    {"patterns": [r"^\d+\.proj\.weight$"], "partition_type": "row"},
]


def _tx_bytes(dev: str | None = None) -> int:
    """Bytes sent so far on `dev` (default: the veth gloo is pinned to) in this node's namespace."""
    dev = dev or os.environ.get("GLOO_SOCKET_IFNAME", "")
    path = Path(f"/sys/class/net/{dev}/statistics/tx_bytes")
    return int(path.read_text()) if dev and path.exists() else 0


def _llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _pipe_layers() -> list[Any]:
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.fc = nn.Linear(DIM, 4 * DIM)
            self.proj = nn.Linear(4 * DIM, DIM)

        def forward(self, x: Any) -> Any:
            return x + self.proj(F.gelu(self.fc(self.norm(x))))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.out = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, x: Any) -> Any:
            return self.out(self.norm(x))

    return [nn.Embedding(VOCAB, DIM), *[Block() for _ in range(BLOCKS)], Head()]


def _config(stage: int, gas: int, dp: int, **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "train_batch_size": MICRO * gas * dp, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**6,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000,
                                  "stage3_prefetch_bucket_size": 5_000_000}, **extra}


def worker(case: str, steps: int, gas: int) -> None:
    """One rank of one case (started by `zeroshard launch` inside a namespace)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import zeroshard
    from zeroshard.comm.topology import Topology

    torch.set_num_threads(1)
    world = zeroshard.comm.init_distributed()
    rank, w = world.rank, world.world_size
    # One batch stream per data-parallel replica: a pipeline's stages and a TP group's ranks read the same
    # micro-batches (the first stage the inputs, the last the labels; every TP rank the same tokens)
    pp_size, tp_size = LAYOUTS.get(case, (1, 1))
    topo = Topology.for_world(w, pp=pp_size, tp=tp_size)
    g = torch.Generator().manual_seed(topo.coord(rank)["dp"])
    batches = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(gas)]
    if case in ("zero3_llama", "tp2_dp2", "tp4_across"):
        tp = {"zero3_llama": 1, "tp2_dp2": 2, "tp4_across": 4}[case]
        cfg = _config(3 if tp == 1 else 1, gas, w // tp, **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}))
        model = _llama()
        params = sum(p.numel() for p in model.parameters())
        engine, *_ = zeroshard.initialize(model=model, config=cfg)

        def step() -> None:
            for ids in batches:
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
    else:
        layers = _pipe_layers()
        params = sum(p.numel() for m in layers for p in m.parameters())

        def loss_fn(out: Any, y: Any) -> Any:
            return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))

        if case == "zero3_pipe":
            model = nn.Sequential(*layers)
            engine, *_ = zeroshard.initialize(model=model, config=_config(3, gas, w))

            def step() -> None:
                for ids in batches:
                    engine.backward(loss_fn(engine(ids), ids))
                    engine.step()
        else:
            from zeroshard.pipe import PipelineModule

            tp = 2 if case == "pp2_tp2" else 1
            extra = {"tensor_parallel": {"autotp_size": tp, "partition_config": {"layer_specs": PIPE_TP_SPECS}}}
            net = PipelineModule(layers, num_stages=2, partition_method="uniform", loss_fn=loss_fn)
            engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()),
                                              config=_config(1, gas, w // (2 * tp), **(extra if tp > 1 else {})))

            def step() -> None:
                engine.train_batch(iter([(ids, ids) for ids in batches]))
    local_params = sum(p.numel() for p in engine.module.parameters())  # this rank's share: TP pieces, its stage
    step()  # warm-up: allocation, shape inference, the first gathers
    times = []
    dist.barrier()
    before, lo_before = _tx_bytes(), _tx_bytes("lo")
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    after, lo_after = _tx_bytes(), _tx_bytes("lo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    out: list[Any] = [None] * w
    mine = {"rank": rank, "local": local, "tx": after - before, "lo": lo_after - lo_before, "times": times,
            "local_params": local_params,
            "node": os.environ.get("GLOO_SOCKET_IFNAME", ""), "groups": _groups(engine, rank)}
    dist.all_gather_object(out, mine)
    if rank == 0:
        tx = sum(o["tx"] for o in out if o["local"] == 0)  # one reader per node: its veth's tx
        lo = sum(o["lo"] for o in out if o["local"] == 0)  # and its loopback's: the intra-node traffic
        print("RESULT " + json.dumps({"case": case, "params": params, "steps": steps, "gas": gas,
                                      "tokens_per_step": gas * MICRO * SEQ * topo.dp,
                                      "inter_node_bytes_per_step": tx / steps,
                                      "intra_node_bytes_per_step": lo / steps,
                                      "step_s": statistics.median(times), "placement": placement(out),
                                      "local_params": [o["local_params"] for o in out]}), flush=True)


def _groups(engine: Any, rank: int) -> dict[str, list[int]]:
    """This rank's groups along each axis of the engine's mesh (empty without one)."""
    from zeroshard.comm.topology import AXES

    mesh = engine.parallel.mesh if engine.parallel is not None else None
    return {} if mesh is None else {a: mesh.topology.axis_ranks(a, rank) for a in AXES}


def placement(ranks: list[dict[str, Any]]) -> dict[str, str]:
    """For each axis with groups larger than one rank: "inside" when every group's ranks share a node (a
    namespace: its veth), "across" when every group spans both, "mixed" otherwise."""
    node = {r["rank"]: r["node"] for r in ranks}
    found: dict[str, str] = {}
    for axis in ("pp", "dp", "tp"):
        groups = {tuple(r["groups"].get(axis, [])) for r in ranks} - {()}
        if not groups or max(len(g) for g in groups) < 2:
            continue
        spans = {len({node[m] for m in g}) > 1 for g in groups}
        found[axis] = "mixed" if len(spans) > 1 else ("across" if spans.pop() else "inside")
    return found


def predicted_inter_bytes(case: str, params_llama: int, params_pipe: int, gas: int) -> float:
    """Inter-node bytes per step (both directions) from the estimator's traffic volumes."""
    # bf16 parameters; fp32 gradients, reduce-scattered through gloo's all-reduce (gloo has no
    # single-tensor reduce-scatter: comm/collectives.py falls back, twice the bytes)
    p, g = 2, 2 * 4
    if case in ("zero3_llama", "zero3_pipe"):
        n = params_llama if case == "zero3_llama" else params_pipe
        # per micro-batch: all-gather forward + backward, reduce-scatter; ring of 4 ranks over 2 nodes:
        # 2 of 4 hops cross, each carrying 3/4 of the message
        return gas * 2 * 3 / 4 * n * (2 * p + g)
    if case == "tp2_dp2":
        # ZeRO-1 over dp 2 (pairs across the link): each rank sends 1/2 of its TP shard's gradient
        # (reduce-scatter) and of its parameters (all-gather); TP all-reduces stay inside the node
        from zeroshard.estimate.hf_count import count_hf_params
        from zeroshard.estimate.parallel import stage_spec

        spec = count_hf_params({"model_type": "llama", "hidden_size": DIM, "num_hidden_layers": 4,
                                "num_attention_heads": 8, "intermediate_size": 688, "vocab_size": VOCAB,
                                "max_position_embeddings": SEQ}, "AutoModelForCausalLM")
        share = stage_spec(spec, 1, 2, 0).total_params
        return 4 * 0.5 * share * (g + p)
    if case in ("pp2_dp2", "pp2_tp2"):
        # plan3d's PP term: one activation forward and one gradient back per micro-batch and stage
        # boundary (bf16: the stage output's dtype), for each of the dp * tp = 2 pipelines: under TP each
        # TP rank sends the whole activation to its peer of the next stage. ZeRO-1 over dp (pp2_dp2) and
        # the TP all-reduces (pp2_tp2) stay inside the node.
        return 2 * gas * 2 * MICRO * SEQ * DIM * 2
    if case == "tp4_across":
        # the control: a TP ring of 4 over both nodes (2 of 4 hops cross, each 2 * 3/4 of an
        # all-reduce): 4 all-reduces of b*s*h bf16 per layer and micro-batch (2 forward, 2
        # backward), and the head's logits all-gathered (gather_output) once per micro-batch
        sbh = MICRO * SEQ * DIM * 2
        return gas * (4 * 4 * 2 * 2 * 3 / 4 * sbh + 2 * 3 / 4 * MICRO * SEQ * VOCAB * 2)
    return float("nan")


def predicted_intra_bytes(case: str, params_pipe: int, gas: int) -> float:
    """Intra-node bytes per step (both nodes' loopbacks) from the same volumes; the layer-stack cases only."""
    p, g = 2, 2 * 4
    if case == "zero3_pipe":
        # the ring of 4 has as many hops inside the nodes (2) as across the link
        return gas * 2 * 3 / 4 * params_pipe * (2 * p + g)
    if case == "pp2_dp2":
        # ZeRO-1 over dp 2 inside each node, once per batch under a pipeline: each rank sends 1/2 of its
        # stage's gradient (all-reduce fallback, g) and of its parameters (all-gather, p)
        return 2 * 0.5 * params_pipe * (g + p)
    if case == "pp2_tp2":
        # plan3d's TP term, 2 (t - 1) / t of b*s*h per all-reduce and rank; a block here has one Megatron
        # pair (the MLP), so 2 all-reduces (forward after proj, backward before fc) where a transformer
        # layer has 4: 8 blocks x 2 TP ranks per micro-batch; DP 1, so ZeRO-1 moves nothing
        return gas * BLOCKS * 2 * 2 * (2 * 1 / 2) * MICRO * SEQ * DIM * 2
    return float("nan")


def _gas(case: str, args: argparse.Namespace) -> int:
    """Micro-batches per step and replica: --gas, or what makes --global-batch sequences per step."""
    if args.global_batch is None:
        return int(args.gas)
    pp, tp = LAYOUTS.get(case, (1, 1))
    per_step = MICRO * 4 // (pp * tp)  # the driver runs without zeroshard on its path: dp of the 4 ranks
    if args.global_batch % per_step:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of {case}'s {per_step} sequences "
                         f"per micro-batch step (micro batch {MICRO} x its data-parallel size)")
    return int(args.global_batch // per_step)


def drive(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "bench"))
    from two_node import TwoNodeCluster, unavailable

    why = unavailable()
    if why is not None:
        print(f"SKIP two-node cluster: {why}", file=sys.stderr)
        return 3
    load = os.getloadavg()
    rows = []
    with TwoNodeCluster(rate=args.rate, delay_ms=0) as cluster:
        for case in args.cases:
            gas = _gas(case, args)
            argv = [str(Path(__file__).resolve()), "--worker", case, "--steps", str(args.steps), "--gas", str(gas)]
            results = cluster.run(argv, 2, timeout_s=args.timeout_s)
            found = [line for _, out in results for line in out.splitlines() if line.startswith("RESULT ")]
            if not found:
                print(f"{case}: failed\n" + "\n".join(out[-3000:] for _, out in results), flush=True)
                continue
            row = json.loads(found[0][len("RESULT "):])
            rows.append(row)
            print(f"{case}: {row}", flush=True)
    params = {r["case"]: r["params"] for r in rows}
    for r in rows:
        r["predicted_inter_node_bytes_per_step"] = predicted_inter_bytes(
            r["case"], params.get("zero3_llama", r["params"]), params.get("zero3_pipe", r["params"]), r["gas"])
        r["predicted_intra_node_bytes_per_step"] = predicted_intra_bytes(
            r["case"], params.get("zero3_pipe", r["params"]), r["gas"])
    out = REPO / "bench" / "out" / "two_node_3d.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rate": args.rate, "loadavg_before": load, "loadavg_after": os.getloadavg(),
                               "rows": rows}, indent=1))
    print(f"load average before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}; link {args.rate}")
    print("| case | params | groups across the link | inter-node MB/step measured | predicted | intra-node MB/step "
          "measured | predicted | tokens / step | step s | step / zero3 of the same model | per token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = {r["case"]: r for r in rows if r["case"].startswith("zero3")}
    for r in rows:
        ref = base.get("zero3_llama" if r["case"] in ("zero3_llama", "tp2_dp2", "tp4_across") else "zero3_pipe")
        per_token = (r["step_s"] / r["tokens_per_step"]) / (ref["step_s"] / ref["tokens_per_step"]) if ref else None
        across = ", ".join(a for a, where in r["placement"].items() if where != "inside") or "none"
        print(f"| {r['case']} | {r['params'] / 1e6:.2f}M | {across} | {r['inter_node_bytes_per_step'] / 1e6:.3f} | "
              f"{r['predicted_inter_node_bytes_per_step'] / 1e6:.3f} | {r['intra_node_bytes_per_step'] / 1e6:.3f} | "
              f"{r['predicted_intra_node_bytes_per_step'] / 1e6:.3f} | {r['tokens_per_step']} | {r['step_s']:.2f} | "
              + (f"{r['step_s'] / ref['step_s']:.2f} | {per_token:.2f} |" if ref else "- | - |"))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=CASES)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--rate", default="300mbit")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gas", type=int, default=2, help="micro-batches per step and data-parallel replica")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences per step, the same for every case (its micro-batch count derived); "
                         "default: --gas micro-batches per replica, so layouts with less DP train fewer tokens")
    ap.add_argument("--timeout-s", type=float, default=280)
    ap.add_argument("--local_rank", type=int, default=-1, help="given by zeroshard launch, as DeepSpeed's launcher")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.gas)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
