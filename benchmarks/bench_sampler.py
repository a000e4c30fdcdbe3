"""
sampler.generate against transformers' generate on the same random weights (CPU, greedy, ragged prompts).

transformers runs with its default dynamic KV cache; prompts are 40-72 tokens long.

    .venv/bin/python benchmarks/bench_sampler.py              # both sizes, about 3 minutes
    .venv/bin/python benchmarks/bench_sampler.py --threads 2  # both cores: only on an otherwise idle machine

Two sizes: the embedded demo's (hidden 128, 2 layers, batch 64, vocab 512), where per-step overhead weighs most,
and ~27M parameters (hidden 512, 6 layers, batch 16, vocab 8192), where the matrix products do; plus the demo model
with a batch of one ("demo1"), whose decode step is per-step overhead and nothing else. No EOS id is set on
either side, so both generate exactly `new` tokens, and their greedy outputs are compared token for token.

Columns: tok/s over the whole call (prefill included) and the ratio ours / transformers; prefill = one call that
generates 1 token; decode = (time(new) - time(1)) / (new - 1), the cost of one decode step for the whole batch;
floor = the bare F.linear calls of one decode step (every projection and the output layer, B rows each), which a
decode step cannot beat without changing the arithmetic. On a shared machine the load drifts: ours and transformers
run alternately and each keeps its best time (CPU time of the process with one thread, wall time with more).

One thread by default: on a 2-core machine a second OpenMP thread helps only while nothing else runs; with any other
busy process, every matmul waits at a barrier for a descheduled thread (measured here: the 26 linears of one 27M
decode step went from 38 ms on one thread to 400 ms on two).
"""
import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import ModelConfig, Qwen2, num_params  # noqa: E402
from sampler import generate  # noqa: E402

DEMO = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)
SIZES = {  # name: (model config, batch size)
    "demo": (DEMO, 64),
    "demo1": (DEMO, 1),  # one sequence: the per-step overhead alone, the arithmetic is negligible
    "27M": (dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=8192), 16),
}


def build(cfg_kw, tmp):
    import transformers
    transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bar, not ours
    torch.manual_seed(0)
    ours = Qwen2(ModelConfig(**cfg_kw, max_position_embeddings=1024, torch_dtype="float32")).eval()
    with torch.no_grad():  # random biases and norm weights, so that nothing is a constant that hides a difference
        for name, p in ours.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ours.save_pretrained(tmp)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    return ours, hf


def ragged_prompts(batch, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(40, 73, (batch,), generator=g)
    return [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in lengths]


def clock():
    # one thread: the process's CPU time, which other tenants of a shared machine disturb far less than wall time
    # (time spent descheduled does not count); several threads: wall time, since CPU time would add them up
    return time.process_time() if torch.get_num_threads() == 1 else time.perf_counter()


def run_ours(model, prompts, new):
    t0 = clock()
    r = generate(model, prompts, new, temperature=0.0, eos_token_ids=[], pad_token_id=0)
    return clock() - t0, r.response_ids


def run_hf(hf, prompts, new):
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)  # left-padded, as transformers wants for generation
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
    t0 = clock()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    dt = clock() - t0
    assert out.shape[1] == P + new, "transformers stopped early"
    return dt, out[:, P:]


def matmul_floor(model, batch, reps=20):
    """Seconds for the bare F.linear calls of one decode step (B rows), with the model's own weights; best of 3."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]  # projections + lm_head
    x = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
    best = float("inf")
    with torch.no_grad():
        for _ in range(4):  # the first round warms up
            t0 = clock()
            for _ in range(reps):
                for w in weights:
                    F.linear(x[w.shape[1]], w)
            best = min(best, (clock() - t0) / reps)
    return best


def best_times(rounds, runs):
    """{name: fn} -> {name: (best seconds, output)}, the fns called alternately for `rounds` rounds."""
    best = {}
    for _ in range(rounds):
        for name, fn in runs.items():
            dt, out = fn()
            best[name] = (min(dt, best.get(name, (float("inf"),))[0]), out)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (see above)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating timed rounds for the short runs (best kept)")
    ap.add_argument("--sizes", default="demo,demo1,27M", help="comma-separated, from: " + ", ".join(SIZES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{'CPU' if torch.get_num_threads() == 1 else 'wall'} time, load average {os.getloadavg()[0]:.1f}; "
          f"greedy, prompts of 40-72 tokens")
    print(f"{'size':>5} {'params':>6} {'B':>3} {'new':>4} | {'ours tok/s':>10} {'hf tok/s':>8} {'ratio':>6} | "
          f"{'prefill ms ours/hf':>18} | {'decode ms/step ours/hf':>22} {'floor':>6} | same output")
    for name in args.sizes.split(","):
        cfg_kw, batch = SIZES[name]
        with tempfile.TemporaryDirectory() as tmp:
            ours, hf = build(cfg_kw, tmp)
        prompts = ragged_prompts(batch, cfg_kw["vocab_size"])
        run_ours(ours, prompts, 4), run_hf(hf, prompts, 4)  # warm-up: allocator, kernels, transformers' caches
        floor = matmul_floor(ours, batch)
        one = best_times(args.rounds, dict(ours=lambda: run_ours(ours, prompts, 1),
                                           hf=lambda: run_hf(hf, prompts, 1)))
        for new in (128, 512):
            t = best_times(args.rounds if new <= 128 else 1, dict(ours=lambda: run_ours(ours, prompts, new),
                                                                  hf=lambda: run_hf(hf, prompts, new)))
            (t_ours, ids_ours), (t_hf, ids_hf) = t["ours"], t["hf"]
            same_rows = int((ids_ours == ids_hf).all(-1).sum())
            decode = {k: (t[k][0] - one[k][0]) / (new - 1) for k in t}
            print(f"{name:>5} {num_params(ours) / 1e6:5.1f}M {batch:>3} {new:>4} | {batch * new / t_ours:10.0f} "
                  f"{batch * new / t_hf:8.0f} {t_hf / t_ours:5.2f}x | "
                  f"{1e3 * one['ours'][0]:8.0f} /{1e3 * one['hf'][0]:6.0f}    | "
                  f"{1e3 * decode['ours']:11.2f} /{1e3 * decode['hf']:6.2f}     {1e3 * floor:6.2f} | "
                  f"{same_rows}/{batch} rows", flush=True)
            # random weights leave some argmaxes within float noise of a tie, where a different order of the same
            # arithmetic may pick the other token; a real bug changes nearly every row
            assert same_rows >= 0.9 * batch, f"greedy outputs differ from transformers' in {batch - same_rows} rows"
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
