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
# Horovod's last release does not build against this torch as published: `mpt install horovod`
# (mpt/install.py; here `python -m mpt.install`, the same command without mpt's other imports)
# builds it once per torch, Python and GPU architectures with backends/horovod/cxx20.patch and
# the CUDA toolkit backends/horovod/cuda-home finds, keeps the wheel in this git-ignored cache and
# installs it; a run that finds that wheel installed takes a fraction of a second.
# With a toolkit, Horovod's CUDA kernels are compiled for the command's --cuda-archs (default
# 75,80,90,100,120; docs/horovod.md lists the GPUs and what it saves). Another list:
# `make HOROVOD_BUILD_CUDA_CC_LIST=90`, or that variable in the environment; empty: every
# architecture nvcc knows.
HOROVOD_INSTALL := $(BIN)/python -m mpt.install horovod --cache-dir .cache/wheels $(if \
  $(filter-out undefined,$(origin HOROVOD_BUILD_CUDA_CC_LIST)),\
  --cuda-archs "$(HOROVOD_BUILD_CUDA_CC_LIST)")

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

.PHONY: setup demo test conformance bench examples gpu-check scaling clean horovod-wheel \
        dist-check

# A venv set up under the distribution's former name `mpt` loses it first, so that one
# distribution owns mpt/.
$(STAMP): setup.py pyproject.toml CMakeLists.txt $(wildcard backends/csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH) setuptools wheel
	$(BIN)/pip uninstall --quiet --yes mpt 2>/dev/null || true
	$(BIN)/pip install --quiet --no-build-isolation -e ".[test,examples,deepspeed]"
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator; \
	  get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $(STAMP)

# `--host-memory steady` preloads jemalloc into the workers (Debian's libjemalloc2, as torch's
# own CPU launcher does); installed here where it is missing and apt-get runs as root. Elsewhere
# steady keeps blocks in glibc's heaps and the run says so.
JEMALLOC_INSTALL := $(PYTHON) -c "import ctypes.util, sys; \
  sys.exit(ctypes.util.find_library('jemalloc') is None)" \
  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq \
       && apt-get install -y -qq libjemalloc2 >/dev/null; } \
  || echo "mpt: jemalloc is not installed (Debian: libjemalloc2): --host-memory steady will \
  keep blocks in glibc's heaps"

# What every target below runs on: the venv with mpt, jemalloc, then Horovod (built once, see
# above).
setup: $(STAMP)
	@$(JEMALLOC_INSTALL)
	$(HOROVOD_INSTALL)

# Only the wheel, for another machine: its path is the last line printed.
horovod-wheel: $(STAMP)
	$(HOROVOD_INSTALL) --build-only

demo: setup
	$(BIN)/mpt launch --gpus 2 --precision bf16-mixed examples/digits.py

define run_example
	$(BIN)/mpt launch --gpus 2 --precision $(EXAMPLES_PRECISION) --quiet $(ARGS_$(1)) \
	  > runs/examples/$(1).log 2>&1 || { tail -n 30 runs/examples/$(1).log; exit 1; }

endef

examples: setup
	@mkdir -p runs/examples
	$(foreach run,$(EXAMPLE_RUNS),$(call run_example,$(run)))
	@echo "what each example reached (2 processes, $(EXAMPLES_PRECISION)):"
	@$(foreach run,$(EXAMPLE_RUNS),printf '  %-9s %s\n' $(run) "$$(tail -n 1 runs/examples/$(run).log)";)

test: setup
	$(BIN)/python -m pytest

# `make dist-check`: builds the sdist and the wheel with `python -m build`, installs the wheel with
# this venv's torch version into a fresh virtualenv outside the repository and runs `mpt env` and
# the digits example on 2 processes there (tests/test_dist.py). `make test` checks what the wheel
# holds (tests/test_packaging.py).
dist-check: $(STAMP)
	$(BIN)/python -m pytest -m dist tests/test_dist.py

# The tests marked slow (longer cases of grids whose fast cases `make test` runs), then every
# backend x precision x world size 1/2 x accumulation 1/2 against ddp fp32, one launch per cell,
# and ddp and fsdp at 2 pipeline stages (~50-65 min on 2 cores); prints the table and writes
# docs/support-matrix.md. `make test` runs a
# fast subset (tests/conformance/test_grid.py). Options: CONFORMANCE_ARGS="--zero-stages 0,1,2,3".
conformance: setup
	$(BIN)/python -m pytest -m slow
	$(BIN)/python tests/conformance/grid.py $(CONFORMANCE_ARGS)

bench: setup
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
scaling: setup
	$(BIN)/python benchmarks/scaling.py $(SCALING_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info mpt/_C*.so
