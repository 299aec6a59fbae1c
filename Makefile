# Two commands a user needs: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install install-test demo test test-vllm provision-vllm lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(VENV)/.installed $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/agentkv bench --out out/demo

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

# the live-vLLM suite alone (tests/vllm; `make test` runs it too), and its environment ahead of time
test-vllm: install-test
	$(BIN)/python -m pytest -q -m vllm tests/vllm

provision-vllm: install-test
	$(BIN)/python tests/vllm/vllm_env.py

bench: install
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
