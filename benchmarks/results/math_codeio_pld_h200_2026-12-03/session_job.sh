#!/usr/bin/env bash
# This session's GPU burst (issue 19), after staging: answer the 7,413 math/CodeI/O prompts with SmolLM2 (training
# data for the next DFlash2 run) and, beside it, prompt lookup's missing grid rows (T=1 block 16, T=0 block 8, T=1
# block 8; seven benches). The prompts come from `python -m dflash2.data.sources output=.relay/prompts/math_codeio.jsonl`
# (gzipped to travel) and the benches' files from a bench cache filled here (`DFLASH2_CACHE=$PWD/.benchcache`), both
# carried in the call that launched this script. The cache is copied out of the checkout first: a later call that does
# not carry a folder removes it there, and the first launch of the sweeps lost it that way after two runs; they were
# relaunched from the copy with the same sweep folders, which kept the two finished runs.
set -u
mkdir -p /root/w && cp -r .benchcache /root/w/
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH2_CACHE=/root/w/.benchcache
R=/root/res; mkdir -p $R /root/regen
log(){ echo "[$(date +%T)] $*"; }
gunzip -kf .relay/prompts/math_codeio.jsonl.gz
log start
python -m dflash2.data.regenerate input=.relay/prompts/math_codeio.jsonl output=/root/regen/math_codeio.jsonl \
  model.dtype=bfloat16 cache_implementation=static batch_size=512 > $R/regen.log 2>&1 &
rp=$!
B=gsm8k,humaneval,math500,mbpp,mtbench,alpaca,sharegpt
for s in "1 16" "0 8" "1 8"; do
  set -- $s
  OMP_NUM_THREADS=2 python evaluate.py -m hydra.sweep.dir=/root/pld/t$1b$2 draft.path=pld bench=$B temperature=$1 \
    block_size=$2 bench.limit=100 batch_size=100 wandb.enabled=false > $R/pld_t$1b$2.log 2>&1 &
done
wait $(jobs -p | grep -v "^$rp$"); log "pld done"
wait $rp; log "regen rc=$?"
