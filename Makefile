# Two commands for a new user: `make run` (the embedded DAPO demo on CPU) and `make test`.
# Each creates .venv/ once and installs what it needs; running them again installs nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: run test bench ablate clean

$(VENV)/.runtime: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	touch $@

$(VENV)/.test: requirements-test.txt requirements-extra.txt $(VENV)/.runtime
	$(PIP) install -q -r requirements-test.txt
	touch $@

$(VENV)/.extra: requirements-extra.txt $(VENV)/.runtime
	$(PIP) install -q -r requirements-extra.txt
	touch $@

# The embedded demo: a tiny Qwen2 is warmed up on a toy task (once; cached in runs/demo-base), then trained with
# DAPO; prints val/acc before -> after and writes runs/demo/metrics.jsonl (`python plot.py` draws it).
run: $(VENV)/.runtime
	$(PY) dapo.py --out-dir runs/demo --overwrite

# pytest exits 5 when it collects no test: that is a failure of the suite here, not a pass, so it is left as is.
test: $(VENV)/.test
	$(PY) -m pytest -q tests

bench: $(VENV)/.test
	for f in benchmarks/bench_*.py; do $(PY) $$f || exit 1; done

# Each DAPO technique judged on what it acts on: DAPO against DAPO with one technique off, on the ablation's own toy
# task (ablate_toy.py), 4 seeds each, two runs at a time on one thread each; plus clip-higher in isolation
# (ablate_isolated.py). Writes runs/ablate/table.md, ablation.png, clip_bandit.png (matplotlib: requirements-extra.txt).
ablate: $(VENV)/.extra
	OMP_NUM_THREADS=1 $(PY) ablate.py

clean:
	rm -rf $(VENV) .pytest_cache runs
