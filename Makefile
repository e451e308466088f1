# `make demo` and `make test` each set up everything on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel where the machine's pip finds one; on CUDA machines PyPI's build of the same version.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): setup.py CMakeLists.txt $(wildcard backends/csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)" setuptools wheel
	$(BIN)/pip install --quiet --no-build-isolation -e ".[test,examples]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mpt launch --gpus 2 --precision bf16-mixed examples/digits.py

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	for p in fp32 bf16-mixed fp16-mixed; do \
	  $(BIN)/mpt launch --gpus 2 --precision $$p benchmarks/ddp_overhead.py || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info mpt/_C*.so
