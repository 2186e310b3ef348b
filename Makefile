# specmesh — every target sets up its own virtualenv from scratch on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specmesh-installed

.PHONY: venv run test lint bench bench-gpu soak proto demo-models clean container-test

venv: $(STAMP)

# llama-cpp-python (the gguf extra) compiles llama.cpp: only the library, for this CPU.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc)

# torch is installed first and pinned: letting pip resolve it freely pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --progress-bar on -q --upgrade pip
	$(PY) -m pip install --progress-bar on torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --progress-bar on -e '.[test,bench,lint,gguf]'
	touch $(STAMP)

# `specmesh serve` on the committed demo pair: REST on 127.0.0.1:8000, gRPC on 50070, until Ctrl-C.
run: venv
	$(VENV)/bin/specmesh serve --model-path models/demo/target --speculative-draft-model-path models/demo/draft \
		--served-model-name demo

# Two xdist workers, a test file each: about 13 minutes on 2 cores against 24 serially (PYTEST_ARGS= for
# one process). Each test file's servers and models stay in its worker.
PYTEST_ARGS ?= -n 2 --dist loadfile
test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# What CI runs before the tests: layer contracts, lint and format, types, and the proto's buf lint.
lint: venv
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	npx --yes @bufbuild/buf@1.75.0 lint

# Regenerate specmesh/v1/*_pb2*.py from proto/ (tests/unit/test_proto.py fails while they are stale).
proto: venv
	$(PY) -m specmesh.codegen

# The per-round choice of draft against the draft model alone, on text no one here wrote (HumanEval) and on an
# edit loop that sends earlier code back.
HYBRID_BENCH := --prompt-len 512 --prompts 20 --skip-hf --old-runtime ''
bench: venv
	$(PY) -m bench.inprocess
	$(PY) -m bench.services
	$(PY) -m bench.load --llamacpp
	$(PY) -m bench.load --placement split --concurrency 1,4,16 --temperatures 0 --skip-hf --old-runtime '' \
		--out bench/results/load-split.json
	$(PY) -m bench.prefix_share
	$(PY) -m bench.suffix_cost
	for w in editloop humaneval stdlib; do \
		$(PY) -m bench.load --workload $$w $(HYBRID_BENCH) --concurrency 1,4,16,32 --temperatures 0,0.7 \
			--out bench/results/load-$$w-hybrid.json && \
		$(PY) -m bench.load --workload $$w $(HYBRID_BENCH) --concurrency 1,16 --temperatures 0 \
			--draft-arg=--no-enable-suffix-decoding --out bench/results/load-$$w-model.json || exit 1; \
	done

# On a machine with a CUDA GPU: the CUDA tests, CUDA graphs on and off, and the real-size pair (the demo pair
# widened to Llama 3.1 8B / 3.2 1B shapes) through the stack, in one script that fits 15 minutes of device time.
GPU_OUT ?= bench/results/gpu
bench-gpu:
	OUT=$(GPU_OUT) bench/gpu-checks.sh

# The chaos and soak suite, kept out of `make test`: real processes on loopback, services killed, hung and
# restarted, the draft <-> verify link delayed, black-holed and reset, malformed input, then a soak of 32
# clients; every figure goes to soak/results/report.json. SOAK_DURATION_S is the soak's length.
SOAK_DURATION_S ?= 600
soak: venv
	$(PY) -m soak --duration-s $(SOAK_DURATION_S)

# The container test, kept out of `make test`: builds the Dockerfile as it is, brings up docker-compose.yml's
# verify, draft and gateway containers, answers the README's curl, a streamed chat request and a gRPC call
# through the published ports, then tears the stack down. podman + podman-compose by default (Debian's
# packages; a debootstrap base where no registry is reachable); CONTAINER_ENGINE=docker for Docker.
container-test: venv
	scripts/container-test.sh

# Reproduce models/demo from the standard library's sources (about 1.5 h on 2 cores; see README).
DISTILL := $(PY) -m specmesh.training.distill --target models/demo/target --stdlib --steps 800 --batch-size 8 \
	--seq-len 256 --lr 2e-3 --warmup 50 --autocast bf16 --teacher-topk 64 --seed 0
demo-models: venv
	# 600 steps of an 850-step cosine schedule, then a short anneal: the schedule is re-cut to end at 650
	$(PY) -m specmesh.training.train_target --out models/demo/target --work-dir .work/target \
		--steps 850 --warmup 50 --checkpoint-every 50 --lr 1.5e-3 --stop-after 600
	$(PY) -m specmesh.training.train_target --out models/demo/target --work-dir .work/target \
		--steps 650 --warmup 50 --checkpoint-every 50 --lr 1.5e-3 --resume
	$(DISTILL) --kl-weight 0.9 --cache-dir .work/teacher-cache --out models/demo/draft
	$(DISTILL) --kl-weight 0 --out .work/draft-data-only  # the data-only baseline of the README's report

clean:
	rm -rf $(VENV) .pytest_cache .work
