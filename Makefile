# ShardTrain — plain GNU make. Objects go under $(BUILD)/obj with -MMD -MP header dependencies;
# `make -j` is safe. The first target that needs the toolchain installs missing Debian packages
# (as root) or prints the apt-get line (otherwise). See README.md for the user-facing targets.
SHELL   := /bin/bash
.DEFAULT_GOAL := all
# Without a -j of the user's, compile on every core, at most 8 (a compiler takes up to ~1 GiB): the
# first `make run` compiled one file at a time, 10 minutes on a busy 2-core machine.
ifeq ($(filter -j%,$(MAKEFLAGS)),)
MAKEFLAGS += -j$(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n > 8 ? 8 : n )))
endif

# ---- knobs --------------------------------------------------------------------------------------
# NP: ranks for `make run`; PYTHON: Debian's python3 (the tests need only its standard library,
# the checkpoint tests its h5py); SAN: e.g. address,undefined (see `make sanitize`).
# OPT: x86-64-v3 (AVX2 and FMA: Intel from Haswell, AMD from Zen) by default, so that a binary built
# on a login node -- or bundled for another machine -- runs on every compute node of the last
# decade; what gains from AVX-512 dispatches at run time (OpenBLAS, oneDNN, the FMA probes).
# NATIVE=1 tunes for the building machine instead (-march=native).
NP      ?= 2
MPICXX  ?= mpicxx
MPIRUN  ?= mpirun
PYTHON  ?= /usr/bin/python3
CUDA    ?= 0
NATIVE  ?= 0
ifeq ($(NATIVE),1)
OPT     ?= -O3 -march=native
else
OPT     ?= -O3 -march=x86-64-v3
endif
SAN     ?=

ifeq ($(filter $(CUDA),0 1),)
$(error CUDA must be 0 or 1, got '$(CUDA)')
endif
# The CUDA build keeps its objects apart: the same sources compile differently with it.
ifeq ($(CUDA),1)
BUILD   ?= build-cuda
else
BUILD   ?= build
endif

DEB_PACKAGES := g++ make pkg-config python3 openmpi-bin libopenmpi-dev libopenblas-openmp-dev \
                libboost-program-options-dev libhdf5-openmpi-dev hdf5-tools libgtest-dev \
                libbenchmark-dev nlohmann-json3-dev python3-h5py python3-numpy python3-matplotlib \
                libpcre2-dev libutf8proc-dev libpng-dev libdnnl-dev libblis-openmp-dev strace

# Where the libraries come from (docs/cluster.md, section 1). DEPS=debian, the default where
# dpkg-query exists: the Debian packages above are checked before the first compile (and installed
# when root). DEPS=none, the default elsewhere: nothing is checked, and the compiler finds the
# libraries on its own paths, under the prefixes named below, or through the *_INC/*_LIB variables.
# HDF5_ROOT and OPENBLAS_ROOT (which environment modules and Spack set) are the parallel HDF5's and
# OpenBLAS's prefixes; DEP_ROOTS lists more prefixes (Boost, oneDNN, PCRE2, utf8proc, libpng, nlohmann_json),
# each searched in include/, lib/ and lib64/, and found again at run time (rpath).
DEPS      ?= $(shell dpkg-query -W dpkg >/dev/null 2>&1 && echo debian || echo none)
DEP_ROOTS ?=
ifeq ($(filter $(DEPS),debian none),)
$(error DEPS must be debian or none, got '$(DEPS)')
endif

# The OpenMP build of OpenBLAS shares the OpenMP thread pool with our own loops, so the two
# never oversubscribe the cores (the pthread build keeps a second pool that fights ours).
ifneq ($(OPENBLAS_ROOT),)
OPENBLAS_LIB ?= $(OPENBLAS_ROOT)/lib
OPENBLAS_INC ?= $(OPENBLAS_ROOT)/include
endif
OPENBLAS_LIB ?= /usr/lib/x86_64-linux-gnu/openblas-openmp
OPENBLAS_INC ?= /usr/include/x86_64-linux-gnu/openblas-openmp

# OMPI_SKIP_MPICXX: we use the C API; the deprecated C++ bindings only add warnings.
# Parallel HDF5 (Debian's Open MPI flavour, explicit: pkg-config's hdf5.pc is an alternatives link).
ifneq ($(HDF5_ROOT),)
HDF5_INC ?= $(HDF5_ROOT)/include
HDF5_LIB ?= $(HDF5_ROOT)/lib
endif
HDF5_INC ?= /usr/include/hdf5/openmpi
HDF5_LIB ?= /usr/lib/x86_64-linux-gnu/hdf5/openmpi
CPPFLAGS := -I. -Isrc -I$(OPENBLAS_INC) -I$(HDF5_INC) $(addsuffix /include,$(addprefix -I,$(DEP_ROOTS)))
CPPFLAGS += -DOMPI_SKIP_MPICXX=1
CPPFLAGS += -DSHARDTRAIN_VERSION='"$(shell git describe --always --dirty 2>/dev/null)"'
CPPFLAGS += -DSHARDTRAIN_MARCH='"$(or $(patsubst -march=%,%,$(filter -march=%,$(OPT))),default)"'
CXXFLAGS := -std=c++17 $(OPT) -g -fopenmp -Wall -Wextra -Wno-unused-parameter -MMD -MP
# Nothing reads or traps on floating-point exception flags, and nothing reads errno after a math
# function. Under GCC's defaults the clamp in exp_fast stays a branch for AVX2 (-ftrapping-math), so
# GELU, SiLU, softmax and attention's exponentials ran scalar in the portable build, and AdamW's
# sqrt kept a call to sqrtf for negative inputs (-fmath-errno), so the optimizer step ran scalar in
# every build (docs/performance.md, "Elementwise loops in vector code").
CXXFLAGS += -fno-trapping-math -fno-math-errno
LDFLAGS  := -fopenmp -L$(OPENBLAS_LIB) -Wl,-rpath,$(OPENBLAS_LIB) -L$(HDF5_LIB) -Wl,-rpath,$(HDF5_LIB)
LDFLAGS  += $(foreach r,$(DEP_ROOTS),-L$(r)/lib -L$(r)/lib64 -Wl,-rpath,$(r)/lib -Wl,-rpath,$(r)/lib64)
LDLIBS   := -lopenblas -ldnnl -lhdf5 -lboost_program_options -lpcre2-8 -lutf8proc -lpng16 -lpthread
ifneq ($(SAN),)
CXXFLAGS += -fsanitize=$(SAN) -fno-omit-frame-pointer
LDFLAGS  += -fsanitize=$(SAN)
endif

# Root runs of mpirun need Open MPI's explicit consent; tests and `make run` inherit these.
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
endif

# ---- sources ------------------------------------------------------------------------------------
# Host code that needs the CUDA toolkit lives in folders named cuda/ (src/backend/cuda,
# src/comm/cuda) and is built only with CUDA=1, as are the kernels (kernels/*.cu) and the GPU
# tests (tests/gpu).
SRCS       := $(shell find src -name '*.cpp' -not -path '*/cuda/*' | sort)
ifeq ($(CUDA),1)
SRCS       += $(shell find src -path '*/cuda/*' -name '*.cpp' | sort)
endif
LIB_SRCS   := $(filter-out src/app/main.cpp,$(SRCS))
UNIT_SRCS  := $(shell find tests/unit tests/support -name '*.cpp' | sort)
MPI_SRCS   := $(shell find tests/mpi -name '*.cpp' | sort)
BENCH_SRCS := $(shell find tests/bench -name '*.cpp' | sort)

obj = $(patsubst %.cpp,$(BUILD)/obj/%.o,$(1))
LIB_OBJS   := $(call obj,$(LIB_SRCS))
ifeq ($(CUDA),1)
# sm_90 machine code for H100/H200 and compute_90 PTX that newer GPUs compile at load time.
CUDA_HOME  ?= /usr/local/cuda
NVCC       ?= $(CUDA_HOME)/bin/nvcc
CUDA_ARCH  ?= -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90
NVCCFLAGS  := -std=c++17 -O3 $(CUDA_ARCH) -lineinfo --expt-relaxed-constexpr -Xcompiler -Wall,-Wno-unused-parameter -MMD -MP
CU_SRCS    := $(shell find kernels -name '*.cu' | sort)
LIB_OBJS   += $(patsubst %.cu,$(BUILD)/obj/%.o,$(CU_SRCS))
GPU_SRCS   := $(shell find tests/gpu -name '*.cpp' 2>/dev/null | sort)
GPU_TESTS  := $(BUILD)/gpu_tests
CPPFLAGS   += -DSHARDTRAIN_CUDA=1 -I$(CUDA_HOME)/include
LDFLAGS    += -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/lib -Wl,-rpath,$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib
LDLIBS     += -lcudnn -lcublasLt -lcublas -lnccl -lcudart
endif
MAIN_OBJ   := $(call obj,src/app/main.cpp)
UNIT_OBJS  := $(call obj,$(UNIT_SRCS))
MPI_OBJS   := $(call obj,$(MPI_SRCS))

EXE        := $(BUILD)/shardtrain
UNIT_TESTS := $(BUILD)/unit_tests
MPI_TESTS  := $(BUILD)/mpi_tests
# Each tests/bench/X.cpp is its own program $(BUILD)/X (its own main); BENCH_LIBS_X adds its libraries.
BENCH_BINS := $(patsubst tests/bench/%.cpp,$(BUILD)/%,$(BENCH_SRCS))
BENCH_LIBS_layer_bench := -lbenchmark
# BLIS only for the GEMM library comparison (OpenMP build, beside OpenBLAS: its own bli_ API).
BLIS_LIB := /usr/lib/x86_64-linux-gnu/blis-openmp
BENCH_LIBS_gemm_bench := -L$(BLIS_LIB) -Wl,-rpath,$(BLIS_LIB) -lblis
DEPS_STAMP := $(BUILD)/.deps-ok

.PHONY: all deps run test test-slurm test-cluster test-portable-build test-encode bench-peers test-gpu gpu-check bundle bench sanitize print-config clean
all: $(EXE) $(GPU_TESTS)

# ---- dependencies -------------------------------------------------------------------------------
deps: $(DEPS_STAMP)
ifeq ($(DEPS),none)
$(DEPS_STAMP):
	@mkdir -p $(BUILD) && touch $@
	@echo "→ dependencies not checked (DEPS=none): the compiler finds them (docs/cluster.md)"
else
$(DEPS_STAMP):
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "→ installing Debian packages:$$missing"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing || exit 1; \
	  else \
	    echo "missing Debian packages; install them with:"; \
	    echo "  sudo apt-get install -y$$missing"; exit 1; \
	  fi; \
	fi
	@mkdir -p $(BUILD) && touch $@
	@echo "✓ dependencies: $(words $(DEB_PACKAGES)) Debian packages present"
endif

# ---- build --------------------------------------------------------------------------------------
# The objects depend on the flags that change their code: another OPT, SAN or NATIVE rebuilds them
# all (the stamp is rewritten only when the flags differ, so nothing else does).
FLAGS_STAMP := $(BUILD)/.flags
COMPILE_FLAGS := $(MPICXX) $(CXXFLAGS) $(NVCCFLAGS)
$(FLAGS_STAMP): FORCE
	@mkdir -p $(BUILD)
	@echo '$(COMPILE_FLAGS)' | cmp -s - $@ 2>/dev/null || echo '$(COMPILE_FLAGS)' > $@
.PHONY: FORCE
FORCE:

# The tests' own headers (tests/support) are on the include path of the tests alone.
$(BUILD)/obj/tests/%.o: CPPFLAGS += -Itests

$(BUILD)/obj/%.o: %.cpp $(FLAGS_STAMP) | $(DEPS_STAMP)
	@mkdir -p $(@D)
	@printf "  CXX   %-40s\n" $<
	@$(MPICXX) $(CPPFLAGS) $(CXXFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.cu $(FLAGS_STAMP) | $(DEPS_STAMP)
	@mkdir -p $(@D)
	@printf "  NVCC  %-40s\n" $<
	@$(NVCC) $(CPPFLAGS) $(shell $(MPICXX) --showme:incdirs 2>/dev/null | sed 's/[^ ]*/-I&/g') $(NVCCFLAGS) -c $< -o $@

$(EXE): $(LIB_OBJS) $(MAIN_OBJ)
	@printf "  LINK  %s\n" $@
	@$(MPICXX) $(LDFLAGS) $^ $(LDLIBS) -o $@

$(UNIT_TESTS): $(LIB_OBJS) $(UNIT_OBJS)
	@printf "  LINK  %s\n" $@
	@$(MPICXX) $(LDFLAGS) $^ $(LDLIBS) -lgtest -o $@

$(MPI_TESTS): $(LIB_OBJS) $(MPI_OBJS)
	@printf "  LINK  %s\n" $@
	@$(MPICXX) $(LDFLAGS) $^ $(LDLIBS) -lgtest -o $@

$(GPU_TESTS): $(LIB_OBJS) $(call obj,$(GPU_SRCS))
	@printf "  LINK  %s\n" $@
	@$(MPICXX) $(LDFLAGS) $^ $(LDLIBS) -lgtest -o $@

$(BENCH_BINS): $(BUILD)/%: $(BUILD)/obj/tests/bench/%.o $(LIB_OBJS)
	@printf "  LINK  %s\n" $@
	@$(MPICXX) $(LDFLAGS) $^ $(LDLIBS) $(BENCH_LIBS_$*) -o $@

# ---- user-facing targets ------------------------------------------------------------------------
DATA_DIR := inputs/data
DEFAULT_DATA := $(DATA_DIR)/synth_train.bin

$(DEFAULT_DATA): $(EXE)
	@$(EXE) data synth --out-dir $(DATA_DIR)

# Training, then a short sample of what the model learned (a second on one rank: docs/generate.md).
run: $(EXE) $(DEFAULT_DATA)
	$(MPIRUN) --oversubscribe --bind-to none --mca odls_base_sigkill_timeout 3 -np $(NP) $(EXE) train --config inputs/default.ini
	@echo "→ what the model writes after 'Dora has eight wolves.' (shardtrain generate, docs/generate.md):"
	@$(EXE) generate --checkpoint checkpoints/default --prompt "Dora has eight wolves." --max-tokens 64 --temperature 0.7

# CI=1: a skip not listed in tests/expected-skips.txt fails the run (.ci/run sets it).
test: $(EXE) $(UNIT_TESTS) $(MPI_TESTS)
	@$(PYTHON) tests/run_tests.py --build $(BUILD) $(if $(CI),--expected-skips tests/expected-skips.txt)

# A real single-node Slurm (installed with apt-get if missing, started and stopped by the test)
# runs the scripts in slurm/: tests/slurm/run_slurm_tests.sh, about 2 minutes on 2 cores (113 s measured).
test-slurm: $(EXE)
	@bash tests/slurm/run_slurm_tests.sh --build $(BUILD)

# A real 2-host Slurm cluster made of network namespaces (tests/cluster/netns_cluster.sh; set up and
# torn down by the test, nothing left behind) runs the multi-node script across the hosts:
# tests/cluster/run_cluster_tests.sh, about 25 s on 2 cores (21 s measured); budget 5 minutes.
test-cluster: $(EXE)
	@bash tests/cluster/run_cluster_tests.sh --build $(BUILD)

# The build as on a cluster without Debian's packages: every library from a prefix of its own,
# Debian's copies hidden in a private mount namespace (tests/build/portable_build.sh; root; about
# 100 s on 2 cores). `make test` runs it too (tests/e2e/test_build.py).
test-portable-build:
	@bash tests/build/portable_build.sh

# tools/encode_images.py (FLUX latents from images and captions) against diffusers and transformers
# on a tiny random FLUX.1-style repository, then 2 training steps on its shards. Builds
# $(BUILD)/encode-venv with PyTorch, diffusers and transformers the first time (several GB, minutes;
# ENCODE_PYTHON=<python> uses one that has them); about 20 s after that. Not part of `make test`.
test-encode: $(EXE)
	@$(PYTHON) tests/tools/test_encode_images.py --build $(BUILD)

# ShardTrain beside PyTorch eager and torch.compile (transformers' GPT-2 and Llama, diffusers' FLUX)
# on the CPU, the same steps interleaved (tests/bench/peers_bench.py); its Python is test-encode's
# (built the first time, or ENCODE_PYTHON). Not part of `make test` or `make bench`.
bench-peers: $(EXE)
	@$(PYTHON) tests/bench/peers_bench.py --build $(BUILD)

# The GPU suite (tools/gpu_check.sh, docs/gpu.md): kernel and NCCL tests against the CPU backend
# and 20 training steps on the GPU against the CPU; gpu-check adds the benchmarks and writes every
# number to gpu-report.md. Both build with CUDA=1; without a GPU they say so and exit 0.
ifeq ($(CUDA),1)
test-gpu: $(EXE) $(GPU_TESTS)
	@bash tools/gpu_check.sh --bin $(BUILD) --tests-only
gpu-check: $(EXE) $(GPU_TESTS)
	@bash tools/gpu_check.sh --bin $(BUILD)
else
test-gpu gpu-check:
	@if [ -x "$${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then $(MAKE) --no-print-directory CUDA=1 $@; \
	 else echo "$@: no CUDA toolkit (no $${CUDA_HOME:-/usr/local/cuda}/bin/nvcc), so no GPU build: skipped"; fi
endif

# A folder (bundle/) with the binaries and every library they need but glibc and CUDA's, to carry to
# a GPU machine that has none of our Debian packages (tools/bundle.sh, docs/gpu.md).
bundle: $(EXE) $(GPU_TESTS)
	@bash tools/bundle.sh --build $(BUILD) --out bundle

bench: $(EXE) $(BENCH_BINS)
	@$(PYTHON) tests/bench/run_bench.py --build $(BUILD)

sanitize:
	@ASAN_OPTIONS=detect_leaks=0 $(MAKE) --no-print-directory BUILD=build-san SAN=address,undefined OPT=-O1 test

print-config:
	@echo "MPICXX=$(MPICXX) ($(shell $(MPICXX) --version 2>/dev/null | head -1))"
	@echo "MPIRUN=$(MPIRUN) NP=$(NP) PYTHON=$(PYTHON) BUILD=$(BUILD) OPT=$(OPT) SAN=$(SAN)"
	@echo "DEPS=$(DEPS) DEP_ROOTS=$(DEP_ROOTS)"
	@echo "OpenBLAS: $(OPENBLAS_INC) $(OPENBLAS_LIB)"
	@echo "HDF5: $(HDF5_INC) $(HDF5_LIB)"
	@if [ "$(CUDA)" = 1 ]; then echo "✓ CUDA backend requested"; else echo "→ CUDA disabled (CUDA=0)"; fi

clean:
	rm -rf $(BUILD) build-san build-cuda bundle

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
