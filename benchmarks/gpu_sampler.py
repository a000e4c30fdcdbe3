"""
GPU check of the sampler on a DAPO-shaped rollout: a random Qwen2.5-0.5B-shaped model in bf16, 64
prompts x G = 8 samples at temperature 1, response lengths with a long tail. Ours with 64 slots,
eager and compiled (CUDA graphs), ours with one row per sequence (the lockstep schedule), and
transformers' generate in batches of 64; useful tokens/s (response tokens up to the EOS) and peak
GPU memory. Not part of `make bench` (no GPU there).

    # about 3 minutes on one H100/H200
    python benchmarks/gpu_sampler.py
    # smoke
    python benchmarks/gpu_sampler.py --device cpu --preset tiny --prompts 4 --max-new 64 \
        --hf-batches 1

A random model's next-token distribution is nearly flat, so making a set of vocab * 4 / max_new
token ids end a response gives lengths about geometric with mean max_new / 4. transformers runs
only --hf-batches of the batches of 64 (its tokens/s is per batch, and it is the slow side). The
compiled run's first call (compile + graph capture) is reported apart from its timed call.
Before the timed runs, greedy decoding eager and compiled are compared token by token (exit 1 if
they disagree beyond rounding).
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import Qwen2, num_params, preset  # noqa: E402
from sampler import generate  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda",
                   help="cpu runs the same script as a smoke test (--preset tiny)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-new", type=int, default=1024,
                   help="response token limit; mean length about a quarter")
    p.add_argument("--hf-batches", type=int, default=2,
                   help="batches of --slots sequences transformers runs")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_sampler.py needs a CUDA GPU (none found); "
                         "on CPU: benchmarks/bench_sampler.py")
    import transformers
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = preset(args.preset, **({"vocab_size": 512} if args.preset == "tiny" else {}))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        Qwen2(cfg).save_pretrained(d)
        ours = Qwen2.from_pretrained(d, dtype=dtype, device=device).eval()
        hf = transformers.Qwen2ForCausalLM.from_pretrained(d, dtype=dtype,
                                                           attn_implementation="sdpa").to(device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{args.preset}: {num_params(ours) / 1e6:.0f}M parameters, {dtype}, on {where}")

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(64, 257, (args.prompts,), generator=g)]
    seqs = [q for q in prompts for _ in range(args.group_size)]
    # P(EOS) ~ 4 / max_new per token
    eos = list(range(max(1, round(cfg.vocab_size * 4 / args.max_new))))

    def timed(fn):
        """-> (fn(), seconds, peak memory GiB)"""
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        return out, time.perf_counter() - t0, peak

    def ours_run(slots, compile=False):
        r = generate(ours, seqs, args.max_new, temperature=1.0, eos_token_ids=eos, slots=slots,
                     compile=compile, generator=torch.Generator(device).manual_seed(0))
        return r.lengths.tolist()

    def hf_run():
        lengths = []
        for b in range(args.hf_batches):
            part = seqs[b * args.slots:(b + 1) * args.slots]
            P = max(len(q) for q in part)
            ids = torch.zeros(len(part), P, dtype=torch.long)
            mask = torch.zeros(len(part), P, dtype=torch.long)
            for i, q in enumerate(part):
                ids[i, P - len(q):], mask[i, P - len(q):] = torch.tensor(q), 1
            with torch.no_grad():
                out = hf.generate(ids.to(device), attention_mask=mask.to(device),
                                  max_new_tokens=args.max_new, do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=0)[:, P:].cpu()
            is_eos = torch.isin(out, torch.tensor(eos))
            first = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, out.shape[1])
            lengths += first.tolist()
        return lengths

    # compile + record the graphs
    _, first_s, _ = timed(lambda: ours_run(args.slots, compile=True))
    print(f"compiled: first call (compile, CUDA graph capture, and the run) {first_s:.0f}s")
    agreed = compiled_agrees_with_eager(ours, seqs[:args.slots], dtype)
    runs = {f"ours, {args.slots} slots, eager": lambda: ours_run(args.slots),
            f"ours, {args.slots} slots, compiled": lambda: ours_run(args.slots, compile=True),
            f"ours, {len(seqs)} rows (lockstep)": lambda: ours_run(len(seqs)),
            f"hf generate, {args.hf_batches} batch(es) of {args.slots}": hf_run}
    print(f"{'':>36} {'seconds':>8} {'tokens':>8} {'mean len':>8} {'max len':>7} {'tok/s':>8} "
          f"{'peak GiB':>8}")
    for name, fn in runs.items():
        lengths, seconds, peak = timed(fn)
        print(f"{name:>36} {seconds:8.1f} {sum(lengths):8d} {sum(lengths) / len(lengths):8.1f} "
              f"{max(lengths):7d} {sum(lengths) / seconds:8.0f} {peak:8.1f}", flush=True)
    sys.exit(0 if agreed else 1)


def compiled_agrees_with_eager(model, prompts, dtype, new_tokens=32) -> bool:
    """Greedy decoding of the prompts, eager against compiled (on a GPU: CUDA graphs, whose
    replays must read this step's tokens, positions and cache), compared token by token. Rounding
    differs between the two (fused kernels), so a row may take another token where two are nearly
    tied, and then go its own way: the log-probs are compared over each row's common prefix, and
    most rows must agree on their first tokens (a replay of stale inputs agrees on none)."""
    eager, compiled = (generate(model, prompts, new_tokens, temperature=0, eos_token_ids=[],
                                slots=len(prompts), compile=c) for c in (False, True))
    same = (eager.response_ids == compiled.response_ids).cpu()  # (N, new_tokens)
    prefix = same.long().cumprod(-1).sum(-1)  # (N,): tokens before the first difference
    on_prefix = torch.arange(new_tokens) < prefix[:, None]  # (N, new_tokens)
    gap = (eager.logprobs - compiled.logprobs).abs().cpu()[on_prefix]
    bound = 0.05 if dtype == torch.bfloat16 else 1e-4  # nats: bf16's rounding, or fp32's
    median = float(prefix.median())
    ok = float(gap.mean()) <= bound and median >= min(4, new_tokens)
    print(f"greedy, eager against compiled, {len(prompts)} rows x {new_tokens} tokens: "
          f"{int((prefix == new_tokens).sum())} rows identical, common prefix median "
          f"{median:.0f} tokens; log-prob gap on it mean {float(gap.mean()):.2e} max "
          f"{float(gap.max()):.2e} nats (bound on the mean {bound}): {'ok' if ok else 'FAILED'}",
          flush=True)
    return ok


if __name__ == "__main__":
    main()
