"""
How a run uses a CPU: its threads, and whether bf16 is fast on it (--precision auto asks,
infra/precision.py).

A model under SMALL_MODEL_PARAMS (the demo's 0.43M, the tests' tiny ones) spends a step in Python
and small kernels: its matmuls are too small to share between threads, and a thread that waits for
a busy core stalls every kernel. Measured on this project's 2-core machine with other programs
running (load 8): 3 demo steps took 58-66 s on one thread and 393 s on two. So such a model runs on
one thread unless OMP_NUM_THREADS says otherwise; a bigger one keeps torch's default (every core).
"""
import functools
import os
import time

import torch

SMALL_MODEL_PARAMS = 50_000_000


def set_threads(params: int) -> int:
    """One torch thread for a model of fewer than SMALL_MODEL_PARAMS parameters, unless
    OMP_NUM_THREADS is set (torchrun sets it to 1 for each of its processes) -> the threads."""
    if params < SMALL_MODEL_PARAMS and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    return torch.get_num_threads()


@functools.cache
def bf16_speedup(rows: int = 256, dim: int = 576, hidden: int = 1536) -> float:
    """fp32's time over bf16 autocast's for a (rows, dim) @ (dim, hidden) matmul (SmolLM2's MLP
    shape) on one thread of this CPU, the best of a few tries each, in CPU time: robust to a busy
    machine. ~50 ms with native bf16; with AVX2 only, one bf16 try says enough (~0.3 s). The weight
    requires grad, as a model's: autocast casts it once and keeps the copy."""
    x, w = torch.randn(rows, dim), torch.randn(hidden, dim, requires_grad=True)

    def best_time(bf16: bool, tries: int, give_up_after: float = float("inf")) -> float:
        best = float("inf")
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            torch.nn.functional.linear(x, w)  # the first call pays for the kernels' set-up
            for _ in range(tries):
                t0 = time.process_time()
                torch.nn.functional.linear(x, w)
                best = min(best, time.process_time() - t0)
                if best > give_up_after:
                    break
        return best

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = best_time(bf16=False, tries=5)
        return fp32 / best_time(bf16=True, tries=5, give_up_after=4 * fp32)
    finally:
        torch.set_num_threads(threads)
