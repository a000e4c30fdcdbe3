"""Peak extra CPU memory (and time) of kernels.logprobs_and_entropy on its CPU path, the chunked PyTorch reference,
against the naive log_softmax + gather + -(p * logp).sum(), on bf16 logits of Qwen2.5's vocabulary.

    .venv/bin/python benchmarks/bench_kernels.py [--rows 2048 --vocab 151936]

How the memory is measured, and why this way: torch allocates tensors outside Python's allocator, so tracemalloc sees
none of them; what is real is the process's resident memory. Each (variant, pass) runs in a fresh subprocess, which
allocates and fills the logits first, then resets the kernel's RSS high-water mark (writing 5 to /proc/self/clear_refs),
runs the pass once, and reports VmHWM - VmRSS: the most memory the pass ever held beyond the input, autograd's saved
tensors and allocator slack included. (Tensors this large are mmap'd by malloc and unmapped on free, so RSS follows
the live tensors.) Where clear_refs cannot be written, it falls back on ru_maxrss, the high-water since the process
started, which still works because the input is by far the biggest thing allocated before the pass.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import logprobs_and_entropy  # noqa: E402

MB = 2**20
VARIANTS = {  # name -> f(logits (N, V), targets (N,)) -> (logp, entropy), both (N,) fp32
    "naive, fp32": lambda x, t: naive(x.float(), t),  # what a careful naive version writes: the softmax in fp32
    "naive, bf16": lambda x, t: naive(x, t),  # cheaper and less accurate: the softmax in the logits' dtype
    "fused (CPU path)": lambda x, t: logprobs_and_entropy(x, t, backend="torch"),
}
PASSES = ("forward", "forward+backward")


def naive(logits, targets):
    logp_all = torch.log_softmax(logits, dim=-1)  # (N, V)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
    return logp.float(), entropy.float()


def memory_kb():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0])


def measure(variant, pass_, rows, vocab):
    """Runs in the subprocess: -> {"extra_mb", "seconds", "exact"}."""
    torch.manual_seed(0)
    # 64 random rows repeated: filling 300M elements with normal_ takes seconds, and the values don't change memory
    block = (torch.randn(64, vocab) * 2).to(torch.bfloat16)
    logits = torch.empty(rows, vocab, dtype=torch.bfloat16)  # (N, V)
    for r in range(0, rows, 64):
        logits[r:r + 64] = block[:rows - r]
    targets = torch.randint(0, vocab, (rows,))
    weights = torch.randn(rows)  # stands for the advantages in the policy-gradient loss
    backward = pass_ == "forward+backward"

    def run(logits, targets, weights):
        with torch.set_grad_enabled(backward):
            logp, entropy = VARIANTS[variant](logits, targets)
            if backward:  # the training case: logp in the loss, the entropy only logged (SPEC 1)
                (weights * logp).sum().backward()
        return entropy

    # warm-up on 8 rows: the first call of each op pages in its code from libtorch, tens of MB of RSS not to count
    run(logits[:8].detach().requires_grad_(backward), targets[:8], weights[:8])
    logits.requires_grad_(backward)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        exact = True
    except OSError:
        exact = False
    rss_before, _ = memory_kb()
    t0 = time.perf_counter()
    entropy = run(logits, targets, weights)
    seconds = time.perf_counter() - t0
    peak_kb = memory_kb()[1] if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert torch.isfinite(entropy).all()
    return {"extra_mb": (peak_kb - rss_before) / 1024, "seconds": seconds, "exact": exact}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--one", nargs=2, metavar=("VARIANT", "PASS"), help=argparse.SUPPRESS)  # the subprocess side
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.rows, args.vocab)))
        return

    size_mb = args.rows * args.vocab * 2 / MB
    print(f"logprobs + entropy, bf16 logits ({args.rows}, {args.vocab}) = {size_mb:.0f} MB, CPU, "
          f"threads={torch.get_num_threads()}; extra = peak RSS beyond the input, one subprocess per cell")
    results = {}
    for variant in VARIANTS:
        for pass_ in PASSES:
            out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--vocab", str(args.vocab),
                                  "--one", variant, pass_], capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{variant} / {pass_} failed:\n{out.stderr}")
            results[variant, pass_] = json.loads(out.stdout)
    print(f"  {'':18}" + "".join(f"{pass_:>24}" for pass_ in PASSES))
    print(f"  {'':18}" + f"{'extra MB':>16}{'s':>8}" * len(PASSES))
    for variant in VARIANTS:
        print(f"  {variant:18}" + "".join(f"{results[variant, pass_]['extra_mb']:16.0f}"
                                          f"{results[variant, pass_]['seconds']:8.1f}" for pass_ in PASSES))
    print(f"  (forward+backward includes the logits' gradient, {size_mb:.0f} MB of bf16, in every row)")
    fused = "fused (CPU path)"
    for baseline in ("naive, fp32", "naive, bf16"):
        ratios = [results[fused, pass_]["extra_mb"] / results[baseline, pass_]["extra_mb"] for pass_ in PASSES]
        print(f"  ratio fused / {baseline}: " + ", ".join(f"{pass_} {r:.2f}" for pass_, r in zip(PASSES, ratios))
              + "   (goal <= 0.25)")
    if not all(r["exact"] for r in results.values()):
        print("  note: /proc/self/clear_refs was not writable; peaks come from ru_maxrss")


if __name__ == "__main__":
    main()
