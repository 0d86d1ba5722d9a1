#!/usr/bin/env bash
# One pass over everything that needs a GPU, sized for one 10-minute lease on a one-GPU machine:
#   1. tests/gpu at world size 1;
#   2. bench/gpu on the ~1.2B GPT, issue 43's rows first: stage 3 and its FSDP2 lifetimes (zs3_lean)
#      against FSDP2 (tokens/s, peak allocated memory), FP8 against bf16 (zs2_fp8, zs2_fp8_rowwise),
#      engine.compile() against eager (zs3_compile), the delayed update against synchronous offload
#      (zs2_offload_delayed, zs2_offload);
#   3. DeepSpeed 0.19's rows when `import deepspeed` works (carried as a wheel: bench/gpu/README.md),
#      with torch_adam (ZS_DS_TORCH_ADAM=1) so no CUDA op has to build;
#   4. the NVMe rows of bench/gpu (25M GPT: NVMe against CPU optimizer offload, stages 2 and 3);
#   5. the disk the swap files live on: dd with O_DIRECT against `zeroshard bench-io`;
#   6. tests/gpu again under torchrun (an NCCL process group of one).
# Each part gets what is left of a global budget (BUDGET_S, default 560 s), in that order, and
# writes its log under OUT (default ./gpu_check_out): a part cut short still leaves its log.
# Not here: two ranks on one GPU (zeroshard maps gloo to the CPU and NCCL refuses two ranks per
# device), so multi-rank CUDA paths still need a machine with two GPUs.
#
#     OUT=/some/dir BUDGET_S=560 bash bench/gpu/device_check.sh
set -u
OUT=${OUT:-$PWD/gpu_check_out}
BUDGET_S=${BUDGET_S:-560}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
left() { echo $(( BUDGET_S - SECONDS )); }
part() {  # part SECONDS LOG CMD...: run CMD for at most min(SECONDS, what is left - 5)
  local want=$1 log=$2; shift 2
  local t; t=$(left); t=$(( t - 5 < want ? t - 5 : want ))
  if (( t < 15 )); then echo "[device_check] skipped (budget spent): $*" | tee -a "$log"; return; fi
  echo "[device_check] $(date +%T) up to ${t}s: $*" | tee -a "$log"
  timeout -k 5 "$t" "$@" >>"$log" 2>&1
  local rc=$?
  echo "[device_check] $(date +%T) exit $rc: $*" | tee -a "$log"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  nproc; free -g | head -2; df -h "$PWD" /tmp | cat; findmnt -T "$PWD" | cat
} >"$OUT/env_io.log" 2>&1

NVME_DIR=${ZS_BENCH_NVME_PATH:-$PWD/.nvme_scratch}
mkdir -p "$NVME_DIR"
export ZS_BENCH_NVME_PATH=$NVME_DIR

# every test, not -x: one failure must not hide the others
part 110 "$OUT/tests.log" $PY -m pytest -q -rs -p no:cacheprovider --tb=short tests/gpu
part 330 "$OUT/bench_stdout.log" $PY bench/gpu/run.py \
  --rows ${GPU_ROWS:-zs3 zs3_lean fsdp2 zs2 zs2_fp8 zs2_fp8_rowwise zs3_compile zs2_offload zs2_offload_delayed} \
  --spec '{"steps": 6, "warmup": 2}' --out-dir /tmp/gb_1b --results "$OUT/bench_gpu.md" --timeout-s 90
cp /tmp/gb_1b/results.json "$OUT/bench_gpu.json" 2>/dev/null
if $PY -c "import deepspeed" >/dev/null 2>&1; then
  export ZS_DS_TORCH_ADAM=1
  part 80 "$OUT/bench_stdout.log" $PY bench/gpu/run.py --rows ds2 ds3 \
    --spec '{"steps": 6, "warmup": 2}' --out-dir /tmp/gb_ds --results "$OUT/bench_ds.md" --timeout-s 75
  cp /tmp/gb_ds/results.json "$OUT/bench_ds.json" 2>/dev/null
  unset ZS_DS_TORCH_ADAM
else
  echo "[device_check] DeepSpeed not importable: its rows skipped (carry its wheel, bench/gpu/README.md)" | tee -a "$OUT/bench_stdout.log"
fi
part 60 "$OUT/bench_stdout.log" $PY bench/gpu/run.py --rows zs2_offload zs2_nvme zs3_offload_opt zs3_nvme \
  --spec '{"model": "25m", "steps": 8, "warmup": 3}' --out-dir /tmp/gb_nvme --results "$OUT/bench_nvme.md" --timeout-s 40
cp /tmp/gb_nvme/results.json "$OUT/bench_nvme.json" 2>/dev/null
{
  echo "== dd O_DIRECT, 1 GiB, 1 MiB blocks, on $NVME_DIR"
  timeout 40 dd if=/dev/zero of="$NVME_DIR/dd.bin" bs=1M count=1024 oflag=direct 2>&1 | tail -1
  timeout 40 dd if="$NVME_DIR/dd.bin" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1
  rm -f "$NVME_DIR/dd.bin"
} >>"$OUT/env_io.log" 2>&1
part 60 "$OUT/env_io.log" $PY -m zeroshard.cli.main bench-io "$NVME_DIR" --block-sizes 1m,4m --queue-depths 8 \
  --thread-counts 1,2 --file-size 1g
part 60 "$OUT/tests.log" $PY -m torch.distributed.run --standalone --nproc-per-node=1 -m pytest -q -rs --tb=short -p no:cacheprovider tests/gpu
rm -rf "$NVME_DIR"
echo "[device_check] done in ${SECONDS}s"
