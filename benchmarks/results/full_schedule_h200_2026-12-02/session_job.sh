#!/usr/bin/env bash
# This session's GPU burst: flex attention's kernel options and the 16-per-step profile with host phases (issue 18),
# then DFlash with the whole published schedule (6 epochs at 16 per step; issue 19's final table), exported and checked.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/root/res; mkdir -p $R
log(){ echo "[$(date +%T)] $*"; }
log attention
python benchmarks/draft_attention.py --out $R/draft_attention.json > $R/draft_attention.log 2>&1; tail -12 $R/draft_attention.log
log throughput
python benchmarks/train_throughput.py --preset smollm2 --drafter dflash2 --variant fast --profile --steps 4 --warmup 2 \
  --out $R/throughput_batch16.json > $R/tp16.log 2>&1; tail -4 $R/tp16.log
log dflash
W=/root/acc; mkdir -p $W
gunzip -c benchmarks/results/acceptance_h200/smollm2_regenerated{,_part2,_part3,_part4}.jsonl.gz > $W/smollm2.jsonl
touch $W/regenerate.done
DRAFTERS=dflash UNTIL=train bash benchmarks/acceptance.sh $W > $R/acceptance.log 2>&1
log "dflash rc=$?"
