#!/usr/bin/env bash
# The acceptance proof on one machine with 1 or 2 GPUs (BENCHMARKS.md, "Acceptance"):
#   regenerate ShareGPT with SmolLM2 -> train DFlash, DFlash2 (joint) and DFlash2 warm-started from the DFlash
#   export (conv + selector only), the same data and optimizer steps -> export + check each -> evaluate the grid
#   (6 benches x T=0,1 x block 16,8 x 3 drafters, 100 prompts each, all 80 of MT-Bench).
#
#   bash benchmarks/acceptance.sh WORK_DIR            # e.g. /root/acceptance; rerun to resume
#
# Env: STEPS (optimizer steps per drafter, 600), VAL (validate every VAL steps, 300), LIMIT (ShareGPT conversations
# to regenerate, 2800: STEPS x 4 rows plus the 256 held out for validation, with room for skips), CHECK_ONLY=1
# (tiny sizes for a CPU rehearsal of the plumbing), UNTIL=<stage> (stop after that stage: regenerate, train, warm,
# t0b16, rest). Each finished stage leaves WORK_DIR/<stage>.done, so a rerun skips it; the regeneration and the
# sweeps resume within a stage too. With 2 GPUs the stages pair up: the two regeneration shards, DFlash beside
# joint DFlash2, then the warm start beside the first evaluations.
# To start from the set regenerated on 2026-12-01 (BENCHMARKS.md) instead of regenerating it:
#   mkdir -p WORK_DIR && gunzip -c benchmarks/results/acceptance_h200/smollm2_regenerated.jsonl.gz \
#     > WORK_DIR/smollm2.jsonl && touch WORK_DIR/regenerate.done
set -euo pipefail
cd "$(dirname "$0")/.."
W=$(realpath -m "${1:?usage: bash benchmarks/acceptance.sh WORK_DIR}")
STEPS=${STEPS:-600} VAL=${VAL:-300} LIMIT=${LIMIT:-2800}
GPUS=$(python -c "import torch; print(min(2, max(1, torch.cuda.device_count())))")
DATA=$W/smollm2.jsonl
mkdir -p "$W"
regen_args=(model.dtype=bfloat16 cache_implementation=static batch_size=512)
train_args=(experiment=gpu_smollm2 logger=csv trainer.enable_progress_bar=false trainer.max_epochs=1000)
eval_args=(bench.limit=100 batch_size=100 wandb.enabled=false)
if [ -n "${CHECK_ONLY:-}" ]; then
  regen_args=(max_new_tokens=8 batch_size=8) STEPS=4 VAL=2 LIMIT=${LIMIT_CHECK:-48}
  train_args+=(trainer=cpu model.dtype=float32 data.max_length=256 data.anchor_seq_len=256 data.max_anchors=8
    data.val_size=8 data.num_workers=0 model.num_draft_layers=1)
  eval_args=(bench.limit=2 batch_size=2 wandb.enabled=false max_new_tokens=8 device=cpu)
fi
log() { echo "[$(date +%T)] $*"; }
stage() { [ -f "$W/$1.done" ] && log "$1: done before" && return 1; log "$1"; return 0; }
done_() { touch "$W/$1.done"; log "$1: done"; if [ "$1" = "${UNTIL:-}" ]; then exit 0; fi; }
on() { CUDA_VISIBLE_DEVICES=$(($1 % GPUS)) "${@:2}"; }

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

train() {  # train NAME GPU OVERRIDES...
  on "$2" python train.py "${train_args[@]}" data.path="$DATA" run_dir="$W/runs/$1" task_name="acceptance_$1" \
    trainer.max_steps="$STEPS" trainer.val_check_interval="$VAL" data.cache_dir="$W/data_cache/gpu$2" "${@:3}" \
    > "$W/train.$1.log" 2>&1
  python export.py ckpt_path="$W/runs/$1" output_dir="$W/exports/$1" max_shard_size=15MB overwrite=true \
    > "$W/export.$1.log" 2>&1
  python export.py check="$W/exports/$1" >> "$W/export.$1.log" 2>&1
  log "trained, exported and checked $1"
}

sweep() {  # sweep NAME GPU DRAFTS OVERRIDES...: one Hydra multirun per part of the grid, all under sweeps/
  local drafts
  drafts=$(for d in ${3//,/ }; do printf '%s,' "$W/exports/$d"; done)
  on "$2" python evaluate.py -m hydra.sweep.dir="$W/sweeps/$1" draft.path="${drafts%,}" "${eval_args[@]}" "${@:4}" \
    > "$W/sweep.$1.log" 2>&1
  log "swept $1"
}

both() {  # run two commands (strings) side by side, on GPU 0 and GPU 1 (one after the other with one GPU)
  if [ "$GPUS" -gt 1 ]; then
    eval "$1" & local a=$!
    eval "$2"
    wait $a
  else
    eval "$1"; eval "$2"
  fi
}

T0B16="temperature=0 block_size=16"
ALL="bench=gsm8k,humaneval,math500,mbpp,mtbench,alpaca"
if stage regenerate; then regenerate; done_ regenerate; fi
if stage train; then
  # With one GPU the two runs share it: each alone leaves it mostly idle (BENCHMARKS.md, training throughput).
  train dflash 0 draft=dflash & a=$!
  train dflash2 1
  wait $a
  done_ train
fi
if stage warm; then
  both "train dflash2_warm 0 draft.init_from=$W/exports/dflash draft.train_backbone=false" \
       "sweep 1_core 1 dflash,dflash2 $T0B16 bench=gsm8k,humaneval"
  done_ warm
fi
if stage t0b16; then
  both "sweep 2_core_warm 0 dflash2_warm $T0B16 $ALL" \
       "sweep 2_t0b16 1 dflash,dflash2 $T0B16 bench=math500,mbpp,mtbench,alpaca"
  done_ t0b16
fi
if stage rest; then
  both "sweep 3_t1b16 0 dflash,dflash2,dflash2_warm temperature=1 block_size=16 $ALL" \
       "sweep 3_t0b8 1 dflash,dflash2,dflash2_warm temperature=0 block_size=8 $ALL"
  both "sweep 4_t1b8 0 dflash,dflash2,dflash2_warm temperature=1 block_size=8 bench=gsm8k,humaneval,math500" \
       "sweep 4_t1b8b 1 dflash,dflash2,dflash2_warm temperature=1 block_size=8 bench=mbpp,mtbench,alpaca"
  done_ rest
fi
python -c "from dflash2.sweep import summarize_sweep as s; print(s('$W/sweeps').to_string(index=False))" \
  > "$W/summary.txt"
log "summary: $W/sweeps/summary.csv"
