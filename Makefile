# zerotune: make <stage> RECIPE=<name> [ARGS="section.key=value ..."]
RECIPE ?= tiny
ARGS ?=
# section.key=value given to make itself (make finetune RECIPE=tiny train.lr=1e-3) is a recipe override, as in ARGS:
# make would otherwise take it as one of its own variables and drop it silently
OVERRIDES = $(strip $(foreach v,$(.VARIABLES),$(if $(findstring command line,$(origin $(v))),$(if $(findstring .,$(v)),$(v)=$(value $(v))))) $(ARGS))
PY := .venv/bin/python
ZT := $(PY) -m zerotune
export HF_HUB_OFFLINE ?= 0
# the same cache as slurm/env.sh: `make fetch` on a login node fills what the compute nodes' preflight reads;
# the token stays where `hf auth login` (run without HF_HOME) put it
ifndef HF_HOME
export HF_HOME := $(CURDIR)/.cache/huggingface
export HF_TOKEN_PATH ?= $(HOME)/.cache/huggingface/token
endif
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup fetch data inspect finetune quantize check eval serve plan demo lint test test-all test-fast bench bench-quant clean help gpu-check

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' Makefile | sed 's/:.*## /\t/'

setup:  ## create .venv with pinned packages, llama.cpp converter and tokenizer (TORCH=cu126 for V100/T4)
	@bash scripts/setup.sh

fetch: setup  ## download the recipe's hub model (safetensors, config, tokenizer) into the HF cache, on a node with internet
	$(ZT) fetch $(RECIPE) $(OVERRIDES)

data: setup  ## tokenize, label and pack the recipe's data once (cached by fingerprint)
	$(ZT) data $(RECIPE) $(OVERRIDES)

inspect: setup  ## print prepared sequences as training sees them, labels highlighted (ARGS="--n 4"); HTML in runs/<r>/inspect/
	$(ZT) inspect $(RECIPE) $(OVERRIDES)

plan: setup  ## memory, batch and time plan for the recipe's target cluster
	$(ZT) plan $(RECIPE) $(OVERRIDES)

gpu-check:  ## on a CUDA GPU: run the GPU-only paths for real as a V100 would, beside the plan (no GPU: says so, exits 0); ARGS="--quick", "--as native" etc.
	$(PY) scripts/gpu_check.py $(ARGS)

finetune: setup  ## train with DeepSpeed ZeRO-3 (one process per GPU, or train.cpu_procs on CPU)
	$(ZT) finetune $(RECIPE) $(OVERRIDES)

quantize: setup  ## HF model -> GGUF (Q8_0 by default) with llama.cpp's converter, checked
	$(ZT) quantize $(RECIPE) $(OVERRIDES)

check: setup  ## GGUF vs HF: held-out accuracy, KL, top-1, T4 fit, speed
	$(ZT) check $(RECIPE) $(OVERRIDES)

eval: setup  ## base vs fine-tuned HF vs GGUF on every eval.sets set -> runs/<r>/eval/eval.json, eval.png
	$(ZT) eval $(RECIPE) $(OVERRIDES)

serve: setup  ## OpenAI-compatible server over the GGUF on 127.0.0.1
	$(ZT) serve $(RECIPE) $(OVERRIDES)

demo: setup  ## the whole chain on CPU: data -> finetune -> quantize -> eval -> check (check reuses eval's answers) (last line: JSON summary)
	@# a recipe that starts from another recipe's published model (smollm2_dpo from runs/smollm2/model) trains that
	@# recipe first when its model is missing
	@up=$$($(PY) -c 'import sys; from zerotune.config import load_recipe; from zerotune.layout import upstream_to_train; \
	print(upstream_to_train(load_recipe(sys.argv[1], sys.argv[2:])) or "")' $(RECIPE) $(OVERRIDES)) && \
	if [ -n "$$up" ]; then echo "demo: $(RECIPE) starts from recipe $$up's model, not trained yet: make data finetune RECIPE=$$up first" >&2; \
	$(MAKE) --no-print-directory data finetune RECIPE=$$up; fi
	$(ZT) data $(RECIPE) $(OVERRIDES)
	$(ZT) finetune $(RECIPE) $(OVERRIDES)
	$(ZT) quantize $(RECIPE) $(OVERRIDES)
	$(ZT) eval $(RECIPE) $(OVERRIDES)
	$(ZT) check $(RECIPE) $(OVERRIDES)
	@# where the result is and what to run next; on stderr, so the JSON summary stays the last line of stdout
	@$(PY) -c 'import sys; from zerotune.config import load_recipe; from zerotune.layout import layout; \
	r = load_recipe(sys.argv[1], sys.argv[2:]); a = " ".join(sys.argv[2:]); \
	print(f"demo: done; the GGUF is {layout(r).gguf}\nnext: make serve RECIPE={sys.argv[1]}" + (f" ARGS=\"{a}\"" if a else "") \
	+ f"   # OpenAI-compatible API on http://{r.serve.host}:{r.serve.port}/v1", file=sys.stderr)' $(RECIPE) $(OVERRIDES)

lint: setup  ## ruff (pyflakes + syntax errors) over the code, tests, bench and scripts (CI runs it)
	$(PY) -m ruff check src tests bench scripts slurm

test: setup  ## all tests but the extended ones, integration included (what CI runs)
	$(PY) -m pytest -q --durations=25 -m "not extended" tests  # the 25 slowest close every run: the CI budget, watched

test-all: setup  ## every test, the extended second paths too (docs/testing.md lists them)
	$(PY) -m pytest -q --durations=25 tests

test-fast: setup  ## unit tests only, under a minute (the slow and integration ones are left to make test)
	$(PY) -m pytest -q -m "not integration and not slow" tests

bench: setup  ## measured comparisons on this machine -> bench/results.md (+ results/*.json, *.png)
	$(PY) bench/bench_data.py
	$(PY) bench/bench_data_scale.py
	$(PY) bench/bench_inference.py
	$(PY) bench/bench_answers.py
	$(PY) bench/bench_rollout.py
	$(PY) bench/bench_attention.py
	$(PY) bench/bench_sequence_parallel.py
	$(PY) bench/bench_zero3_host.py
	$(PY) bench/bench_cpu_adam.py
	ZEROTUNE_BENCH_RESULTS=bench/results $(PY) -m pytest -q tests/test_activation_memory.py
	$(PY) -m pip install -q --no-deps --upgrade --target bench/work/trl-site -r bench/requirements-bench.txt
	$(PY) bench/bench_train.py
	$(PY) bench/report.py

bench-quant: setup  ## GGUF types of the fine-tuned SmolLM2 vs its HF model (KL, top-1, perplexity, task) -> bench/results/quant.md
	$(ZT) data smollm2
	$(ZT) finetune smollm2
	$(PY) bench/bench_quant.py smollm2

clean:  ## remove run outputs (keeps .venv and assets)
	rm -rf runs bench/work
