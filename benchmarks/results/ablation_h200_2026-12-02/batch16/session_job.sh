#!/usr/bin/env bash
# This session's GPU burst: speed (top-K, profiles at 4 and 16 conversations, 32 step time), the batch-16 ablation at
# 10,000 conversations, one epoch at 16 per step alone, then that epoch's drafter on the seven benches.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/root/res; mkdir -p $R
log(){ echo "[$(date +%T)] $*"; }
log speed
python benchmarks/topk.py --out $R/topk.json > $R/topk.log 2>&1; tail -6 $R/topk.log
for b in 16 4; do
  python benchmarks/train_throughput.py --preset smollm2 --drafter dflash2 --variant fast --profile --steps 4 --warmup 2 \
    --override data.batch_size=$b --out $R/throughput_batch$b.json > $R/tp$b.log 2>&1; tail -3 $R/tp$b.log
done
python benchmarks/train_throughput.py --preset smollm2 --drafter dflash2 --variant fast --steps 3 --warmup 2 \
  --override data.batch_size=32 --out $R/throughput_batch32.json > $R/tp32.log 2>&1; tail -3 $R/tp32.log
log ablation
VARIANTS=batch16,batch16_lr2x STEPS=2500 VAL=500 JOBS=3 bash benchmarks/ablation.sh /root/abl > $R/ablation.log 2>&1
log "ablation rc=$?"
log epoch
PARTS=epoch EPOCH_OVERRIDES="data.batch_size=16" bash benchmarks/train_speed.sh /root/epoch > $R/epoch.log 2>&1
log "epoch rc=$?"
source benchmarks/lib.sh
run=$(dirname "$(find /root/epoch/work/runs/epoch -name last.ckpt | head -1)")/..
export_checked "$run" /root/epoch/export /root/epoch/export.log && log exported &&
  python evaluate.py -m hydra.sweep.dir=/root/epoch/sweep draft.path=/root/epoch/export \
  bench=gsm8k,humaneval,math500,mbpp,mtbench,alpaca,sharegpt temperature=0 block_size=16 bench.limit=100 \
  batch_size=100 wandb.enabled=false > $R/epoch_eval.log 2>&1
log "all done"
