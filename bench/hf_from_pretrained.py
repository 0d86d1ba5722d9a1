"""Peak RSS per rank of `from_pretrained` at ZeRO-3 under the alias: sharded load vs Transformers' path.

Builds a Llama from a config (about 81M parameters, 325 MB in fp32; nothing downloaded), saves
it with `save_pretrained` into a temporary directory, then loads it with unmodified user code
(tests/launch/scripts/hf_pretrained_load.py: HfDeepSpeedConfig at stage 3, then
`AutoModelForCausalLM.from_pretrained(path)`) at 1 and 2 CPU ranks, once on zeroshard's sharded
path and once on Transformers' gather-and-broadcast path (ZEROSHARD_SHARDED_FROM_PRETRAINED=0).
Each rank reports ru_maxrss before and after the call; the difference is the load's peak over
the process's baseline (imports, process group). Prints a Markdown table (bench/hf_from_pretrained.md).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/hf_from_pretrained.py [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "launch" / "scripts" / "hf_pretrained_load.py"


def save_model(path: Path, layers: int, shard: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size=shard)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def load(path: Path, nproc: int, sharded: bool, out: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ZEROSHARD_AS_DEEPSPEED="1", ZEROSHARD_ALIAS_QUIET="1",
               ZEROSHARD_SHARDED_FROM_PRETRAINED="1" if sharded else "0")
    results = out / f"{'sharded' if sharded else 'whole'}{nproc}"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    str(SCRIPT), "--pretrained", str(path), "--results", str(results)],
                   env=env, check=True, capture_output=True, timeout=1800)
    return [json.loads(Path(f"{results}.rank{r}").read_text()) for r in range(nproc)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--max-shard-size", default="100MB", help="save_pretrained's max_shard_size")
    p.add_argument("--nprocs", default="1,2")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama"
        model_bytes = save_model(model_dir, args.layers, args.max_shard_size)
        files = len(list(model_dir.glob("*.safetensors")))
        print(f"model: {model_bytes / 2**20:.0f} MiB of fp32 weights in {files} safetensors file(s)\n")
        print("| path | ranks | rank | baseline RSS MiB | peak RSS MiB | peak over baseline MiB | load s |")
        print("|---|---|---|---|---|---|---|")
        for nproc in [int(n) for n in args.nprocs.split(",")]:
            for sharded in (True, False):
                for r in load(model_dir, nproc, sharded, Path(tmp)):
                    before, peak = r["rss_before_kib"] / 1024, r["rss_peak_kib"] / 1024
                    print(f"| {'sharded (zeroshard)' if sharded else 'whole (Transformers)'} | {nproc} | {r['rank']} "
                          f"| {before:.0f} | {peak:.0f} | {peak - before:.0f} | {r['load_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
