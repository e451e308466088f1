# `make demo` and `make test` each set up everything on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# x86_64: torch 2.14.1 with torchvision 0.29.1, the CUDA 13 build (it runs on CPUs too, and is
# what a GPU node needs); the pair that imports together. Elsewhere torch 2.13.0 alone (the CPU
# wheel where the machine's pip finds one), which has no torchvision that imports beside it.
ifeq ($(shell uname -m),x86_64)
TORCH  ?= torch==2.14.1 torchvision==0.29.1
else
TORCH  ?= torch==2.13.0
endif
STAMP  := $(VENV)/.installed
# DeepSpeed JIT-compiles a C++ op on first use (~2.5 min on 2 cores): cache it inside the
# git-ignored venv, for the set-up below, the tests, the demo and the benchmarks alike.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch-extensions
# Horovod's last release is an sdist that needs C++20 against this torch: built once per torch
# version with backends/horovod/cxx20.patch, then installed from this git-ignored wheel cache.
HOROVOD        := horovod==0.28.1
PYTAG          := $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
# A CUDA build of torch makes Horovod's CMake look for cudart: name the toolkit the machine has
# (empty without one: Horovod then builds for CPUs only). See the script for why nvcc is asked;
# HOROVOD_CUDA_HOME makes Horovod's CMake use that toolkit's nvcc, not a wrapper on PATH.
CUDA_TOOLKIT   := $(shell backends/horovod/cuda-home)
# With a toolkit, Horovod compiles its CUDA kernels for these GPU architectures (compute
# capabilities; the last also as PTX, which newer GPUs compile when they load it) instead of
# every one its nvcc knows (12 for CUDA 13.0): the architectures torch 2.14.1+cu130 is built
# for, less 8.6 (8.x GPUs run 8.0 code). docs/horovod.md lists the GPUs and what it saves.
# Override it (`make HOROVOD_BUILD_CUDA_CC_LIST=90`); empty: every architecture nvcc knows.
HOROVOD_BUILD_CUDA_CC_LIST ?= 75,80,90,100,120
comma := ,
HOROVOD_WHEELS := .cache/wheels/$(subst ==,-,$(HOROVOD))-$(subst ==,-,$(firstword $(TORCH)))-$(PYTAG)$(if \
                    $(CUDA_TOOLKIT),-sm_$(or $(subst $(comma),_,$(HOROVOD_BUILD_CUDA_CC_LIST)),all))
HOROVOD_BUILT  := $(HOROVOD_WHEELS)/.built

# `make examples`: every example there is (examples/pix2pix.py joins once it exists), briefly, on
# 2 processes (the GPT also under DeepSpeed ZeRO-2); then the last line of each, which says what
# it reached. Full output: runs/examples/<name>.log. In bf16-mixed where nvidia-smi lists a GPU, else in
# fp32: CPUs without bf16 units (AVX2 only, as here) multiply bf16 matrices ~30x slower than fp32.
EXAMPLES_PRECISION ?= $(if $(shell nvidia-smi -L 2>/dev/null),bf16-mixed,fp32)
EXAMPLES := $(basename $(notdir $(wildcard $(addprefix examples/,\
              digits.py imagenet.py gpt.py pix2pix.py))))
EXAMPLE_RUNS := $(EXAMPLES) $(if $(filter gpt,$(EXAMPLES)),gpt-zero2)
ARGS_digits    := examples/digits.py --steps 150
ARGS_imagenet  := examples/imagenet.py --steps 150 --eval-every 50
ARGS_gpt       := examples/gpt.py --steps 300 --sample 0
ARGS_gpt-zero2 := --backend deepspeed --zero-stage 2 $(ARGS_gpt)
ARGS_pix2pix   := examples/pix2pix.py --steps 100

.PHONY: demo test conformance bench examples gpu-check scaling clean horovod-wheel

# Horovod is force-reinstalled from the wheel cache (a wheel rebuilt for other GPU architectures
# has the version of the one installed), then installed again for its dependencies.
$(STAMP): setup.py CMakeLists.txt $(wildcard backends/csrc/*) $(HOROVOD_BUILT)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH) setuptools wheel
	$(BIN)/pip install --quiet --only-binary horovod --find-links $(HOROVOD_WHEELS) \
	  --force-reinstall --no-deps "$(HOROVOD)"
	$(BIN)/pip install --quiet --only-binary horovod --find-links $(HOROVOD_WHEELS) "$(HOROVOD)"
	$(BIN)/pip install --quiet --no-build-isolation -e ".[test,examples,deepspeed]"
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator; \
	  get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $(STAMP)

# Horovod with PyTorch and gloo (no MPI/NCCL here; see docs/horovod.md for GPU clusters). The
# build needs torch installed first (--no-build-isolation), hence the venv + torch lines.
# Horovod's setup.py compiles with -j8 only while MAKEFLAGS is empty, and a variable given on
# make's command line lands in MAKEFLAGS: emptied, so that the override does not build serially.
$(HOROVOD_BUILT): backends/horovod/cxx20.patch backends/horovod/cuda-home
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH) setuptools wheel
	rm -rf .cache/horovod-src && mkdir -p .cache/horovod-src $(HOROVOD_WHEELS)
	$(BIN)/pip download --quiet --no-binary :all: --no-deps -d .cache/horovod-src "$(HOROVOD)"
	tar -xzf .cache/horovod-src/horovod-*.tar.gz -C .cache/horovod-src
	cd .cache/horovod-src/horovod-*/ && patch -p1 < $(CURDIR)/backends/horovod/cxx20.patch
	env -u HOROVOD_BUILD_CUDA_CC_LIST MAKEFLAGS= $(if $(CUDA_TOOLKIT),CUDA_HOME=$(CUDA_TOOLKIT) \
	  HOROVOD_CUDA_HOME=$(CUDA_TOOLKIT) $(if $(HOROVOD_BUILD_CUDA_CC_LIST),\
	  HOROVOD_BUILD_CUDA_CC_LIST=$(HOROVOD_BUILD_CUDA_CC_LIST))) \
	  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
	  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
	  $(BIN)/pip wheel --quiet --no-build-isolation --no-deps -w $(HOROVOD_WHEELS) .cache/horovod-src/horovod-*/
	rm -rf .cache/horovod-src
	touch $@

horovod-wheel: $(HOROVOD_BUILT)

demo: $(STAMP)
	$(BIN)/mpt launch --gpus 2 --precision bf16-mixed examples/digits.py

define run_example
	$(BIN)/mpt launch --gpus 2 --precision $(EXAMPLES_PRECISION) --quiet $(ARGS_$(1)) \
	  > runs/examples/$(1).log 2>&1 || { tail -n 30 runs/examples/$(1).log; exit 1; }

endef

examples: $(STAMP)
	@mkdir -p runs/examples
	$(foreach run,$(EXAMPLE_RUNS),$(call run_example,$(run)))
	@echo "what each example reached (2 processes, $(EXAMPLES_PRECISION)):"
	@$(foreach run,$(EXAMPLE_RUNS),printf '  %-9s %s\n' $(run) "$$(tail -n 1 runs/examples/$(run).log)";)

test: $(STAMP)
	$(BIN)/python -m pytest

# The tests marked slow (longer cases of grids whose fast cases `make test` runs), then every
# backend x precision x world size 1/2 x accumulation 1/2 against ddp fp32, one launch per cell,
# and ddp and fsdp at 2 pipeline stages (~50-65 min on 2 cores); prints the table and writes
# docs/support-matrix.md. `make test` runs a
# fast subset (tests/conformance/test_grid.py). Options: CONFORMANCE_ARGS="--zero-stages 0,1,2,3".
conformance: $(STAMP)
	$(BIN)/python -m pytest -m slow
	$(BIN)/python tests/conformance/grid.py $(CONFORMANCE_ARGS)

bench: $(STAMP)
	for p in fp32 bf16-mixed fp16-mixed; do \
	  $(BIN)/mpt launch --gpus 2 --precision $$p benchmarks/ddp_overhead.py || exit 1; done

# `make gpu-check`: every path only a GPU runs, within 8 minutes on one GPU, for whoever is lent
# one (benchmarks/gpu_check.py says what it runs); report in runs/gpu-check/report.json. It needs
# no venv (a lent GPU machine has torch and no network): the venv's Python where there is one.
# Without a GPU it says so in one line and exits 0.
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	@$(GPU_CHECK_PYTHON) benchmarks/gpu_check.py

# Scaling over 1, 2 and 4 nodes x 1 process on an emulated cluster (mpt.cluster: network
# namespaces, so root), links of 1 and 10 Gbit/s and unshaped, every backend, the 25 M-parameter
# MLP and ResNet-18, each against the raw library in the same processes; prints the table and
# writes runs/scaling/results.json and efficiency.png (hours on 2 cores). A subset:
# SCALING_ARGS="--models mlp --backends ddp,horovod --nodes 1,2 --rates 1gbit,100gbit".
scaling: $(STAMP)
	$(BIN)/python benchmarks/scaling.py $(SCALING_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info mpt/_C*.so
