"""The Triton log-prob + entropy kernels on a CUDA GPU, at training size: correctness, then speed. One run, one table.
Not part of `make bench` (that runs benchmarks/bench_*.py on CPU); run it by hand on a GPU machine:

    python benchmarks/gpu_kernels.py [--rows 16384 --vocab 151936 --dtype bf16 --block-v 2048 4096 8192 16384]

1. Correctness on (rows, vocab) random logits against the chunked fp32 PyTorch reference (kernels/reference.py) on the
   same GPU, forward and backward, reported separately for the rows from (2^31 - 1) // vocab on (14,134 at V = 151936):
   the first rows whose element offsets no longer fit in int32. A few of those rows are also checked against float64.
2. Speed with triton.testing.do_bench (median, L2 flushed): GB/s = the bytes a pass must move / its time (forward:
   read the logits once; backward: read them and write their gradient), against a torch copy of the same logits,
   which is what this card's memory really delivers (goal >= 80% of it), and against torch.compile of the naive
   log_softmax + gather + -(p * logp).sum(), in time and in peak memory.
Exits 1 when a correctness check fails.
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import logprobs_and_entropy, reference  # noqa: E402
from kernels.logprobs import DEFAULT_BLOCK_V, TRITON_INTERPRET, as_rows, triton_logprobs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GB = 1e9


def naive(logits, targets, temperature):
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V) fp32
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def float64_rows(logits, targets, temperature, rows):
    z = logits[rows].double() / temperature  # (k, V)
    logp_all = torch.log_softmax(z, dim=-1)
    return logp_all.gather(-1, targets[rows, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def grad_ulps(got, ref):
    """Largest |got - ref| in units of ref's precision (2^-7 |ref| for bf16): two roundings of nearly the same fp32
    value to the logits' dtype differ by at most 1."""
    finfo = torch.finfo(ref.dtype)  # + tiny: below the smallest normal number, precision is absolute, not relative
    return ((got.float() - ref.float()).abs() / (finfo.eps * ref.float().abs() + finfo.tiny)).max().item()


def check_correctness(logits, targets, temperature, block_v):
    """-> [(what, value, limit)]: a check passes when value <= limit."""
    N, V = logits.shape
    first_wide = (2**31 - 1) // V  # the first row holding an element whose offset exceeds int32
    rows = as_rows(logits)
    checks = []
    logp, entropy, lse, mean_z = triton_logprobs.forward(rows, targets, temperature, block_v)
    ref = reference.forward(rows, targets, temperature)
    for name, got, want in (("logp", logp, ref[0]), ("entropy", entropy, ref[1])):
        err = (got - want).abs()
        checks.append((f"forward {name} vs fp32 reference, all rows: max abs err", err.max().item(), 1e-4))
        if N > first_wide:
            checks.append((f"forward {name}, rows >= {first_wide} (offsets > 2^31): max abs err",
                           err[first_wide:].max().item(), 1e-4))
    spot = torch.tensor(sorted({0, min(first_wide, N - 1), min(first_wide + 1, N - 1), N - 1}), device=logits.device)
    ref64 = float64_rows(logits, targets, temperature, spot)
    for name, got, want in (("logp", logp[spot], ref64[0]), ("entropy", entropy[spot], ref64[1])):
        checks.append((f"forward {name} vs float64 on rows {spot.tolist()}: max abs err",
                       (got.double() - want).abs().max().item(), 1e-4))
    del ref
    g = torch.Generator(device=logits.device).manual_seed(0)
    grad_logp, grad_entropy = torch.randn(2, N, device=logits.device, generator=g)
    for name, g_ent in (("logp only (training)", None), ("logp and entropy", grad_entropy)):
        got = triton_logprobs.backward(rows, targets, lse, mean_z, grad_logp, g_ent, temperature, block_v)
        want = reference.backward(rows, targets, lse, mean_z, grad_logp, g_ent, temperature)
        checks.append((f"backward, grad of {name}: max err in {logits.dtype} ulps", grad_ulps(got, want), 1.0))
        if N > first_wide:
            checks.append((f"backward, grad of {name}, rows >= {first_wide}: max err in ulps",
                           grad_ulps(got[first_wide:], want[first_wide:]), 1.0))
        del got, want
    return checks


def peak_memory_gb(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / GB


def benchmark(logits, targets, temperature, blocks):
    """-> [(what, ms, GB/s, peak extra GB or None)]; the first row is the torch copy."""
    from triton.testing import do_bench

    nbytes = logits.numel() * logits.element_size()
    table = []

    def add(what, fn, passes, memory=False):  # passes: how many times the pass must move the logits' bytes
        t = do_bench(fn, warmup=25, rep=200, return_mode="median")
        table.append((what, t, passes * nbytes / GB / (t / 1e3), peak_memory_gb(fn) if memory else None))

    copy = torch.empty_like(logits)
    add("torch copy (read + write)", lambda: copy.copy_(logits), 2)
    del copy
    rows = as_rows(logits)
    grad_logp = torch.randn(logits.shape[0], device=logits.device)
    for block_v in blocks:
        _, _, lse, mean_z = triton_logprobs.forward(rows, targets, temperature, block_v)
        add(f"triton forward, block {block_v}", lambda: triton_logprobs.forward(rows, targets, temperature, block_v), 1)
        for name, g_ent in (("logp", None), ("logp+entropy", grad_logp)):
            add(f"triton backward ({name}), block {block_v}", lambda: triton_logprobs.backward(
                rows, targets, lse, mean_z, grad_logp, g_ent, temperature, block_v), 2)

    x = logits.detach().requires_grad_()  # the training pass: forward, then the gradient of a loss on logp only
    add(f"ours, forward+backward, block {DEFAULT_BLOCK_V}", lambda: torch.autograd.grad(
        (grad_logp * logprobs_and_entropy(x, targets, temperature)[0]).sum(), x), 3, memory=True)
    compiled = torch.compile(naive)
    add("torch.compile(naive), forward", lambda: compiled(logits, targets, temperature), 1, memory=True)
    add("torch.compile(naive), forward+backward", lambda: torch.autograd.grad(
        (grad_logp * compiled(x, targets, temperature)[0]).sum(), x), 3, memory=True)
    return table


def print_speed(table):
    copy_gbs = table[0][2]
    print(f"\nspeed (GB/s = bytes the pass must move / time; % of the torch copy's {copy_gbs:.0f} GB/s, goal >= 80%)")
    print(f"  {'':44}{'ms':>9}{'GB/s':>9}{'% copy':>8}{'peak extra GB':>15}")
    for what, t, gbs, peak in table:
        peak_s = f"{peak:15.2f}" if peak is not None else ""
        print(f"  {what:44}{t:9.3f}{gbs:9.0f}{100 * gbs / copy_gbs:7.0f}%{peak_s}")
    for kind in ("triton forward", "triton backward (logp)"):
        best = max((row for row in table if row[0].startswith(kind)), key=lambda row: row[2])
        verdict = "meets" if best[2] >= 0.8 * copy_gbs else "BELOW"
        print(f"  best {kind}: block {best[0].split()[-1]}, {100 * best[2] / copy_gbs:.0f}% of copy "
              f"({verdict} the 80% goal)")
    ours, naive_c = table[-3], table[-1]  # forward+backward: ours, and torch.compile(naive)
    print(f"  forward+backward: {naive_c[1] / ours[1]:.2f}x the speed of torch.compile(naive), "
          f"{ours[3] / naive_c[3]:.2f}x its peak memory")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16384, help="rows (tokens); 16384 x 151936 passes 2^31 elements")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen2.5's by default)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="the logits' dtype")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--block-v", type=int, nargs="+", default=[2048, 4096, 8192, 16384],
                   help=f"vocabulary block sizes to time (the checks use the default, {DEFAULT_BLOCK_V})")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False here). "
                 "On CPU, run benchmarks/bench_kernels.py and tests/test_kernels.py instead.")
    if triton_logprobs is None:
        sys.exit("gpu_kernels.py needs triton (pip install triton)")
    if TRITON_INTERPRET:
        sys.exit("unset TRITON_INTERPRET: under the interpreter the kernels would run on the CPU")

    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    logits = (torch.randn(args.rows, args.vocab, device="cuda") * 3).to(dtype)  # (N, V)
    targets = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    size_gb = logits.numel() * logits.element_size() / GB
    print(f"{torch.cuda.get_device_name()}: logits ({args.rows}, {args.vocab}) {args.dtype} = {size_gb:.2f} GB, "
          f"T = {args.temperature}")

    checks = check_correctness(logits, targets, args.temperature, DEFAULT_BLOCK_V)
    print(f"\ncorrectness (block {DEFAULT_BLOCK_V})")
    for what, value, limit in checks:
        print(f"  {'ok  ' if value <= limit else 'FAIL'} {what:78} {value:10.2e}  (limit {limit:g})")  # NaN fails

    print_speed(benchmark(logits, targets, args.temperature, args.block_v))
    if not all(value <= limit for _, value, limit in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
