#!/usr/bin/env bash
# The training-speed proof on one GPU (BENCHMARKS.md, "Training throughput"):
#   1. the fast path against the plain PyTorch path on CUDA (loss and gradients), and the Triton kernels;
#   2. step time, tokens/s, MFU, peak memory and a profile of both paths, DFlash and DFlash2, both presets;
#   3. the same DFlash2 training (STEPS optimizer steps on the regenerated ShareGPT set) with each path, for the
#      validation tau_sim at equal steps, and the wall time of an epoch of real data.
#
#   bash benchmarks/train_speed.sh OUT_DIR        # JSON, logs and the CSV curves land in OUT_DIR
#
# Env: STEPS (400), VAL (validate every VAL steps, 200), UNTIL=tests|throughput (stop after that part).
set -eu  # no pipefail: a failing test must not stop the measurements after it (its log says so)
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:?usage: bash benchmarks/train_speed.sh OUT_DIR}")
STEPS=${STEPS:-400} VAL=${VAL:-200}
W=$OUT/work
mkdir -p "$W"
log() { echo "[$(date +%T)] $*"; }

log "GPU tests"
python -m pytest -q -p no:warnings tests/test_kernels.py tests/test_training.py tests/test_speculative.py \
  -k "triton or walk or conv or cuda or mixed" 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
if [ "${UNTIL:-}" = tests ]; then exit 0; fi

log "throughput"
python benchmarks/train_throughput.py --preset smollm2 --drafter dflash2 dflash --variant fast plain --profile \
  --out "$OUT/train_throughput_smollm2.json" 2>&1 | tail -6
python benchmarks/train_throughput.py --preset qwen3-8b --drafter dflash2 --variant fast plain --profile \
  --out "$OUT/train_throughput_qwen3.json" 2>&1 | tail -4
if [ "${UNTIL:-}" = throughput ]; then exit 0; fi

log "equal steps, fast and plain"
[ -f "$W/smollm2.jsonl" ] || gunzip -c benchmarks/results/acceptance_h200/smollm2_regenerated{,_part2,_part3,_part4}.jsonl.gz \
  > "$W/smollm2.jsonl"
for path in fast plain; do  # one after the other: each run's step times are then its own
  flags=(draft.compile=true draft.fused_head=true)
  if [ "$path" = plain ]; then flags=(draft.compile=false draft.fused_head=false); fi
  python train.py experiment=gpu_smollm2 data.path="$W/smollm2.jsonl" logger=csv trainer.enable_progress_bar=false \
    trainer.max_steps="$STEPS" trainer.val_check_interval="$VAL" run_dir="$W/runs/$path" \
    data.cache_dir="$W/cache" "${flags[@]}" > "$W/train_$path.log" 2>&1
done
for path in fast plain; do
  tail -4 "$W/train_$path.log"
  cp "$W/runs/$path"/csv/*/metrics.csv "$OUT/equal_steps_$path.csv" 2>/dev/null ||
    find "$W/runs/$path" -name metrics.csv -exec cp {} "$OUT/equal_steps_$path.csv" \;
done
log "done"
