"""benchmarks/gpu_check.py, the one-call GPU check, in its CPU smoke mode: the report is written
and says what ran. Only its cheapest parts (FSDP2 on one process and a DAPO step, a tiny model,
~10 s each) run here; the kernels' and the sampler's smoke runs take minutes on CPU
(torch.compile)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.needs("all")  # it runs DAPO steps
def test_gpu_check_smoke_writes_one_report(tmp_path):
    report = tmp_path / "gpu_check.md"
    # as a user runs it: conftest's TRITON_INTERPRET=1 would put the fused head's log-probs through
    # the Triton interpreter (~4x the time; the kernels have tests of their own)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke",
                           "--only", "gpu_fsdp.py", "gpu_dapo.py", "--out", str(report)],
                          capture_output=True, text=True, timeout=300, env=env)
    text = report.read_text() if report.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + text  # the failing part's output
    assert text.startswith("# GPU check: CPU smoke run")
    for script in ("gpu_fsdp.py", "gpu_dapo.py"):
        assert f"{script} --device cpu" in text, script
    assert text.count("exit 0") == 2 and text.count("skipped (--only)") == 2
    assert "FAILED" not in text and "rollout in gathered()" in text
    assert text.rstrip().endswith("all checks exited 0")
