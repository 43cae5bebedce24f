#!/usr/bin/env bash
# The training-speed proof on one GPU (BENCHMARKS.md, "Training throughput"):
#   1. the GPU tests (the fast path against the plain PyTorch path on CUDA, loss and gradients; the Triton kernels),
#      while the plain and the fast path each train STEPS steps on the regenerated ShareGPT set beside them: only
#      their validation tau_sim at equal steps is used, so sharing the GPU costs nothing that is reported (the fast
#      run also fills the compile cache that parts 2 and 3 then read);
#   2. alone on the GPU: step time, tokens/s, MFU, peak memory, compile time and a profile of the SmolLM2 preset,
#      fast DFlash2 and DFlash, plain DFlash2, and fast DFlash2 with the target eager (model.compile=false) and with
#      the target's layers replayed as CUDA graphs (model.compile=reduce-overhead);
#   3. one epoch of the regenerated set with the fast path, alone: its wall time and validation curve.
#
#   bash benchmarks/train_speed.sh OUT_DIR        # JSON, logs and the CSV curves land in OUT_DIR
#
# Env: STEPS (400), VAL (validate every VAL steps, 200), PARTS (which of equal,throughput,epoch to run; all by default),
# EPOCH_OVERRIDES (train.py overrides of the epoch part, space-separated, e.g. "data.batch_size=16").
set -eu  # no pipefail: a failing test must not stop the measurements after it (its log says so)
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:?usage: bash benchmarks/train_speed.sh OUT_DIR}")
STEPS=${STEPS:-400} VAL=${VAL:-200}
W=$OUT/work
mkdir -p "$W"
log() { echo "[$(date +%T)] $*"; }
train() {  # train NAME overrides...: experiment=gpu_smollm2 on the regenerated set; its log (recompiles included)
  local name=$1
  shift
  TORCH_LOGS=recompiles python train.py experiment=gpu_smollm2 data.path="$W/smollm2.jsonl" data.extra_paths=[] logger=csv \
    trainer.enable_progress_bar=false run_dir="$W/runs/$name" data.cache_dir="$W/cache_$name" "$@" > "$W/train_$name.log" 2>&1
  find "$W/runs/$name" -name metrics.csv -exec cp {} "$OUT/curve_$name.csv" \;
  cp "$W/runs/$name/train.log" "$OUT/train_$name.log" 2>/dev/null || true
}
[ -f "$W/smollm2.jsonl" ] || gunzip -c artifacts/data/smollm2_sharegpt_regenerated{,_part2,_part3,_part4}.jsonl.gz \
  > "$W/smollm2.jsonl"
equal=(trainer.max_steps="$STEPS" trainer.val_check_interval="$VAL")
PARTS=",${PARTS:-equal,throughput,epoch},"
part() { [[ $PARTS == *",$1,"* ]]; }

if part equal; then
  log "GPU tests, and beside them the plain and the fast path for $STEPS steps each"
  train plain "${equal[@]}" module.compile=false objective.fused_head=false model.compile=false &
  plain=$!
  train fast "${equal[@]}" &
  fast=$!
  python -m pytest -q -p no:warnings tests/test_kernels.py tests/test_training.py tests/test_speculative.py \
    tests/test_target.py -k "triton or walk or conv or cuda or mixed" 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
  wait "$plain" || log "the plain run failed: $W/train_plain.log"
  wait "$fast" || log "the fast run failed: $W/train_fast.log"
  for name in plain fast; do tail -4 "$W/train_$name.log"; done
fi

if part throughput; then
  log "throughput"
  python benchmarks/train_throughput.py --preset smollm2 --drafter dflash2 dflash --variant fast --profile \
    --out "$OUT/train_throughput_smollm2.json" 2>&1 | tail -4
  python benchmarks/train_throughput.py --preset smollm2 --drafter dflash2 --variant plain --profile \
    --out "$OUT/train_throughput_smollm2_plain.json" 2>&1 | tail -3
  python benchmarks/train_throughput.py --preset smollm2 --drafter dflash2 --variant fast --override model.compile=false \
    --out "$OUT/train_throughput_smollm2_eager_target.json" 2>&1 | tail -3
  python benchmarks/train_throughput.py --preset smollm2 --drafter dflash2 --variant fast --profile \
    --override model.compile=reduce-overhead --out "$OUT/train_throughput_smollm2_graphed_target.json" 2>&1 | tail -3
fi

if part epoch; then
  log "one epoch with the fast path"
  start=$(date +%s)
  # shellcheck disable=SC2086  # one word per override
  train epoch trainer.max_epochs=1 ${EPOCH_OVERRIDES:-}
  echo "{\"epoch_wall_s\": $(( $(date +%s) - start ))}" > "$OUT/epoch_wall.json"
  tail -4 "$W/train_epoch.log"
fi
log "done"
