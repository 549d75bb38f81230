#!/usr/bin/env bash
# GPU smoke run through the device tool: NCCL launcher end to end (flex backend), failure
# propagation on NCCL, and the GPU-marked tests. Writes logs and summaries to $OUT.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
NPROC=$(python3 -c "import torch; print(torch.cuda.device_count())")
TOPO=$([ "$NPROC" -ge 2 ] && echo auto || echo t1d1); [ "$NPROC" -lt 2 ] && NPROC=2
STEPS=${STEPS:-200}
echo "== train: $NPROC processes, topology=$TOPO, $STEPS steps"
start=$(date +%s)
python3 -m torch.distributed.run --standalone --nproc-per-node $NPROC -m launcher.train topology=$TOPO \
  run.dir=/tmp/gpu_train train.steps=$STEPS train.eval_every=100 optim.lr=2e-3 run.progress=false 2>&1 | grep -v "^W1130" | tail -25
echo "train exit ${PIPESTATUS[0]} in $(( $(date +%s) - start ))s"
cp /tmp/gpu_train/summary.json $OUT/train_summary.json 2>/dev/null
cp /tmp/gpu_train/metrics.jsonl $OUT/train_metrics.jsonl 2>/dev/null
echo "== failure propagation: target rank raises at step 3"
start=$(date +%s)
python3 -m torch.distributed.run --standalone --nproc-per-node $NPROC -m launcher.train topology=$TOPO \
  run.dir=/tmp/gpu_fault train.steps=200 fault.rank=0 fault.step=3 fault.kind=raise run.progress=false > $OUT/fault.log 2>&1
echo "fault run exit $? in $(( $(date +%s) - start ))s"; grep "ERROR failed" $OUT/fault.log
echo "== GPU tests"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_drafter_gpu.py 2>&1 | tail -5
