"""Two ranks, for the tests of several processes (test_distributed.py, test_launch.py,
test_precision.py, test_dapo.py): torchrun, or a pair of plain processes running one of
tests/dist_fail_worker.py's modes, which meet on a store the test holds (conftest.py's store_env);
and the flags of a few tiny steps."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(*args, timeout=300):
    """Run under torchrun with 2 processes; a hang (ranks out of lockstep) fails at the timeout
    instead of blocking."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *args]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun {' '.join(args)} hung for {timeout}s")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


# a few tiny steps of the tiny model on 2 ranks
SMALL_RUN = ["--train-prompts", "4", "--gen-prompts", "4", "--group-size", "4",
             "--max-gen-batches", "2", "--max-response-len", "10", "--overlong-buffer", "4",
             "--mini-batch-prompts", "2", "--micro-batch-size", "3", "--eval-every", "2",
             "--eval-prompts", "6", "--eval-samples", "2", "--lr", "1e-3", "--no-dynamic-sampling"]


def start_pair(mode, timeout_s, store_env, *args):
    """Ranks 0 and 1 of tests/dist_fail_worker.py's mode, started (stdout and stderr together)."""
    env = {**os.environ, **store_env, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
           "TRITON_INTERPRET": "0"}
    return [subprocess.Popen([sys.executable, "tests/dist_fail_worker.py", mode, str(timeout_s),
                              *args],
                             cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(2)]


def first_ranks_output(procs) -> str:
    """Rank 0's output once it ends (120 s at most); then every rank is killed (SIGKILL ends a
    stopped process too)."""
    try:
        return procs[0].communicate(timeout=120)[0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
