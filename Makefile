# make test  - set up .venv, then ruff, mypy and the whole pytest suite (PostgreSQL included)
# make demo  - the end-to-end demo on SQLite and the loopback sandbox
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install typecheck-tree lint test demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# mypy cannot follow the editable install's import hook, so it checks a link tree laid out
# as the installed package is (payorch/, payorch/providers, payorch/cli).
typecheck-tree:
	rm -rf .typecheck && mkdir -p .typecheck/payorch
	for f in orchestrator/*; do ln -s ../../$$f .typecheck/payorch/; done
	ln -s ../../providers .typecheck/payorch/providers
	ln -s ../../cli .typecheck/payorch/cli

lint: install typecheck-tree
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest

demo: install
	$(VENV)/bin/payorch demo

bench: install
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .typecheck build dist .pytest_cache .mypy_cache .ruff_cache payorch.db payorch-demo.db
