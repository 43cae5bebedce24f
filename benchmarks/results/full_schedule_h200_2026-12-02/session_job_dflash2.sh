#!/usr/bin/env bash
# This session's GPU burst (issue 19's final table): DFlash2 joint with the whole published schedule (6 epochs at 16
# per step), exported and checked, then its grid beside prompt lookup (7 benches x T=0,1 x block 16,8).
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/root/res; mkdir -p $R
log(){ echo "[$(date +%T)] $*"; }
log dflash2
W=/root/acc; mkdir -p $W
gunzip -c benchmarks/results/acceptance_h200/smollm2_regenerated{,_part2,_part3,_part4}.jsonl.gz > $W/smollm2.jsonl
touch $W/regenerate.done
DRAFTERS=dflash2 UNTIL=train bash benchmarks/acceptance.sh $W > $R/acceptance_train.log 2>&1
log "dflash2 train rc=$?"
DRAFTERS=dflash2 UNTIL=grid bash benchmarks/acceptance.sh $W > $R/acceptance_grid.log 2>&1
log "grid rc=$?"
