#!/usr/bin/env bash
# One NCCL training run of the embedded default on every GPU, logs and summary to $OUT.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
start=$(date +%s)
python3 -m torch.distributed.run --standalone --nproc-per-node "$(python3 -c 'import torch; print(max(2, torch.cuda.device_count()))')" \
  -m launcher.train topology=auto run.dir=/tmp/g train.steps=${STEPS:-60} train.eval_every=0 run.timeout_s=900 \
  data.fixed_length=256 optim.lr=2e-3 run.progress=false "$@" > $OUT/train.log 2>&1
echo "exit $? after $(( $(date +%s) - start ))s"
cp /tmp/g/summary.json $OUT/ 2>/dev/null; for f in /tmp/g/logs/*.log; do cp "$f" $OUT/; done
grep -E "first step|run summary|steps [0-9]|ERROR" -A0 $OUT/*.log | tail -20
