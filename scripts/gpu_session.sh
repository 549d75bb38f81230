#!/usr/bin/env bash
# Checks to run through the device tool, stage by stage, each writing its log to $OUT:
#   bash scripts/gpu_session.sh debug train fault evaluate     (~5 min on nvidia-h200-x2)
#   bash scripts/gpu_session.sh bench                          (~6 min)
#   bash scripts/gpu_session.sh drafter                        (scripts/gpu_drafter_check.py, ~5 min)
# carry: [".whl"] (hydra-core, omegaconf, antlr4 wheels; README, Development).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
NPROC=$(( GPUS < 2 ? 2 : GPUS ))
echo "torch $(python3 -c 'import torch; print(torch.__version__)'), $GPUS GPUs"
TRAIN="python3 -m torch.distributed.run --standalone --nproc-per-node $NPROC -m launcher.train topology=auto
  data.fixed_length=256 optim.lr=2e-3 run.progress=false"

stage() {  # name, command...: run with a wall clock, keep the log, print its tail
  local name=$1; shift
  local start=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - start ))s"
  grep -v "^W1130" "$OUT/$name.log" | grep -E "ERROR|first step|warm-up|steps [0-9]|lossless|mean tau|done|PASS|FAIL|^ *[0-9] +[a-z]" | tail -15
}

for s in "$@"; do case $s in
  debug) stage debug timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node $NPROC \
           scripts/gpu_debug_init.py --timeout 60 ;;
  train) stage train timeout 300 $TRAIN run.dir=/tmp/g train.steps=200 train.eval_every=100
         cp /tmp/g/summary.json "$OUT/train_summary.json" 2>/dev/null ;;
  fault) stage fault timeout 120 $TRAIN run.dir=/tmp/f train.steps=200 fault.rank=0 fault.step=3 fault.kind=raise ;;
  evaluate) stage evaluate timeout 120 python3 -m launcher.evaluate evaluate.drafter=/tmp/g/export \
              evaluate.output="$OUT/evaluate.json" ;;
  bench) stage bench timeout 580 python3 -m launcher.bench --out "$OUT/bench.json" ;;
  drafter) stage drafter timeout 580 python3 scripts/gpu_drafter_check.py --parts c --benchmark-backends flex ;;
  *) echo "unknown stage $s" ;;
esac; done
