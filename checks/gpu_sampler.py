"""
GPU check of the sampler on a DAPO-shaped rollout: a random Qwen2.5-0.5B-shaped model in bf16, 32
prompts x G = 8 samples at temperature 1, response lengths with a long tail. Ours with 64 slots,
eager and compiled (CUDA graphs), ours with one row per sequence (the lockstep schedule), and
transformers' generate on one batch of 64; useful tokens/s (response tokens up to the EOS) and
peak GPU memory. Not part of `make bench` (no GPU there).

    # about 2 minutes on one H100/H200, most of it the decode step's compile
    python -m checks.gpu_sampler
    # smoke (bf16 on CPU too)
    python -m checks.gpu_sampler --device cpu --preset tiny --prompts 2 --max-new 16 \
        --slots 4

A random model's next-token distribution is nearly flat, so making a set of vocab * 4 / max_new
token ids end a response gives lengths about geometric with mean max_new / 4. transformers runs
only --hf-batches of the batches of --slots (its tokens/s is per batch, and it is the slow side).
Before the timed runs, the eager and the compiled decode step are fed the same fixed tokens and
compared by their log-probs, token by token (exit 1 if they disagree beyond bf16's rounding):
this first use of the compiled step compiles it, so the timed compiled run is compile-free (its
CUDA graphs are recorded per call, as every rollout records them).
"""
import argparse
import sys
import tempfile
import time

import torch

from benchmarks.common import left_padded, lengths_to_eos
from checks import canary  # its tolerance, 2 bf16 ulps of a log-prob
from model import Transformer, num_params, preset
from sampler import compiled_decode_step, decode_one_token, generate, prefill_slots


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda",
                   help="cpu runs the same script as a smoke test (--preset tiny)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-new", type=int, default=512,
                   help="response token limit; mean length about a quarter")
    p.add_argument("--hf-batches", type=int, default=1,
                   help="batches of --slots sequences transformers runs")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_sampler.py needs a CUDA GPU (none found); "
                         "on CPU: benchmarks/bench_sampler.py")
    import transformers
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device)
    dtype = torch.bfloat16  # on CPU too: the smoke run checks the same arithmetic's tolerance
    cfg = preset(args.preset, **({"vocab_size": 512} if args.preset == "tiny" else {}))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        Transformer(cfg).save_pretrained(d)
        ours = Transformer.from_pretrained(d, dtype=dtype, device=device).eval()
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
            ids, mask = left_padded(seqs[b * args.slots:(b + 1) * args.slots])  # (B, P)
            with torch.no_grad():
                out = hf.generate(ids.to(device), attention_mask=mask.to(device),
                                  max_new_tokens=args.max_new, do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=0)
            lengths += lengths_to_eos(out[:, ids.shape[1]:].cpu(), eos)
        return lengths

    # the check first: its compiled half compiles the decode step (once per process)
    agreed = compiled_agrees_with_eager(ours, cfg.vocab_size, args.slots, device)
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


def teacher_forced(model, prompts, tokens, decode):
    """The log-prob of each fixed token, each row's prompt prefilled and then its tokens fed one
    at a time through decode (the sampler's decode step: eager, or compiled): tokens (N, T + 1)
    -> (N, T), token t + 1's log-prob after token t was fed."""
    N, T = tokens.shape[0], tokens.shape[1] - 1
    kv_cache = model.new_kv_cache(N, max(len(p) for p in prompts) + T + 1)
    prefill_slots(model, prompts, list(range(N)), kv_cache)
    start = torch.tensor([len(p) for p in prompts], device=tokens.device)  # (N,)
    logp = []
    for t in range(T):
        positions = start + t  # (N,): each row at its own position
        # contiguous, as the sampler's own tokens: a strided view would recompile the step
        logits = decode(model, tokens[:, t].contiguous(), positions,
                        kv_cache.upto(int(positions.max()) + 1))
        logp.append(logits.float().log_softmax(-1).gather(-1, tokens[:, t + 1, None]))
    return torch.cat(logp, 1)  # (N, T)


@torch.no_grad()
def compiled_agrees_with_eager(model, vocab, rows, device, new_tokens=192) -> bool:
    """The same fixed tokens (random ones: a random model's draws are about as likely) through
    the eager decode step and through the compiled one (on a GPU: replayed as CUDA graphs, one
    per key-length bucket, whose replays must read this step's tokens, positions and cache),
    compared token by token by their log-probs. Teacher-forced: greedy decoding would compare
    the argmax of a random model's nearly flat logits, whose top two sit within bf16's rounding
    of each other. Prompts of 8-48 tokens, so that the positions cross the 64, 128 and 256 key
    buckets.

    Tolerance, from bf16's unit round-off u = 2^-8: the two paths round the activations at other
    places (fused kernels keep fp32 between ops), so each log-prob is off by bf16's rounding of
    the hidden state's effect on the logits. A log-prob of a random model is about -log V: two
    bf16 ulps of it, 2 log(V) u (0.093 nats at V = 151936), bound every token, one ulp the mean.
    Measured on CPU (Inductor's C++ kernels, bf16, this model's shape, 4 rows x 128 tokens): mean
    0.0088, max 0.031. A replay of stale inputs (the previous step's token or position, another
    bucket's cache) moves a log-prob by about the logits' spread (0.6 nats) on most tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 49, (rows,), generator=g)]
    tokens = torch.randint(0, vocab, (rows, new_tokens + 1), generator=g).to(device)
    eager = teacher_forced(model, prompts, tokens, decode_one_token)
    t0 = time.perf_counter()
    max_len = max(len(p) for p in prompts) + new_tokens + 1
    compiled = teacher_forced(model, prompts, tokens,
                              compiled_decode_step(rows, max_len, device))
    compiled_s = time.perf_counter() - t0
    gap = (eager - compiled).abs().cpu()  # (rows, new_tokens)
    bound = canary.tolerance(vocab)  # 2 log(V) u
    ok = bool(gap.max() <= bound and gap.mean() <= bound / 2)
    print(f"teacher-forced log-probs, eager against compiled "
          f"({'CUDA graphs, ' if device.type == 'cuda' else ''}{compiled_s:.0f} s with the "
          f"compile), {rows} rows x {new_tokens} tokens: |gap| mean {float(gap.mean()):.2e}, "
          f"max {float(gap.max()):.2e} nats (bounds {bound / 2:.3f}, {bound:.3f}): "
          f"{'ok' if ok else 'FAILED'}", flush=True)
    return ok


if __name__ == "__main__":
    main()
