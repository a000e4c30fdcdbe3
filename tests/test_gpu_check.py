"""checks/gpu_check.py, the one-call GPU check, in its CPU smoke mode: the report is written
and says what ran, and the parts that can fail on the bf16 path's bugs fail here too, in bf16 on
CPU (autocast): the learning canary, dapo.py's steps with real advantages and their resume, a
transformers-made bf16 checkpoint, FSDP2 on one process. Each a tiny model, a few seconds; the
kernels' and the sampler's smoke runs take minutes on CPU (torch.compile), and the 2-process
parts run in `make gpu-check SMOKE=1` (the canary's 2 ranks also in test_precision.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHEAP = ("canary", "dapo", "parity", "fsdp")


def smoke(tmp_path, *only) -> tuple[subprocess.CompletedProcess, str]:
    report = tmp_path / "gpu_check.md"
    # as a user runs it: conftest's TRITON_INTERPRET=1 would put the fused head's log-probs through
    # the Triton interpreter (~4x the time; the kernels have tests of their own); one thread, as
    # every test (pytest-xdist runs another file on the other core)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "checks.gpu_check", "--smoke", "--only", *only,
                           "--out", str(report)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    return done, report.read_text() if report.exists() else ""


@pytest.mark.needs("all")  # it runs DAPO steps
def test_gpu_check_smoke_runs_its_cheap_parts_in_bf16_and_writes_one_report(tmp_path):
    done, text = smoke(tmp_path, *CHEAP)
    assert done.returncode == 0, done.stdout + done.stderr + text  # the failing part's output
    assert text.startswith("# GPU check: CPU smoke run")
    for name in CHEAP:
        assert f"| {name} | ok |" in text, name
    for name in ("sampler", "kernels", "canary-2", "dapo-2"):
        assert f"| {name} | skipped (--only) |" in text, name
    assert "learning canary (bf16, cpu, 1 process(es))" in text
    assert "--precision bf16" in text and "FAILED" not in text
    # dapo.py's steps had a gradient, and the resumed step was the straight run's
    assert "B step 2: gradient norm" in text and "resume: weights after" in text
    assert "bf16: rms(ours - transformers)" in text and "rollout in gathered()" in text
    assert text.rstrip().endswith("all parts that ran passed")
