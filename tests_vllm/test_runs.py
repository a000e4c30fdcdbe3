"""dapo.py --rollout-engine vllm end to end: two ranks train and resume, and a bad memory share
is one line."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import MEMORY, ROOT
from model import Transformer

ARGS = ["--rollout-engine", "vllm", "--train-prompts", "4", "--gen-prompts", "4",
        "--group-size", "4", "--max-response-len", "10", "--overlong-buffer", "4",
        "--mini-batch-prompts", "2", "--micro-batch-size", "3", "--eval-every", "0",
        "--lr", "1e-3", "--no-dynamic-sampling"]


def run(*args, ranks=1, timeout=400):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else []
    try:
        return subprocess.run([sys.executable, *launcher, "dapo.py", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"dapo.py {' '.join(args)} hung for {timeout}s")


def weights(out_dir, step):
    return Transformer.from_pretrained(
        os.path.join(out_dir, "checkpoints", f"step_{step:06d}", "model"))


def test_two_ranks_train_with_vllm_and_resume(tiny_dir, tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    for args in (["--out-dir", straight, "--steps", "2"], ["--out-dir", resumed, "--steps", "1"],
                 ["--out-dir", resumed, "--steps", "2", "--resume"]):
        out = run("--model", tiny_dir, *ARGS, *args, "--vllm-gpu-memory-utilization",
                  str(MEMORY), ranks=2)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(resumed, "metrics.jsonl"))]
    assert "config" in rows[0]  # the run's settings first, then a row a step
    rows = rows[1:]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:  # both ranks trained, on vLLM's log-probs, corrected (token_truncate)
        assert row["train/updates"] == 2
        assert row["training/rollout_logp_diff_max"] < 1e-4  # fp32 round-off (test_engine.py)
        assert row["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
    # the engine's seeds come from the checkpointed generator: the resumed run draws the same
    # tokens, so it ends on the same weights
    a, b = weights(straight, 2), weights(resumed, 2)
    start = Transformer.from_pretrained(tiny_dir)
    for (name, p), q, p0 in zip(a.named_parameters(), b.parameters(), start.parameters()):
        assert not torch.equal(p, p0), name
        assert torch.equal(p, q), name


@pytest.mark.parametrize("share, says", [
    (0.99, "error: the memory plan needs "),  # more than the device: refused before vLLM starts
    (0.01, "error: vLLM could not start with --vllm-gpu-memory-utilization 0.01: "),  # vLLM's
    (1.5, "error: bad flags: --vllm-gpu-memory-utilization must be in (0, 1], got 1.5"),
])
def test_a_bad_memory_share_is_one_line(tiny_dir, tmp_path, share, says):
    out = run("--model", tiny_dir, *ARGS, "--vllm-gpu-memory-utilization", str(share),
              "--out-dir", str(tmp_path), "--steps", "1")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-1].startswith(says), out.stderr[-3000:]
    assert not any(line.startswith("Traceback") for line in lines), out.stderr[-3000:]
