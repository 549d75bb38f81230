#!/usr/bin/env bash
# GPU checks, stage by stage, on a GPU machine; each stage writes its log (and JSON) to the output
# directory (--out DIR, default /tmp/dflash-gpu):
#   bash scripts/gpu_session.sh --out DIR debug train fault evaluate drafter   (two GPUs)
#   bash scripts/gpu_session.sh bench                                (durations: docs/perf_notes.md, "Figures the code quoted")
#   bash scripts/gpu_session.sh stages gpu-tests   then   mix-e2e    (packed vs padded, issue 12; two GPUs for mix-e2e)
#   bash scripts/gpu_session.sh shapes                               (Llama-3-8B, Qwen3.5-35B-A3B target rows)
#   bash scripts/gpu_session.sh drafter-ab                           (the drafter step, this tree vs an older one;
#                                                                      BENCH_ARGS reach both trees' runs)
#   bash scripts/gpu_session.sh warm-start                           (t1d2 at the 8B shape on one GPU: the second
#                                                                      drafter compiles from the first one's artefacts)
#   bash scripts/gpu_session.sh adamw                                (AdamW variants against the HBM floor)
#   bash scripts/gpu_session.sh checkpoint-save                      (steps around a save at the 8B drafter, t1d1)
#   bash scripts/gpu_session.sh flex-tiles                           (flex alone on the real mask: Triton tiles, FLASH)
#   BENCH_ARGS="--set drafter.backend=flash" bash scripts/gpu_session.sh drafter   (the flash kernels: pack_flash.sh)
#     Prepare the older tree first: mkdir -p ab/base && git archive <ref> | tar -x -C ab/base (ab/ is gitignored).
# On 8 GPUs (issue 8: the original incident's 8-GPU shape, a Qwen3-27B-shaped target), two runs on one
# machine (the second reuses /tmp/b27's compile cache):
#   bash scripts/gpu_session.sh incident                             (stage rates, 8-GPU split advice)
#   TOPO=t5d3 bash scripts/gpu_session.sh incident-e2e               (then TOPO=<the advice> if it differs)
# TIME_LIMIT (seconds, default 585): every stage's timeout is cut to what is left of it, so a session run
# under a wall-clock limit ends with its logs written. On a machine without PyPI access, the wheels in
# .whl/ (hydra-core, omegaconf, antlr4: docs/development.md) and fa4b/ are installed under /tmp/site first.
set -u
export PYTHONUNBUFFERED=1
out_dir=/tmp/dflash-gpu
if [ "${1:-}" = --out ]; then out_dir=$2; shift 2; fi
mkdir -p "$out_dir"
# flash-attn-4 where packed (scripts/pack_flash.sh: fa4b/ here, the CuTe compiler unpacked in /tmp/fa4site).
wheels=$(ls .whl/*.whl fa4b/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 1
fi
if [ -d fa4b ]; then
  tar -xJf fa4b/rest.tar.xz -C /tmp/site && cp -r /tmp/fa4site/nvidia_cutlass_dsl /tmp/site/ || exit 1
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
# CLOCKS=1: the GPUs' SM clock, power and temperature every 250 ms while the stages run ($out_dir/clocks.csv),
# and nvidia-smi's clock, power and throttle report at the end ($out_dir/nvsmi.txt).
if [ "${CLOCKS:-0}" = 1 ]; then
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 250 > "$out_dir/clocks.csv" 2>&1 &
  trap 'kill %1 2>/dev/null; nvidia-smi -q -d PERFORMANCE,CLOCK,POWER > "$out_dir/nvsmi.txt" 2>&1' EXIT
fi
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
NPROC=$(( GPUS < 2 ? 2 : GPUS ))
echo "torch $(python3 -c 'import torch; print(torch.__version__)'), $GPUS GPUs"
TRAIN="python3 -m torch.distributed.run --standalone --nproc-per-node $NPROC -m launcher.train topology=auto
  data.fixed_length=256 optim.lr=2e-3 run.progress=false"

left() {  # seconds: min($1, what is left of TIME_LIMIT)
  local rest=$(( ${TIME_LIMIT:-585} - SECONDS )); echo $(( rest < $1 ? rest : $1 ))
}

stage() {  # name, command...: run with a wall clock, keep the log, print its tail
  local name=$1; shift
  local start=$(date +%s)
  "$@" > "$out_dir/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - start ))s"
  grep -v "^W1130" "$out_dir/$name.log" | grep -E "ERROR|Error|first step|warm-up|steps [0-9]|lossless|mean tau|done|PASS|FAIL|^ *[0-9] +[a-z]|drafter alone|rank[0-9] \+" | tail -15
}

for s in "$@"; do case $s in
  debug) GLOO_SOCKET_IFNAME=lo stage debug timeout $(left 90) python3 -m torch.distributed.run --standalone \
           --nproc-per-node $NPROC scripts/gpu_debug_init.py --timeout 45 ;;
  train) stage train timeout $(left 240) $TRAIN run.dir=/tmp/g train.steps=200 train.eval_every=100
         cp /tmp/g/summary.json "$out_dir/train_summary.json" 2>/dev/null ;;
  fault) stage fault timeout $(left 90) $TRAIN run.dir=/tmp/f train.steps=200 fault.rank=0 fault.step=3 fault.kind=raise ;;
  evaluate) stage evaluate timeout $(left 90) python3 -m launcher.evaluate evaluate.drafter=/tmp/g/export \
              evaluate.output="$out_dir/evaluate.json" ;;
  bench) stage bench timeout $(left 580) python3 -m launcher.bench --out "$out_dir/bench.json" ${BENCH_ARGS:-} ;;
  drafter) stage drafter timeout $(left 400) python3 -m launcher.bench --skip-target --skip-e2e \
             --skip-baseline --no-mix --seq 4096 --profile --out "$out_dir/drafter.json" ${BENCH_ARGS:-} ;;
  stages) stage stages timeout $(left 400) python3 -m launcher.bench --seq 4096 --skip-e2e --skip-baseline \
            --skip-full-forward --work-dir /tmp/bm --out "$out_dir/stages.json" ${BENCH_ARGS:-} ;;
  mix-e2e) stage mix_e2e timeout $(left 580) python3 -m launcher.bench --mix-only --seq 4096 --skip-target \
             --skip-drafter --stage-rates "${STAGE_RATES:-/tmp/bm/stages.json}" --work-dir /tmp/bm \
             --e2e-timeout 270 --out "$out_dir/mix_e2e.json" ;;
  shapes) for shape in llama3-8b qwen3.5-35b-a3b; do stage "shape_$shape" timeout $(left 280) python3 -m launcher.bench \
            --shape $shape --seq 4096 --no-mix --skip-e2e --skip-baseline --skip-full-forward --warmup 2 \
            --steps 4 --out "$out_dir/shape_$shape.json"; done ;;
  drafter-ab) [ -d "${AB_BASE:-ab/base}" ] || { echo "drafter-ab: no ${AB_BASE:-ab/base} (see the header)"; exit 2; }
      # Alternating, twice each, same machine and shape: ms/step moves a few % from machine to machine.
      for round in $(seq ${AB_ROUNDS:-2}); do for tree in "$PWD" "$PWD/${AB_BASE:-ab/base}"; do
        name=$([ "$tree" = "$PWD" ] && echo this || echo base)$round
        (cd "$tree" && PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$tree timeout $(left 150) python3 -m launcher.bench --skip-target \
           --skip-e2e --skip-baseline --no-mix --seq 4096 --steps 30 --work-dir /tmp/ab_$(basename "$tree") \
           --out /tmp/ab_$name.json ${BENCH_ARGS:-}) > "$out_dir/ab_$name.log" 2>&1
        echo "== $name: $(grep -m1 'drafter alone' "$out_dir/ab_$name.log" | cut -c1-120)"
      done; done ;;
  warm-start) stage warm_start timeout $(left 400) python3 -m launcher.bench --seq 4096 --skip-target --skip-drafter \
                --skip-baseline --no-mix --e2e-topology t1d2 --e2e-steps 10 --e2e-timeout 380 --work-dir /tmp/ws \
                --out "$out_dir/warm_start.json"
              grep -h "warm-up compiled" /tmp/ws/e2e-full/logs/*.log ;;
  adamw) stage adamw timeout $(left 150) python3 scripts/adamw_bench.py --out "$out_dir/adamw.json" ;;
  checkpoint-save) stage checkpoint_save timeout $(left 400) python3 scripts/time_checkpoint_save.py \
                     /tmp/checkpoint-save && cp /tmp/checkpoint-save/checkpoint_save.json "$out_dir/" ;;
  flex-tiles) stage flex_tiles timeout $(left 300) python3 scripts/flex_tiles.py --configs default,flash \
                --out "$out_dir/flex_tiles.json" ;;
  gpu-tests) stage gpu_tests timeout $(left 400) python3 -m pytest -q -s -p no:cacheprovider -m gpu ${GPU_TESTS:-tests} ;;
  incident) stage incident timeout $(left 580) python3 -m launcher.bench --shape qwen3-27b --seq 4096 \
              --no-mix --skip-e2e --skip-baseline --e2e-topology t5d3 --work-dir /tmp/b27 --out "$out_dir/incident.json" ;;
  incident-e2e) stage "incident_${TOPO:-t5d3}" timeout $(left 580) python3 -m launcher.bench --shape qwen3-27b \
                  --seq 4096 --skip-target --skip-drafter --skip-baseline --e2e-topology "${TOPO:-t5d3}" \
                  --e2e-steps 200 --e2e-timeout 570 --work-dir /tmp/b27 --out "$out_dir/incident_${TOPO:-t5d3}.json" ;;
  *) echo "unknown stage $s" ;;
esac; done
