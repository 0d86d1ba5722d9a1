#!/usr/bin/env bash
# One pass over everything that needs a GPU, sized for a short lease on a one-GPU machine:
#   1. tests/gpu at world size 1;
#   2. the NVMe rows of bench/gpu (25M GPT: NVMe against CPU optimizer offload, stages 2 and 3);
#   3. bench/gpu on the ~1.2B GPT (zeroshard stages 2-3, stage 3 with FSDP2's lifetimes (zs3_lean,
#      bench/fsdp_memory.md) and offload against FSDP2: tokens/s and peak allocated memory);
#   4. the disk the swap files live on: dd with O_DIRECT against `zeroshard bench-io`;
#   5. tests/gpu again under torchrun (an NCCL process group of one).
# Each part gets what is left of a global budget (BUDGET_S, default 450 s), in that order, and
# writes its log under OUT (default ./gpu_check_out): a part cut short still leaves its log.
#
#     OUT=/some/dir BUDGET_S=540 bash bench/gpu/device_check.sh
set -u
OUT=${OUT:-$PWD/gpu_check_out}
BUDGET_S=${BUDGET_S:-450}
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
part 150 "$OUT/tests.log" $PY -m pytest -q -rs -p no:cacheprovider --tb=short tests/gpu
part 110 "$OUT/bench_stdout.log" $PY bench/gpu/run.py --rows zs2_offload zs2_nvme zs3_offload_opt zs3_nvme \
  --spec '{"model": "25m", "steps": 8, "warmup": 3}' --out-dir /tmp/gb_nvme --results "$OUT/bench_nvme.md" --timeout-s 60
cp /tmp/gb_nvme/results.json "$OUT/bench_nvme.json" 2>/dev/null
part 180 "$OUT/bench_stdout.log" $PY bench/gpu/run.py --rows ${GPU_ROWS:-zs3 zs3_lean fsdp2 zs2 zs3_offload} \
  --spec '{"steps": 6, "warmup": 2}' --out-dir /tmp/gb_1b --results "$OUT/bench_gpu.md" --timeout-s 100
cp /tmp/gb_1b/results.json "$OUT/bench_gpu.json" 2>/dev/null
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
