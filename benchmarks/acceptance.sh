#!/usr/bin/env bash
# The acceptance proof on one machine with 1 or 2 GPUs (BENCHMARKS.md, "Acceptance"):
#   regenerate ShareGPT with SmolLM2 -> train DFlash, DFlash2 (joint) and DFlash2 warm-started from the DFlash
#   export (conv + selector only), the same data and schedule -> export + check each -> evaluate the grid
#   (7 benches x T=0,1 x block 16,8 x 3 drafters and prompt lookup, the training-free baseline; 100 prompts each,
#   all 80 of MT-Bench) -> time the T=0 block-16 gsm8k cell of each alone on the GPU, beside the target decoding
#   alone (medians of 3 passes each) -> WORK_DIR/acceptance_vs_pld.json (benchmarks/acceptance_vs_pld.py).
#
#   bash benchmarks/acceptance.sh WORK_DIR            # e.g. ~/acceptance; rerun to resume
#
# Env: STEPS (optimizer steps per drafter; unset = the experiment's whole schedule, 6 epochs, whose cosine then spans
# them; set, the cosine spans STEPS), BUDGET (minutes: each drafter's training stops there, trainer.max_time, its
# validations included; size STEPS to it from a measured step rate so that the cosine ends in time), VAL (validate every VAL steps; unset = the experiment's 4 times an epoch), LIMIT
# (ShareGPT conversations to regenerate, 2800: STEPS x data.batch_size rows plus the 256 held out for validation, with
# room for skips), JOBS (processes sharing the GPUs while the grid runs, 6: one evaluation is bound by its Python loop
# and leaves a GPU mostly idle), SETTINGS (the grid's settings, ';'-separated, default all four of T=0,1 x block
# 16,8), BENCHES (the grid's benches in ';'-separated groups, one sweep each, default
# gsm8k,humaneval,math500,sharegpt;mbpp,mtbench,alpaca), DRAFTERS (the drafters trained, swept and timed, default
# dflash,dflash2,dflash2_warm; the warm start trains dflash too, its init), CHECK_ONLY=1 (tiny sizes for a CPU
# rehearsal of the plumbing), EXTRA_DATA (chat files trained on besides the regenerated ShareGPT, ','-separated, e.g.
# the regenerated replies to `python -m dflash2.data.sources` prompts; validation stays ShareGPT's; unset = the
# experiment's, the math and CodeI/O replies kept in artifacts/data/; none = ShareGPT alone), TRAIN_ARGS (more
# train.py overrides for every drafter, space-separated, e.g. objective.position_weights=decay), DFLASH_EXPORT (a
# DFlash export the warm start loads instead of training DFlash here, e.g. the one kept in
# artifacts/drafters/smollm2-dflash; `export.py check` runs on it before anything else),
# PLD=0 (the grid without prompt lookup's sweeps, which are measured once for every drafter: at T=0 the greedy text
# fixes them), FROM (earlier grids' summary.csv files or work folders, ','-separated, whose rows and training logs
# fill the proposers this grid did not measure in acceptance_vs_pld.json, e.g. prompt lookup's with PLD=0),
# FEATURES=fp8|bf16 (write the target's features of the training data once, a `features` stage, and train every
# drafter from them, the target's layers never running in training; fp8 takes 1,160 bytes a position, 28.4 GB for
# the ShareGPT set alone), UNTIL=<stage> (stop after that stage: regenerate, features, train, grid, speed; stopped
# after the grid or later, it still writes the summaries and JSON).
# Each finished stage leaves WORK_DIR/<stage>.done, so a rerun skips it; the regeneration, the trained drafters and
# the finished evaluations are kept within a stage too. Tokens/s of the grid are measured with JOBS runs sharing the
# GPUs; the speed stage measures them alone.
# To start from the whole set regenerated on 2026-12-01 (artifacts/README.md: 16,211 conversations, every complete one
# of the packaged ShareGPT outside the sharegpt benchmark's records, in four files) instead of regenerating it:
#   mkdir -p WORK_DIR && gunzip -c artifacts/data/smollm2_sharegpt_regenerated{,_part2,_part3,_part4}.jsonl.gz \
#     > WORK_DIR/smollm2.jsonl && touch WORK_DIR/regenerate.done
# The experiment trains on the 7,413 math and CodeI/O replies of artifacts/data/ besides (BENCHMARKS.md, "Training data
# at one budget": they lift the math and code benches by 0.24-1.41 tau and cost the chat benches 0.06-0.33).
# Each bench's prompts load before anything else starts: without PyPI, copy ~/.cache/dflash2/bench in first.
# Regenerate before training, never beside it: on one H200 the two trainings and a batch-512 regeneration do not fit.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
W=$(realpath -m "${1:?usage: bash benchmarks/acceptance.sh WORK_DIR}")
STEPS=${STEPS:-} VAL=${VAL:-} LIMIT=${LIMIT:-2800} JOBS=${JOBS:-6}
GPUS=$(python -c "import torch; print(min(2, max(1, torch.cuda.device_count())))")
DATA=$W/smollm2.jsonl
mkdir -p "$W" && rm -f "$W/failed"
regen_args=(model.dtype=bfloat16 cache_implementation=static batch_size=512)
DRAFTERS=${DRAFTERS:-dflash,dflash2,dflash2_warm}
train_args=(experiment=gpu_smollm2 logger=csv trainer.enable_progress_bar=false)
if extra=$(extra_data_arg) && [ -n "$extra" ]; then train_args+=("$extra"); fi
if [ -n "${TRAIN_ARGS:-}" ]; then read -ra more <<< "$TRAIN_ARGS" && train_args+=("${more[@]}"); fi
eval_args=(bench.limit=100 batch_size=100 wandb.enabled=false)
if [ -n "${CHECK_ONLY:-}" ]; then
  regen_args=(max_new_tokens=8 batch_size=8) STEPS=4 VAL=2 LIMIT=${LIMIT_CHECK:-48}
  train_args+=(trainer=cpu model.dtype=float32 data.max_length=256 data.max_anchors=8
    data.val_size=8 data.num_workers=0 data.batch_size=4 draft.num_hidden_layers=1)
  eval_args=(bench.limit=2 batch_size=2 wandb.enabled=false max_new_tokens=8 device=cpu)
fi
log() { echo "[$(date +%T)] $*"; }
stage() { [ -f "$W/$1.done" ] && log "$1: done before" && return 1; log "$1"; return 0; }
report() {  # the summaries and acceptance_vs_pld.json from what the grid (and the speed stage) measured
  local d
  for d in sweeps speed; do
    [ -d "$W/$d" ] || continue
    python -c "from dflash2.evaluation.sweep import format_summary as f, summarize_sweep as s; print(f(s('$W/$d')))" \
      > "$W/$d/summary.txt"
  done
  # shellcheck disable=SC2046  # one word per file
  python benchmarks/acceptance_vs_pld.py "$W" --drafters "$DRAFTERS" $([ -z "${FROM:-}" ] || echo --from ${FROM//,/ })
  python benchmarks/copy_gap.py "$W/sweeps" --out "$W/copy_gap.json" > "$W/copy_gap.txt"
  log "summaries: $W/sweeps/summary.csv, $W/speed/summary.csv, $W/acceptance_vs_pld.json, $W/copy_gap.json"
}
done_() {  # a stage is finished; stop here when UNTIL names it, with the report once the grid has run
  touch "$W/$1.done"
  log "$1: done"
  if [ "$1" = "${UNTIL:-}" ]; then
    if [ -f "$W/grid.done" ]; then report; fi
    exit 0
  fi
}
on() { CUDA_VISIBLE_DEVICES=$(($1 % GPUS)) OMP_NUM_THREADS=2 "${@:2}"; }
slot=0
spawn() {  # run a command in the background once fewer than JOBS are running, on the GPUs in turn
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  slot=$((slot + 1))  # here: an expansion on the backgrounded line would happen in its subshell
  "$1" "$2" $((slot - 1)) "${@:3}" &
}
wanted() { [[ ",$DRAFTERS," == *",$1,"* ]]; }
fail() { log "FAILED $*"; touch "$W/failed"; return 1; }
finish() {  # wait for every background job; fail if any did
  wait
  if [ -f "$W/failed" ]; then rm "$W/failed"; exit 1; fi
}

regenerate() {
  local i pids=()
  for ((i = 0; i < GPUS; i++)); do
    on $i python -m dflash2.data.regenerate "${regen_args[@]}" limit="$LIMIT" num_shards=$GPUS shard_index=$i \
      output="$W/regen/smollm2.$i.jsonl" > "$W/regen.$i.log" 2>&1 & pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i"; done
  cat "$W"/regen/smollm2.*.jsonl > "$DATA.tmp" && mv "$DATA.tmp" "$DATA"
  log "regenerated: $(wc -l < "$DATA") conversations"
}

schedule=()  # the experiment's own epochs and validations unless STEPS / VAL ask for others
if [ -n "$STEPS" ]; then schedule+=(trainer.max_steps="$STEPS" trainer.max_epochs=1000); fi
if [ -n "$VAL" ]; then schedule+=(trainer.val_check_interval="$VAL"); fi
if [ -n "${BUDGET:-}" ]; then schedule+=(trainer.max_time="00:$(printf '%02d:%02d' $((BUDGET / 60)) $((BUDGET % 60))):00"); fi
train() {  # train NAME GPU OVERRIDES...: train, export and check; a drafter already checked is kept
  [ -f "$W/exports/$1.checked" ] && return 0
  if ! { on "$2" python train.py "${train_args[@]}" data.path="$DATA" run_dir="$W/runs/$1" task_name="acceptance_$1" \
      "${schedule[@]}" data.cache_dir="$W/data_cache/$1" ${FEATURES:+data.features="$W/features"} "${@:3}" \
      > "$W/train.$1.log" 2>&1 &&
    export_checked "$W/runs/$1" "$W/exports/$1" "$W/export.$1.log"; }; then
    fail "to train $1: see $W/train.$1.log and $W/export.$1.log"
    return 1
  fi
  touch "$W/exports/$1.checked"
  log "trained, exported and checked $1"
}

sweep() {  # sweep NAME GPU DRAFTS OVERRIDES...: one Hydra multirun under DIR (sweeps/ unless SWEEPS is set)
  local drafts
  drafts=$(for d in ${3//,/ }; do if [ "$d" = pld ]; then printf 'pld,'; else printf '%s,' "$W/exports/$d"; fi; done)
  if ! on "$2" python evaluate.py -m hydra.sweep.dir="$W/${SWEEPS:-sweeps}/$1" drafter="${drafts%,}" \
      "${eval_args[@]}" "${@:4}" > "$W/sweep.$1.log" 2>&1; then
    fail "sweep $1: see $W/sweep.$1.log"
    return 1
  fi
  log "swept $1"
}

# The grid in order of priority, two groups of benches per setting, so that up to JOBS runs share the GPUs.
IFS=';' read -ra SETTINGS <<< "${SETTINGS:-temperature=0 block_size=16;temperature=1 block_size=16;\
temperature=0 block_size=8;temperature=1 block_size=8}"
IFS=";" read -ra BENCHES <<< "${BENCHES:-gsm8k,humaneval,math500,sharegpt;mbpp,mtbench,alpaca}"
grid() {  # grid DRAFT: spawn its sweeps, one per setting and group of benches
  local s h
  for s in "${SETTINGS[@]}"; do
    for h in "${BENCHES[@]}"; do
      # shellcheck disable=SC2086  # each setting is two overrides
      spawn sweep "$1_$(tr -d ' =_' <<< "$s" | sed 's/temperature/t/; s/blocksize/b/')_${h%%,*}" "$1" $s bench=$h
    done
  done
}

check_benches "${BENCHES[*]}" || { log "FAILED: a benchmark's prompts do not load (above)"; exit 1; }
if [ -n "${DFLASH_EXPORT:-}" ] && [ ! -f "$W/exports/dflash.checked" ]; then  # checked now, before hours of work
  mkdir -p "$W/exports" && rm -rf "$W/exports/dflash" && cp -r "$DFLASH_EXPORT" "$W/exports/dflash" &&
    python export.py check="$W/exports/dflash" > "$W/export.dflash.log" 2>&1 && touch "$W/exports/dflash.checked" ||
    { log "FAILED: DFLASH_EXPORT=$DFLASH_EXPORT does not pass export.py check (see $W/export.dflash.log)"; exit 1; }
fi
if stage regenerate; then regenerate; done_ regenerate; fi
FEATURES=${FEATURES:-}
if [ -n "$FEATURES" ] && stage features; then  # the drafters all read the experiment's layers: one cache serves them
  python -m dflash2.data.features "${train_args[@]}" data.path="$DATA" output="$W/features" dtype="$FEATURES" \
    > "$W/features.log" 2>&1 || { log "FAILED to write the features: see $W/features.log"; exit 1; }
  done_ features
fi
if stage train; then
  # Two trainings share a GPU well: each alone leaves it mostly idle (BENCHMARKS.md, training throughput).
  # The warm start follows DFlash on its GPU; beside the grid's evaluations it trained 4 times slower.
  if wanted dflash2; then spawn train dflash2; fi
  if { wanted dflash || wanted dflash2_warm; } && train dflash 1 draft=dflash && wanted dflash2_warm; then
    spawn train dflash2_warm module.init_from="$W/exports/dflash" module.train_backbone=false
  fi
  finish
  done_ train
fi
if stage grid; then
  for d in ${DRAFTERS//,/ } $([ "${PLD:-1}" = 0 ] || echo pld); do grid "$d"; done
  finish
  done_ grid
fi
if stage speed; then
  JOBS=1 SWEEPS=speed sweep gsm8k 0 "$DRAFTERS,pld" temperature=0 block_size=16 bench=gsm8k baseline=true \
    repeats=3
  done_ speed
fi
report
