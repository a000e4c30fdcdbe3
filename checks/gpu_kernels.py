"""The fused kernels on a CUDA GPU, at training size: correctness, then speed and memory. One run,
two parts. Not part of `make bench` (that runs benchmarks/bench_*.py on CPU); run it by hand on a
GPU machine:

    python -m checks.gpu_kernels [--rows 16384 --vocab 151936 --dtype bf16
                                      --block-v 2048 4096 8192 16384]
    python -m checks.gpu_kernels --part head [--hidden 896 --chunk-tokens 0 1024 4096]
    # on CPU, tiny shapes: checks that the script itself runs
    python -m checks.gpu_kernels --smoke

Part "logits": the Triton log-prob + entropy kernels on (rows, vocab) logits.
1. Correctness against the chunked fp32 PyTorch reference (dapo_kernels/reference.py) on the same
   GPU, forward and backward, reported separately for the rows from (2^31 - 1) // vocab on (14,134
   at V = 151936): the first rows whose element offsets no longer fit in int32. A few of those rows
   are also checked against float64.
2. Speed with triton.testing.do_bench (median, L2 flushed): GB/s = the bytes a pass must move / its
   time (forward: read the logits once; backward: read them and write their gradient), against a
   torch copy of the same logits, which is what this card's memory really delivers (goal >= 80% of
   it), and against torch.compile of the naive log_softmax + gather + -(p * logp).sum(), in time and
   in peak memory.
Part "head": linear_logprobs_and_entropy (the output layer fused in, dapo_kernels/linear.py) on
hidden states (rows, hidden) and a (vocab, hidden) weight, forward + backward of a loss on logp (the
training pass).
1. Correctness: the fused and the unfused path (`hidden @ weight.T` then logprobs_and_entropy) in
   --dtype, each against the unfused path in fp32 on the same (rounded) inputs: the fused one must
   be as accurate as the unfused one, on all rows and on the rows past 14,134; and the fused path in
   fp32 must equal that fp32 reference.
2. Time (do_bench) and peak memory beyond the inputs: fused (several chunk sizes), unfused,
   torch.compile of the unfused naive path.
Exits 1 when a correctness check fails.
"""
import argparse
import functools
import math
import sys
import time

import torch

from dapo_kernels import linear_logprobs_and_entropy, logprobs_and_entropy, reference
from dapo_kernels.linear import default_chunk_tokens, has_mixed_addmm
from dapo_kernels.logprobs import DEFAULT_BLOCK_V, TRITON_INTERPRET, as_rows, triton_logprobs

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
    """Largest |got - ref| in units of ref's precision (2^-7 |ref| for bf16): two roundings of
    nearly the same fp32 value to the logits' dtype differ by at most 1."""
    finfo = torch.finfo(ref.dtype)
    # + tiny: below the smallest normal number, precision is absolute, not relative
    ulp = finfo.eps * ref.float().abs() + finfo.tiny
    return ((got.float() - ref.float()).abs() / ulp).max().item()


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
        checks.append((f"forward {name} vs fp32 reference, all rows: max abs err",
                       err.max().item(), 1e-4))
        if N > first_wide:
            checks.append((f"forward {name}, rows >= {first_wide} (offsets > 2^31): max abs err",
                           err[first_wide:].max().item(), 1e-4))
    spot = torch.tensor(sorted({0, min(first_wide, N - 1), min(first_wide + 1, N - 1), N - 1}),
                        device=logits.device)
    ref64 = float64_rows(logits, targets, temperature, spot)
    for name, got, want in (("logp", logp[spot], ref64[0]), ("entropy", entropy[spot], ref64[1])):
        checks.append((f"forward {name} vs float64 on rows {spot.tolist()}: max abs err",
                       (got.double() - want).abs().max().item(), 1e-4))
    del ref
    g = torch.Generator(device=logits.device).manual_seed(0)
    grad_logp, grad_entropy = torch.randn(2, N, device=logits.device, generator=g)
    for name, g_ent in (("logp only (training)", None), ("logp and entropy", grad_entropy)):
        got = triton_logprobs.backward(rows, targets, lse, mean_z, grad_logp, g_ent, temperature,
                                       block_v)
        want = reference.backward(rows, targets, lse, mean_z, grad_logp, g_ent, temperature)
        checks.append((f"backward, grad of {name}: max err in {logits.dtype} ulps",
                       grad_ulps(got, want), 1.0))
        if N > first_wide:
            checks.append((f"backward, grad of {name}, rows >= {first_wide}: max err in ulps",
                           grad_ulps(got[first_wide:], want[first_wide:]), 1.0))
        del got, want
    return checks


def peak_memory_gb(fn):
    if not torch.cuda.is_available():  # the CPU smoke run: no allocator statistics to read
        return float("nan")
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

    # passes: how many times the pass must move the logits' bytes
    def add(what, fn, passes, memory=False):
        t = do_bench(fn, warmup=25, rep=200, return_mode="median")
        table.append((what, t, passes * nbytes / GB / (t / 1e3),
                      peak_memory_gb(fn) if memory else None))

    copy = torch.empty_like(logits)
    add("torch copy (read + write)", functools.partial(copy.copy_, logits), 2)
    del copy
    rows = as_rows(logits)
    grad_logp = torch.randn(logits.shape[0], device=logits.device)
    for block_v in blocks:
        _, _, lse, mean_z = triton_logprobs.forward(rows, targets, temperature, block_v)
        add(f"triton forward, block {block_v}",
            lambda: triton_logprobs.forward(rows, targets, temperature, block_v), 1)
        for name, g_ent in (("logp", None), ("logp+entropy", grad_logp)):
            add(f"triton backward ({name}), block {block_v}", lambda: triton_logprobs.backward(
                rows, targets, lse, mean_z, grad_logp, g_ent, temperature, block_v), 2)

    # the training pass: forward, then the gradient of a loss on logp only
    x = logits.detach().requires_grad_()
    add(f"ours, forward+backward, block {DEFAULT_BLOCK_V}", lambda: torch.autograd.grad(
        (grad_logp * logprobs_and_entropy(x, targets, temperature)[0]).sum(), x), 3, memory=True)
    compiled = torch.compile(naive)
    add("torch.compile(naive), forward", lambda: compiled(logits, targets, temperature), 1,
        memory=True)
    add("torch.compile(naive), forward+backward", lambda: torch.autograd.grad(
        (grad_logp * compiled(x, targets, temperature)[0]).sum(), x), 3, memory=True)
    return table


def print_speed(table):
    copy_gbs = table[0][2]
    print(f"\nspeed (GB/s = bytes the pass must move / time; % of the torch copy's "
          f"{copy_gbs:.0f} GB/s, goal >= 80%)")
    print(f"  {'':44}{'ms':>9}{'GB/s':>9}{'% copy':>8}{'peak extra GB':>15}")
    for what, t, gbs, peak in table:
        peak_s = f"{peak:15.2f}" if peak is not None else ""
        print(f"  {what:44}{t:9.3f}{gbs:9.0f}{100 * gbs / copy_gbs:7.0f}%{peak_s}")
    for kind in ("triton forward", "triton backward (logp)"):
        best = max((row for row in table if row[0].startswith(kind)), key=lambda row: row[2])
        verdict = "meets" if best[2] >= 0.8 * copy_gbs else "BELOW"
        print(f"  best {kind}: block {best[0].split()[-1]}, "
              f"{100 * best[2] / copy_gbs:.0f}% of copy "
              f"({verdict} the 80% goal)")
    ours, naive_c = table[-3], table[-1]  # forward+backward: ours, and torch.compile(naive)
    print(f"  forward+backward: {naive_c[1] / ours[1]:.2f}x the speed of torch.compile(naive), "
          f"{ours[3] / naive_c[3]:.2f}x its peak memory")


# --------------------------------------------------------------------------------------------------
# Part "head": the output layer fused in

def head_inputs(rows, hidden_size, vocab, dtype, device):
    """hidden (N, C) ~ N(0, 1), weight (V, C) scaled so that the logits are ~ N(0, 3^2), targets
    (N,), and the upstream gradient of logp (N,): what a policy-gradient loss sends back (the
    advantages, in effect)."""
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(rows, hidden_size, device=device, generator=g).to(dtype)
    weight = torch.randn(vocab, hidden_size, device=device, generator=g)
    weight = (weight * 3 / hidden_size**0.5).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device=device, generator=g)
    return hidden, weight, targets, torch.randn(rows, device=device, generator=g)


# what dapo.response_logprobs computed before the fusion
def unfused_head(hidden, weight, targets, temperature):
    return logprobs_and_entropy(hidden @ weight.T, targets, temperature)


def naive_head(hidden, weight, targets, temperature):  # the textbook version, for torch.compile
    logp_all = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)  # (N, V) fp32
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def train_pass(head, hidden, weight, targets, upstream):
    """Forward, then the gradients of sum(upstream * logp) -> logp, entropy, d hidden, d weight."""
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logp, entropy = head(h, w, targets)
    return (logp, entropy, *torch.autograd.grad((upstream * logp).sum(), (h, w)))


def max_err(got, want, rows=slice(None)):
    return (got[rows].double() - want[rows].double()).abs().max().item()


def rel_err(got, want):
    return max_err(got, want) / want.double().abs().max().item()


def check_head(hidden, weight, targets, upstream, temperature, chunk_tokens):
    """-> [(what, value, limit)]: a check passes when value <= limit."""
    first_wide = (2**31 - 1) // weight.shape[0]
    fused = functools.partial(linear_logprobs_and_entropy, temperature=temperature,
                              chunk_tokens=chunk_tokens)
    unfused = lambda h, w, t: unfused_head(h, w, t, temperature)  # noqa: E731
    # the reference: the same rounded inputs, multiplied and everything after in fp32 (TF32 is off
    # by default)
    ref = train_pass(unfused, hidden.float(), weight.float(), targets, upstream)
    checks = []
    if hidden.dtype != torch.float32:
        # each rounds the logits to the input dtype: the fused path may not be less accurate than
        # the unfused one
        got, base = (train_pass(f, hidden, weight, targets, upstream) for f in (fused, unfused))
        for i, name in enumerate(("logp", "entropy")):
            spans = [("all rows", slice(None))]
            if len(targets) > first_wide:
                spans.append((f"rows >= {first_wide}", slice(first_wide, None)))
            for span_name, rows in spans:
                unfused_err = max_err(base[i], ref[i], rows)
                checks.append((f"{name}, {span_name}: fused max err vs fp32 "
                               f"(unfused: {unfused_err:.2e})",
                               max_err(got[i], ref[i], rows), 1.5 * unfused_err + 1e-3))
        for i, name in ((2, "d hidden"), (3, "d weight")):
            unfused_err = rel_err(base[i], ref[i])
            checks.append((f"{name}: fused max err / max vs fp32 (unfused: {unfused_err:.2e})",
                           rel_err(got[i], ref[i]), 1.5 * unfused_err + 1e-4))
        del got, base
    got = train_pass(fused, hidden.float(), weight.float(), targets, upstream)
    for i, name in enumerate(("logp", "entropy")):
        checks.append((f"fp32: fused {name} vs unfused, max abs err",
                       max_err(got[i], ref[i]), 1e-4))
    for i, name in ((2, "d hidden"), (3, "d weight")):
        checks.append((f"fp32: fused {name} vs unfused, max err / max",
                       rel_err(got[i], ref[i]), 1e-4))
    return checks


def time_ms(fn, smoke):
    if smoke:  # no GPU: best of 3 wall-clock runs
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def benchmark_head(hidden, weight, targets, upstream, temperature, chunks, smoke):
    """-> [(what, ms, peak extra GB)]: forward + backward (the training pass), and the no-grad
    forward (pi_old)."""
    table = []
    heads = {f"fused, chunks of {c} tokens":
             functools.partial(linear_logprobs_and_entropy, temperature=temperature, chunk_tokens=c)
             for c in chunks}
    heads["unfused (hidden @ weight.T, then the kernel)"] = \
        lambda h, w, t: unfused_head(h, w, t, temperature)
    compiled = torch.compile(naive_head)
    heads["torch.compile(unfused naive)"] = lambda h, w, t: compiled(h, w, t, temperature)
    for what, head in heads.items():
        step = lambda: train_pass(head, hidden, weight, targets, upstream)  # noqa: E731
        step()  # compiles, autotunes, allocates: not timed
        table.append((f"{what}, fwd+bwd", time_ms(step, smoke), peak_memory_gb(step)))
    for what in (next(iter(heads)), "unfused (hidden @ weight.T, then the kernel)"):
        forward = lambda: heads[what](hidden, weight, targets)  # noqa: E731
        with torch.no_grad():
            table.append((f"{what}, forward, no grad", time_ms(forward, smoke),
                          peak_memory_gb(forward)))
    return table


def head_part(args, device):
    dtype = DTYPES[args.dtype]
    hidden, weight, targets, upstream = head_inputs(args.rows, args.hidden, args.vocab, dtype,
                                                    device)
    # the smoke run's 64 rows: several chunks
    chunk = 7 if args.smoke else default_chunk_tokens(args.vocab)
    logits_gb = args.rows * args.vocab * hidden.element_size() / GB
    print(f"\nhead: hidden ({args.rows}, {args.hidden}), weight ({args.vocab}, {args.hidden}) "
          f"{args.dtype} (the unfused logits: {logits_gb:.2f} GB), T = {args.temperature}, "
          f"chunks of {chunk} tokens")
    # the weight gradient's sum: straight into fp32 (addmm's out_dtype), or each chunk upcast
    summed = "bf16 x bf16 into fp32 by addmm(out_dtype=)" if has_mixed_addmm(torch.device(device)) \
        else "each chunk upcast to fp32"
    print(f"weight gradient: {summed} on {device}")
    checks = check_head(hidden, weight, targets, upstream, args.temperature, chunk)
    print("correctness")
    for what, value, limit in checks:
        print(f"  {'ok  ' if value <= limit else 'FAIL'} {what:78} {value:10.2e}  "
              f"(limit {limit:.2e})")
    chunks = [c or chunk for c in args.chunk_tokens]
    table = benchmark_head(hidden, weight, targets, upstream, args.temperature, chunks, args.smoke)
    print(f"speed and memory ({'wall clock, CPU smoke run' if args.smoke else 'do_bench median'}; "
          f"peak extra = peak allocated beyond the inputs)")
    print(f"  {'':62}{'ms':>9}{'peak extra GB':>15}")
    for what, ms, peak in table:
        print(f"  {what:62}{ms:9.2f}{peak:15.2f}")
    fused, unfused, compiled = table[0], table[len(chunks)], table[len(chunks) + 1]
    print(f"  fused (first chunk size) / unfused: time {fused[1] / unfused[1]:.2f}x, peak memory "
          f"{fused[2] / unfused[2]:.2f}x; / torch.compile: time {fused[1] / compiled[1]:.2f}x, "
          f"peak memory {fused[2] / compiled[2]:.2f}x")
    return checks


def logits_part(args):
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    logits = (torch.randn(args.rows, args.vocab, device="cuda") * 3).to(dtype)  # (N, V)
    targets = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    size_gb = logits.numel() * logits.element_size() / GB
    print(f"logits ({args.rows}, {args.vocab}) {args.dtype} = {size_gb:.2f} GB, "
          f"T = {args.temperature}")
    checks = check_correctness(logits, targets, args.temperature, DEFAULT_BLOCK_V)
    print(f"\ncorrectness (block {DEFAULT_BLOCK_V})")
    for what, value, limit in checks:
        # NaN fails
        print(f"  {'ok  ' if value <= limit else 'FAIL'} {what:78} {value:10.2e}  "
              f"(limit {limit:g})")
    print_speed(benchmark(logits, targets, args.temperature, args.block_v))
    return checks


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "logits", "head"), default="all")
    p.add_argument("--rows", type=int, default=16384,
                   help="rows (tokens); 16384 x 151936 passes 2^31 elements")
    p.add_argument("--vocab", type=int, default=151936,
                   help="vocabulary size (Qwen2.5's by default)")
    p.add_argument("--hidden", type=int, default=896,
                   help="hidden size of the head (Qwen2.5-0.5B's by default)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="the logits' (and the head's inputs') dtype")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--block-v", type=int, nargs="+", default=[2048, 4096, 8192, 16384],
                   help="vocabulary block sizes to time "
                        f"(the checks use the default, {DEFAULT_BLOCK_V})")
    p.add_argument("--chunk-tokens", type=int, nargs="+", default=[0, 1024, 4096],
                   help="the fused head's chunk sizes to time (0: its default)")
    p.add_argument("--smoke", action="store_true",
                   help="run the head part on CPU at tiny shapes (64 x 3001, hidden 64): "
                        "checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.rows, args.vocab, args.hidden, args.part, device = 64, 3001, 64, "head", "cpu"
        args.chunk_tokens = [0, 32]
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False here). "
                     "On CPU, run benchmarks/bench_kernels.py and the tests instead, or this "
                     "script with --smoke.")
        if triton_logprobs is None:
            sys.exit("gpu_kernels.py needs triton (pip install triton)")
        if TRITON_INTERPRET:
            sys.exit("unset TRITON_INTERPRET: under the interpreter the kernels would run on "
                     "the CPU")
        device = "cuda"
        print(torch.cuda.get_device_name())

    checks = []
    if args.part in ("all", "logits"):
        checks += logits_part(args)
    if args.part in ("all", "head"):
        checks += head_part(args, device)
    if not all(value <= limit for _, value, limit in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
