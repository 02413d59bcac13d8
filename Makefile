# make test  - set up .venv, then ruff, mypy and the whole pytest suite (PostgreSQL included)
# make demo  - the end-to-end demo on SQLite and the loopback sandbox
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install typecheck-tree lint servers test demo bench clean

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

# The servers the tests start their own throwaway instances of (from the installed binaries):
# PostgreSQL, PgBouncer and redis-server. Missing ones are installed quietly when this runs as
# root with apt-get (what .ci/run does too); otherwise the run says which are missing and
# their tests skip, each server named in one summary line at the end of the run.
servers:
	@missing=""; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null \
		|| missing="$$missing postgresql"; \
	command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || missing="$$missing pgbouncer"; \
	command -v redis-server >/dev/null || [ -x /usr/bin/redis-server ] \
		|| missing="$$missing redis-server"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make test: installing$$missing (apt-get)"; \
		if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends $$missing) >/dev/null 2>&1; then \
			exit 0; \
		fi; \
		echo "make test: apt-get could not install$$missing"; \
	fi; \
	echo "make test: not installed:$$missing; their tests will skip" \
		"(as root: apt-get install$$missing)"

# pytest-xdist: four workers on two cores, as most tests wait on sockets, servers and
# subprocesses rather than compute; each worker starts its own PostgreSQL cluster, PgBouncer
# and redis-server. worksteal: an idle worker takes queued tests from a busy one, so a file of
# slow tests does not make the tail. `make test PYTEST_WORKERS=0` runs in one process.
PYTEST_WORKERS ?= 4

test: lint servers
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist worksteal

demo: install
	$(VENV)/bin/payorch demo

bench: install
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .typecheck build dist .pytest_cache .mypy_cache .ruff_cache payorch.db payorch-demo.db
