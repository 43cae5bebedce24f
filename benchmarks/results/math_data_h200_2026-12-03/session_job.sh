#!/usr/bin/env bash
# This session's GPU burst (issue 19, item 3): DFlash2 joint trained on the regenerated ShareGPT set plus the 7,413
# regenerated math and CodeI/O prompts, at the steps of the 6-epoch ShareGPT-only run (5,982 of 16, cosine over them),
# exported and checked, then its T=0 block-16 grid beside prompt lookup (seven benches). It runs from a copy of the
# checkout, so that the next calls' fresh copies do not touch the scripts bash is reading; the bench cache travelled
# with the launching call as .benchcache.
set -u
mkdir -p /root/w && cp -r .benchcache /root/w/ && rm -rf /root/repo && mkdir /root/repo &&
  tar --exclude=./.gpu --exclude=./.benchcache -cf - . | tar -xf - -C /root/repo && cd /root/repo
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH2_CACHE=/root/w/.benchcache
R=/root/res; W=/root/acc; mkdir -p $R $W
log(){ echo "[$(date +%T)] $*"; }
gunzip -c benchmarks/results/acceptance_h200/smollm2_regenerated{,_part2,_part3,_part4}.jsonl.gz > $W/smollm2.jsonl
gunzip -c benchmarks/results/math_codeio_pld_h200_2026-12-03/math_codeio_regenerated.jsonl.gz > $W/math_codeio.jsonl
touch $W/regenerate.done
log train
EXTRA_DATA=$W/math_codeio.jsonl STEPS=5982 DRAFTERS=dflash2 UNTIL=train bash benchmarks/acceptance.sh $W \
  > $R/acceptance_train.log 2>&1
log "train rc=$?"
EXTRA_DATA=$W/math_codeio.jsonl STEPS=5982 DRAFTERS=dflash2 UNTIL=grid SETTINGS="temperature=0 block_size=16" \
  bash benchmarks/acceptance.sh $W > $R/acceptance_grid.log 2>&1
log "grid rc=$?"
