# Two commands for a new user: `make run` (the embedded DAPO demo on CPU) and `make test`.
# Each creates .venv/ once and installs what it needs; running them again installs nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: run test bench clean

$(VENV)/.runtime: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	touch $@

$(VENV)/.test: requirements-test.txt $(VENV)/.runtime
	$(PIP) install -q -r requirements-test.txt
	touch $@

run: $(VENV)/.runtime
	$(PY) model.py

# pytest exits 5 when it collects no test: that is a failure of the suite here, not a pass, so it is left as is.
test: $(VENV)/.test
	$(PY) -m pytest -q tests

bench: $(VENV)/.test
	for f in benchmarks/bench_*.py; do $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache runs
