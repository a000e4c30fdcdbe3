"""
Peak extra CPU memory and time of the fused kernels on their CPU path (the chunked PyTorch
reference), in two tables:
1. logprobs_and_entropy against the naive log_softmax + gather + -(p * logp).sum(), on bf16 logits
   of Qwen2.5's vocabulary;
2. linear_logprobs_and_entropy (the output layer fused in, chunks of tokens) against the unfused
   path that dapo.response_logprobs takes, `logits = hidden @ weight.T` then logprobs_and_entropy,
   forward + backward at a Qwen2.5-0.5B head (C = 896, V = 151936) in fp32. Time is CPU time on one
   thread (process_time: steady on a shared machine), in rounds that alternate the order of the
   variants.

    .venv/bin/python -m benchmarks.bench_kernels [--rows 2048 --vocab 151936 --tokens 4096
                                                  --hidden 896 --rounds 2]
    .venv/bin/python -m benchmarks.bench_kernels --part head      # the second table only

How the memory is measured, and why this way: torch allocates tensors outside Python's allocator, so
tracemalloc sees none of them; what is real is the process's resident memory. Each cell runs in a
fresh subprocess, which allocates and fills its inputs first (the logits; or the hidden states and
the weight), then resets the kernel's RSS high-water mark (writing 5 to /proc/self/clear_refs), runs
the pass once, and reports VmHWM - VmRSS: the most memory the pass ever held beyond its inputs,
autograd's saved tensors, the gradients and allocator slack included. (Tensors this large are mmap'd
by malloc and unmapped on free, so RSS follows the live tensors.) Where clear_refs cannot be
written, it falls back on ru_maxrss, the high-water since the process started, which still works
because the inputs are by far the biggest things allocated before the pass.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.common import proc_status_kib, reset_peak_rss
from dapo_kernels import linear_logprobs_and_entropy, logprobs_and_entropy

MB = 2**20
VARIANTS = {  # name -> f(logits (N, V), targets (N,)) -> (logp, entropy), both (N,) fp32
    # what a careful naive version writes: the softmax in fp32
    "naive, fp32": lambda x, t: naive(x.float(), t),
    # cheaper and less accurate: the softmax in the logits' dtype
    "naive, bf16": lambda x, t: naive(x, t),
    "fused (CPU path)": lambda x, t: logprobs_and_entropy(x, t, backend="torch"),
}
PASSES = ("forward", "forward+backward")
# name -> f(hidden (N, C), weight (V, C), targets (N,)) -> (logp, entropy), both (N,) fp32
HEADS = {
    # today's response_logprobs
    "unfused": lambda h, w, t: logprobs_and_entropy(h @ w.T, t, backend="torch"),
    "fused": lambda h, w, t: linear_logprobs_and_entropy(h, w, t, backend="torch"),
}


def naive(logits, targets):
    logp_all = torch.log_softmax(logits, dim=-1)  # (N, V)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
    return logp.float(), entropy.float()


def subprocess_json(*args):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_kernels", *map(str, args)],
                         cwd=root, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{' '.join(map(str, args))} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def measure(variant, pass_, rows, vocab):
    """Runs in the subprocess: -> {"extra_mb", "seconds", "exact"}."""
    torch.manual_seed(0)
    # 64 random rows repeated: filling 300M elements with normal_ takes seconds, and the values
    # don't change memory
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
            # the training case: logp in the loss, the entropy only logged (the paper's objective,
            # Eq. 8, has no entropy term)
            if backward:
                (weights * logp).sum().backward()
        return entropy

    # warm-up on 8 rows: the first call of each op pages in its code from libtorch, tens of MB of
    # RSS not to count
    run(logits[:8].detach().requires_grad_(backward), targets[:8], weights[:8])
    logits.requires_grad_(backward)
    exact = reset_peak_rss()
    rss_before = proc_status_kib("VmRSS")
    t0 = time.perf_counter()
    entropy = run(logits, targets, weights)
    seconds = time.perf_counter() - t0
    peak_kb = proc_status_kib("VmHWM") if exact else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert torch.isfinite(entropy).all()
    return {"extra_mb": (peak_kb - rss_before) / 1024, "seconds": seconds, "exact": exact}


def logits_table(args):
    size_mb = args.rows * args.vocab * 2 / MB
    print(f"logprobs + entropy, bf16 logits ({args.rows}, {args.vocab}) = {size_mb:.0f} MB, CPU, "
          f"threads={torch.get_num_threads()}; extra = peak RSS beyond the input, "
          f"one subprocess per cell")
    results = {}
    for variant in VARIANTS:
        for pass_ in PASSES:
            results[variant, pass_] = subprocess_json("--rows", args.rows, "--vocab", args.vocab,
                                                      "--one", variant, pass_)
    print(f"  {'':18}" + "".join(f"{pass_:>24}" for pass_ in PASSES))
    print(f"  {'':18}" + f"{'extra MB':>16}{'s':>8}" * len(PASSES))
    for variant in VARIANTS:
        print(f"  {variant:18}" + "".join(f"{results[variant, pass_]['extra_mb']:16.0f}"
                                          f"{results[variant, pass_]['seconds']:8.1f}"
                                          for pass_ in PASSES))
    print(f"  (forward+backward includes the logits' gradient, {size_mb:.0f} MB of bf16, "
          f"in every row)")
    fused = "fused (CPU path)"
    for baseline in ("naive, fp32", "naive, bf16"):
        ratios = [results[fused, pass_]["extra_mb"] / results[baseline, pass_]["extra_mb"]
                  for pass_ in PASSES]
        print(f"  ratio fused / {baseline}: "
              + ", ".join(f"{pass_} {r:.2f}" for pass_, r in zip(PASSES, ratios))
              + "   (goal <= 0.25)")
    if not all(r["exact"] for r in results.values()):
        print("  note: /proc/self/clear_refs was not writable; peaks come from ru_maxrss")


def measure_head(variant, tokens, hidden_size, vocab):
    """Runs in the subprocess, on one thread: forward + backward of the policy-gradient loss on logp
    through HEADS[variant] -> {"extra_mb", "grads_mb", "cpu_s", "exact"}. grads_mb: the gradients of
    the weight and the hidden states, which any method returns and which extra_mb includes."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # (V, C), as an lm_head's init
    weight = (torch.randn(vocab, hidden_size) * 0.02).requires_grad_()
    hidden = torch.randn(tokens, hidden_size).requires_grad_()  # (N, C)
    targets = torch.randint(0, vocab, (tokens,))
    adv = torch.randn(tokens)  # stands for the advantages

    def run(n):
        logp, entropy = HEADS[variant](hidden[:n], weight, targets[:n])
        # the training case: logp in the loss, the entropy only logged
        (adv[:n] * logp).sum().backward()
        return entropy

    # warm-up: pages in each op's code (tens of MB of RSS not to count); its gradients are dropped
    # below
    run(8)
    weight.grad = hidden.grad = None
    exact = reset_peak_rss()
    rss_before = proc_status_kib("VmRSS")
    t0 = time.process_time()
    entropy = run(tokens)
    cpu_s = time.process_time() - t0
    peak_kb = proc_status_kib("VmHWM") if exact else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert torch.isfinite(entropy).all()
    grads_mb = (weight.grad.nbytes + hidden.grad.nbytes) / MB
    return {"extra_mb": (peak_kb - rss_before) / 1024, "grads_mb": grads_mb, "cpu_s": cpu_s,
            "exact": exact}


def head_table(args):
    N, C, V = args.tokens, args.hidden, args.vocab
    print(f"\noutput layer + logprobs + entropy, forward+backward: hidden ({N}, {C}), "
          f"weight ({V}, {C}) fp32, CPU,\n"
          f"1 thread; one subprocess per cell, {args.rounds} rounds alternating the order")
    results = {name: [] for name in HEADS}
    for r in range(args.rounds):
        for variant in (list(HEADS) if r % 2 == 0 else list(HEADS)[::-1]):
            results[variant].append(subprocess_json("--tokens", N, "--hidden", C, "--vocab", V,
                                                    "--one-head", variant))
    print(f"  {'':10}{'extra MB':>10}{'CPU s, each round':>26}")
    extra, cpu = {}, {}
    for variant, runs in results.items():
        # the least noisy: RSS only ever adds allocator slack
        extra[variant] = min(r["extra_mb"] for r in runs)
        cpu[variant] = statistics.median(r["cpu_s"] for r in runs)
        rounds = "  ".join(f"{r['cpu_s']:.1f}" for r in runs)
        print(f"  {variant:10}{extra[variant]:10.0f}{rounds:>26}")
    grads_mb = results["fused"][0]["grads_mb"]
    print(f"  fused / unfused: extra memory {extra['fused'] / extra['unfused']:.2f}x "
          f"(goal <= 0.1x), CPU time {cpu['fused'] / cpu['unfused']:.2f}x "
          f"(median of the rounds; goal <= 1.2x)")
    # where the fused path's peak goes: the gradients it returns are allocated for the whole
    # backward, while the unfused path peaks earlier, on its logits and their gradient, before its
    # weight gradient exists
    print(f"  of the fused extra, {grads_mb:.0f} MB ({grads_mb / extra['unfused']:.2f}x the "
          f"unfused extra) are the gradients of the weight and\n  the hidden states, which every "
          f"method returns; the rest (the chunks) is "
          f"{(extra['fused'] - grads_mb) / extra['unfused']:.2f}x. Time: recomputing the "
          f"logits\n  in the backward makes 4 matmuls of the unfused path's 3, and on a CPU the "
          f"matmuls are most of the time")
    if not all(r["exact"] for runs in results.values() for r in runs):
        print("  note: /proc/self/clear_refs was not writable; peaks come from ru_maxrss")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", type=int, default=4096,
                   help="tokens through the output layer (table 2)")
    p.add_argument("--hidden", type=int, default=896,
                   help="hidden size (table 2; Qwen2.5-0.5B's by default)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of table 2, alternating the variants' order")
    p.add_argument("--part", choices=("all", "logits", "head"), default="all")
    # the subprocess side
    p.add_argument("--one", nargs=2, metavar=("VARIANT", "PASS"), help=argparse.SUPPRESS)
    p.add_argument("--one-head", choices=HEADS, help=argparse.SUPPRESS)  # the subprocess side
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.rows, args.vocab)))
        return
    if args.one_head:
        print(json.dumps(measure_head(args.one_head, args.tokens, args.hidden, args.vocab)))
        return
    if args.part in ("all", "logits"):
        logits_table(args)
    if args.part in ("all", "head"):
        head_table(args)


if __name__ == "__main__":
    main()
