# `make demo` and `make test` each set up everything on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel where the machine's pip finds one; on CUDA machines PyPI's build of the same version.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# DeepSpeed JIT-compiles a C++ op on first use (~2.5 min on 2 cores): cache it inside the
# git-ignored venv, for the set-up below, the tests, the demo and the benchmarks alike.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch-extensions
# Horovod's last release is an sdist that needs C++17 against this torch: built once per torch
# version with backends/horovod/cxx17.patch, then installed from this git-ignored wheel cache.
HOROVOD        := horovod==0.28.1
PYTAG          := $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
HOROVOD_WHEELS := .cache/wheels/$(subst ==,-,$(HOROVOD))-$(subst ==,-,$(TORCH))-$(PYTAG)
HOROVOD_BUILT  := $(HOROVOD_WHEELS)/.built

.PHONY: demo test conformance bench clean horovod-wheel

$(STAMP): setup.py CMakeLists.txt $(wildcard backends/csrc/*) $(HOROVOD_BUILT)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)" setuptools wheel
	$(BIN)/pip install --quiet --only-binary horovod --find-links $(HOROVOD_WHEELS) "$(HOROVOD)"
	$(BIN)/pip install --quiet --no-build-isolation -e ".[test,examples,deepspeed]"
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator; \
	  get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $(STAMP)

# Horovod with PyTorch and gloo (no MPI/NCCL here; see docs/horovod.md for GPU clusters). The
# build needs torch installed first (--no-build-isolation), hence the venv + torch lines.
$(HOROVOD_BUILT): backends/horovod/cxx17.patch
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)" setuptools wheel
	rm -rf .cache/horovod-src && mkdir -p .cache/horovod-src $(HOROVOD_WHEELS)
	$(BIN)/pip download --quiet --no-binary :all: --no-deps -d .cache/horovod-src "$(HOROVOD)"
	tar -xzf .cache/horovod-src/horovod-*.tar.gz -C .cache/horovod-src
	cd .cache/horovod-src/horovod-*/ && patch -p1 < $(CURDIR)/backends/horovod/cxx17.patch
	HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
	  HOROVOD_WITHOUT_MXNET=1 $(BIN)/pip wheel --quiet --no-build-isolation --no-deps \
	  -w $(HOROVOD_WHEELS) .cache/horovod-src/horovod-*/
	rm -rf .cache/horovod-src
	touch $@

horovod-wheel: $(HOROVOD_BUILT)

demo: $(STAMP)
	$(BIN)/mpt launch --gpus 2 --precision bf16-mixed examples/digits.py

test: $(STAMP)
	$(BIN)/python -m pytest

# Every backend x precision x world size 1/2 x accumulation 1/2 against ddp fp32, one launch per
# cell (~40 min on 2 cores); prints the table and writes docs/support-matrix.md. `make test`
# runs a fast subset (tests/conformance/test_grid.py). Options: CONFORMANCE_ARGS="--zero-stages 0,1,2,3".
conformance: $(STAMP)
	$(BIN)/python tests/conformance/grid.py $(CONFORMANCE_ARGS)

bench: $(STAMP)
	for p in fp32 bf16-mixed fp16-mixed; do \
	  $(BIN)/mpt launch --gpus 2 --precision $$p benchmarks/ddp_overhead.py || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info mpt/_C*.so
