# spillway — the two commands a new user needs are `make run` and `make test`;
# each sets up its own environment (.venv) first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=
# pytest-xdist workers; groups and their order: tests/conftest.py, tests/support/xdist_plan.py
WORKERS ?= 4
XDIST   := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadgroup)

.PHONY: run test test-fast test-unit test-integration test-e2e test-fuzz test-compat \
	bench bench-short protos venv clean

$(STAMP): requirements/dev.txt client/pyproject.toml sidecar/pyproject.toml spark_integration/pyproject.toml \
		sidecar/src/spillway/sidecar/core/_idindex.c sidecar/src/spillway/sidecar/core/_slots.c \
		sidecar/src/spillway/sidecar/dlq/_produce.c \
		spark_integration/src/spillway/spark/_udfcall.c \
		spark_integration/src/spillway/spark/_framekey.c
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "spillway needs Python 3.11+ (found $$($(PYTHON) --version))"; exit 1; }
	@command -v java >/dev/null || { echo "spillway's Spark job needs Java 17 on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements/dev.txt
	# --no-deps: the three share one repo and their dependencies are pinned above; compat: the
	# sidecar's editable install (setuptools) as a plain path entry, not an import hook that
	# every Python process (Spark workers, sidecars) would load at start
	$(BIN)/pip install -q --disable-pip-version-check --no-deps \
		--config-settings editable_mode=compat -e client -e sidecar -e spark_integration
	@# tests/deploy checks the systemd unit with systemd-analyze (Debian package systemd, nothing
	@# is started by installing it): added here as root where apt-get is, else named
	@command -v systemd-analyze >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		  apt-get update -qq && apt-get install -y -qq --no-install-recommends systemd >/dev/null; } || \
		echo "note: no systemd-analyze (package systemd): tests/deploy's unit checks skip (fail under CI=true)"
	@# tests/deploy checks the alert rules and the dashboard's queries with promtool (Debian
	@# package prometheus): its one binary, unpacked into the venv, no server installed
	@[ -x $(BIN)/promtool ] || command -v promtool >/dev/null || scripts/install-promtool.sh $(BIN) || \
		echo "note: no promtool (package prometheus): tests/deploy's rule checks skip (fail under CI=true)"
	@touch $@

venv: $(STAMP)

run: $(STAMP)  ## the main job on the embedded default (Tansu broker + sidecar + local Spark)
	$(BIN)/python examples/demo_job.py $(ARGS)

test: $(STAMP)  ## the whole suite, every tier, on $(WORKERS) workers (WORKERS=0: one process)
	$(BIN)/python -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

test-fast: $(STAMP)  ## the unit and integration tiers without the slow tests
	$(BIN)/python -m pytest $(XDIST) -m "not slow" tests/unit tests/integration $(PYTEST_ARGS)

test-unit test-integration test-e2e test-fuzz test-compat: $(STAMP)  ## one tier
	$(BIN)/python -m pytest $(XDIST) tests/$(@:test-%=%) $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)

bench-short: $(STAMP)
	$(BIN)/python -m bench --short $(ARGS)

protos: $(STAMP)  ## regenerate client/src/spillway/v1 from protos/
	PYTHON=$(BIN)/python scripts/gen_protos.sh

clean:
	rm -rf $(VENV) .pytest_cache
