"""
sampler.generate against transformers on the same random weights (CPU, one thread, CPU time, best
of rounds).

    # the four parts, about 5 minutes of CPU
    .venv/bin/python -m benchmarks.bench_sampler
    # one part (uniform, rl, memory)
    .venv/bin/python -m benchmarks.bench_sampler --parts rl
    # this sampler against an earlier revision's (default 015f0be; about 2 minutes)
    .venv/bin/python -m benchmarks.bench_sampler --parts against --rl-rounds 4
    # what each of the sampler's speed-ups buys (each switched off, against all on)
    .venv/bin/python -m benchmarks.bench_sampler --parts switches --rl-rounds 4
    # both cores: only on an otherwise idle machine
    .venv/bin/python -m benchmarks.bench_sampler --threads 2

1. uniform: greedy, no EOS, every row runs to 128 new tokens; all rows at once (slots = rows) on
   both sides. Two sizes: the embedded demo's (hidden 128, 2 layers, batch 64, vocab 512) and ~27M
   parameters (hidden 512, 6 layers, batch 16, vocab 8192). Ours eager and compiled (torch.compile'd
   decode step) against transformers' generate; the greedy outputs are compared token for token.
   decode = (time(128) - time(1)) / 127, the cost of one decode step for the whole batch;
   floor = the bare F.linear calls of one decode step, which a step cannot beat without changing
   the arithmetic.
2. rl: what a DAPO rollout looks like. 64 prompts x G = 8 samples at temperature 1, up to 512 new
   tokens; 4 of the 512 token ids end a response, and a random model's next-token distribution is
   nearly flat, so the lengths are about geometric with mean 128 and a long tail. Useful tokens/s
   (response tokens up to the EOS) for ours with 64 slots, eager and compiled, against (a) lockstep:
   ours with one slot per sequence, all 512 at once, which is the schedule of the previous sampler
   (every row decodes until the longest one ends); (b) transformers' generate in batches of 64
   (8 prompts x 8); (c) transformers' continuous batching (generate_batch, 64 requests at a time).
3. memory: how far resident memory rises during the rl run, ours with 64 slots against 512 rows
   (Linux: VmHWM, each in a fresh process).
4. against (--against REV, default 015f0be: the sampler before its prompt sharing): the
   rl case in 64 slots, this tree's sampler against git revision REV's (its whole tree exported to a
   temporary directory), each rollout in a fresh process, the two alternating for --rl-rounds
   rounds (at least 2); per-round tok/s and ratios. On a shared machine one process can run much
   faster or slower than the next, so look at the spread, not one round. Skipped in a copy that
   lacks REV (no git history).
5. switches (not in the default parts): the same, this tree's sampler with all its speed-ups on
   (sampler.SPEED_UPS) against each one switched off.

CPU time of the process on one thread: the other tenants of a shared machine disturb it far less
than wall time. One thread by default: on a 2-core machine a second OpenMP thread helps only while
nothing else runs.
"""
import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.common import (
    clock,
    left_padded,
    lengths_to_eos,
    proc_status_kib,
    randomise_biases_and_norms,
    reset_peak_rss,
    timed_rounds,
)
from model import ModelConfig, Transformer, num_params
from sampler import SPEED_UPS, generate

DEMO = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
M27 = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
           num_key_value_heads=2, vocab_size=8192)
UNIFORM = {"demo": (DEMO, 64), "27M": (M27, 16)}  # name: (model config, batch size)
RL_PROMPTS, RL_G, RL_SLOTS, RL_NEW, RL_EOS = 64, 8, 64, 512, [1, 2, 3, 4]


def random_model(cfg_kw) -> Transformer:
    """A random Qwen2 of this shape (seed 0), its biases and norm weights random too."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**cfg_kw, max_position_embeddings=1024, torch_dtype="float32"))
    return randomise_biases_and_norms(model.eval())


def build(cfg_kw, tmp):
    import transformers
    transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bar, not ours
    ours = random_model(cfg_kw)
    ours.save_pretrained(tmp)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    return ours, hf


def ragged_prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(40, 73, (n,), generator=g)
    return [torch.randint(5, vocab, (int(k),), generator=g).tolist() for k in lengths]


def rl_sequences():
    """The rl part's sequences: the G samples of a prompt side by side, as dapo.py asks."""
    return [p for p in ragged_prompts(RL_PROMPTS, DEMO["vocab_size"], seed=1) for _ in range(RL_G)]


def best_times(rounds, runs):
    """{name: fn} -> {name: (best seconds, output)}, the fns called alternately for `rounds`
    rounds."""
    timed = timed_rounds(rounds, runs)
    return {name: min(per_round, key=lambda r: r[0]) for name, per_round in timed.items()}


def matmul_floor(model, batch, reps=20):
    """Seconds for the bare F.linear calls of one decode step (B rows), with the model's own
    weights; best of 3."""
    # projections + lm_head
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
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


# --------------------------------------------------------------------------------------------------
# 1. uniform

def uniform(rounds):
    print("\n1. uniform: greedy, every row to 128 new tokens, all rows at once; "
          "tok/s (ratio to transformers)")
    print(f"{'size':>5} {'params':>6} {'B':>3} | {'eager':>13} {'compiled':>14} {'hf':>6} | "
          f"{'decode ms/step eager/compiled/hf':>32} {'floor':>6} | same output")
    for name, (cfg_kw, batch) in UNIFORM.items():
        with tempfile.TemporaryDirectory() as tmp:
            ours, hf = build(cfg_kw, tmp)
        prompts = ragged_prompts(batch, cfg_kw["vocab_size"])
        ids, mask = left_padded(prompts)

        def run_hf(new):
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
            assert out.shape[1] == ids.shape[1] + new, "transformers stopped early"
            return out[:, ids.shape[1]:]

        def runs(new):
            return dict(
                eager=lambda: generate(ours, prompts, new, temperature=0,
                                       eos_token_ids=[]).response_ids,
                compiled=lambda: generate(ours, prompts, new, temperature=0, eos_token_ids=[],
                                          compile=True).response_ids,
                hf=lambda: run_hf(new))
        best_times(1, runs(4))  # warm-up: the compile, the allocator, transformers' caches
        floor = matmul_floor(ours, batch)
        one = best_times(rounds, runs(1))
        t = best_times(rounds, runs(128))
        decode = {k: (t[k][0] - one[k][0]) / 127 for k in t}
        same = [int((t[k][1] == t["hf"][1]).all(-1).sum()) for k in ("eager", "compiled")]
        tps = {k: batch * 128 / t[k][0] for k in t}
        print(f"{name:>5} {num_params(ours) / 1e6:5.1f}M {batch:>3} | "
              f"{tps['eager']:6.0f} ({tps['eager'] / tps['hf']:.2f}x) {tps['compiled']:6.0f} "
              f"({tps['compiled'] / tps['hf']:.2f}x) {tps['hf']:6.0f} | "
              f"{1e3 * decode['eager']:14.2f} /{1e3 * decode['compiled']:6.2f} "
              f"/{1e3 * decode['hf']:6.2f}   "
              f"{1e3 * floor:6.2f} | {same[0]}/{batch}, {same[1]}/{batch} rows", flush=True)
        # random weights leave some argmaxes within float noise of a tie, where a different order of
        # the same arithmetic may pick the other token; a real bug changes nearly every row
        assert min(same) >= 0.9 * batch, \
            f"greedy outputs differ from transformers' in {batch - min(same)} rows"


# --------------------------------------------------------------------------------------------------
# 2. rl and 3. memory

def memory_rise(slots):
    """In a fresh process: how far the resident memory rises above its size before the rl run (ours,
    with `slots`) at its peak, MiB (Linux: VmHWM). Fresh, because memory an earlier run freed stays
    resident."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = ModelConfig(**DEMO, max_position_embeddings=1024, torch_dtype="float32")
    model = Transformer(config).eval()
    seqs = rl_sequences()
    if not reset_peak_rss():  # VmHWM restarts from the current resident size
        raise OSError("/proc/self/clear_refs is not writable: no peak to measure")
    start = proc_status_kib("VmRSS")
    generate(model, seqs, RL_NEW, temperature=1.0, eos_token_ids=RL_EOS, slots=slots,
             generator=torch.Generator().manual_seed(0))
    return (proc_status_kib("VmHWM") - start) / 1024


def rl(rounds, parts):
    import transformers
    with tempfile.TemporaryDirectory() as tmp:
        ours, hf = build(DEMO, tmp)
    seqs = rl_sequences()

    def run_ours(slots, compile=False):
        rollout = generate(ours, seqs, RL_NEW, temperature=1.0, eos_token_ids=RL_EOS, slots=slots,
                           compile=compile, generator=torch.Generator().manual_seed(0))
        return rollout.lengths.tolist()

    def run_hf_batches():
        lengths = []
        for start in range(0, len(seqs), RL_SLOTS):
            ids, mask = left_padded(seqs[start:start + RL_SLOTS])
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=RL_NEW, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, eos_token_id=RL_EOS,
                                  pad_token_id=0)
            lengths += lengths_to_eos(out[:, ids.shape[1]:], RL_EOS)
        return lengths

    def run_hf_cb():
        gen = transformers.GenerationConfig(max_new_tokens=RL_NEW, do_sample=True, temperature=1.0,
                                            top_k=0, top_p=1.0, eos_token_id=RL_EOS,
                                            pad_token_id=0)
        # 64 requests at a time, pages for 64 sequences of the longest prompt + 512 tokens, as our
        # 64 slots hold
        cb = transformers.ContinuousBatchingConfig(max_requests_per_batch=RL_SLOTS, page_size=256,
                                                   num_blocks=RL_SLOTS * 3, max_batch_tokens=4096)
        with torch.no_grad():
            out = hf.generate_batch(seqs, generation_config=gen, continuous_batching_config=cb,
                                    warmup=False)
        return [len(o.generated_tokens) for o in out.values()]

    runs = {"ours, 64 slots": lambda: run_ours(RL_SLOTS),
            "ours, 64 slots, compiled": lambda: run_ours(RL_SLOTS, compile=True),
            "(a) lockstep, 512 rows": lambda: run_ours(len(seqs)),
            "(b) hf generate, batches of 64": run_hf_batches,
            "(c) hf continuous batching": run_hf_cb}
    if "rl" in parts:
        # compile outside the timing
        generate(ours, seqs[:RL_SLOTS], 4, slots=RL_SLOTS, compile=True)
        best = {}
        for _ in range(rounds):
            for name, fn in runs.items():
                t0, wall0 = clock(), time.perf_counter()
                lengths = fn()
                dt, wall = clock() - t0, time.perf_counter() - wall0
                if dt < best.get(name, (float("inf"),))[0]:
                    best[name] = dt, wall, lengths
        print(f"\n2. rl: {RL_PROMPTS} prompts x G={RL_G}, temperature 1, up to {RL_NEW} new "
              f"tokens, P(EOS) ~ {len(RL_EOS)}/{DEMO['vocab_size']} per token; "
              f"useful tokens/s (ours, 64 slots: x)")
        print(f"{'':>32} {'CPU s':>7} {'(wall)':>7} {'tokens':>7} {'mean len':>8} {'max len':>7} "
              f"{'tok/s':>7} {'ours / this':>11}")
        ref = sum(best["ours, 64 slots"][2]) / best["ours, 64 slots"][0]
        for name, (dt, wall, lengths) in best.items():
            tps = sum(lengths) / dt
            print(f"{name:>32} {dt:7.1f} {wall:7.1f} {sum(lengths):7d} "
                  f"{sum(lengths) / len(lengths):8.1f} {max(lengths):7d} {tps:7.0f} "
                  f"{ref / tps:10.2f}x", flush=True)
    if "memory" in parts:
        cfg = ours.config
        kv_bytes_per_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim \
            * 4 * (max(len(s) for s in seqs) + RL_NEW)
        print(f"\n3. memory, the rl run ({len(seqs)} sequences): peak rise of resident memory, MiB "
              f"(the KV cache)")
        # a fixed threshold: glibc otherwise raises it after each large free, and keeps later large
        # blocks resident after their free, so the peak would count memory that was no longer in use
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
        with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
            for name, rows in (("ours, 64 slots", RL_SLOTS), ("(a) lockstep, 512 rows", len(seqs))):
                rise = pool.apply(memory_rise, (rows,))
                kv_mib = rows * kv_bytes_per_row / 2**20
                print(f"{name:>32} {rise:7.0f} ({kv_mib:5.0f})", flush=True)


# 4. against another revision, and 5. each of the sampler's speed-ups switched off

BASELINE = "015f0be"  # the sampler before its prompt sharing (and its since-dropped spans)

# one rollout by the sampler and model in directory argv[1] of the sequences (JSON) on stdin, the
# sampler's flags named in argv[3:] set False: prints tokens, CPU s, forwards, prefill forwards and
# the prompts they prefilled
ONE_ROLLOUT = """
import json, sys, time, torch
import sampler
from model import ModelConfig, Transformer
torch.set_num_threads(1)
torch.manual_seed(0)
config = ModelConfig(**{demo}, max_position_embeddings=1024, torch_dtype="float32")
model = Transformer(config).eval()
for flag in sys.argv[3:]:
    setattr(sampler, flag, False)
forwards, prefills, prefill = [], [], getattr(sampler, "prefill_slots", None)
model.register_forward_pre_hook(lambda *_: forwards.append(1))
if prefill:  # not in the oldest samplers
    sampler.prefill_slots = lambda m, ps, *a: prefills.append(len(ps)) or prefill(m, ps, *a)
seqs = json.load(sys.stdin)
t0 = time.process_time()
out = sampler.generate(model, seqs, {new}, temperature=1.0, eos_token_ids={eos}, slots={slots},
                       generator=torch.Generator().manual_seed(int(sys.argv[2])))
print(int(out.lengths.sum()), time.process_time() - t0, len(forwards),
      len(prefills) if prefill else "-", sum(prefills) if prefill else "-")
"""


def alternate(variants, rounds):
    """The rl case in 64 slots by each of variants {name: (source directory, sampler flags set
    False)}, one fresh process a rollout, the variants in turn (each round in the other order, so
    that none always runs on a warmer machine): tok/s per round, and each one's ratio to the
    first."""
    code = ONE_ROLLOUT.format(demo=DEMO, new=RL_NEW, eos=RL_EOS, slots=RL_SLOTS)
    seqs = rl_sequences()
    names = list(variants)
    width = max(10, *map(len, names))
    print(f"{'round':>5} " + " ".join(f"{n:>{width}}" for n in names) + "  ratios to the first")
    ratios, totals = {n: [] for n in names[1:]}, {n: [0, 0.0] for n in names}
    counts = {}  # the first round's forwards, prefill forwards and prompts prefilled
    for r in range(max(rounds, 2)):
        tps = {}
        for name in (names if r % 2 == 0 else names[::-1]):
            directory, flags = variants[name]
            out = subprocess.run([sys.executable, "-c", code, directory, str(r), *flags],
                                 input=json.dumps(seqs), capture_output=True, text=True,
                                 check=True)
            tokens, seconds, *counted = out.stdout.split()
            counts.setdefault(name, counted)
            totals[name][0] += int(tokens)
            totals[name][1] += float(seconds)
            tps[name] = int(tokens) / float(seconds)
        for n in names[1:]:
            ratios[n].append(tps[n] / tps[names[0]])
        print(f"{r:5d} " + " ".join(f"{tps[n]:{width}.0f}" for n in names) + "  " +
              " ".join(f"{ratios[n][-1]:.2f}x" for n in names[1:]), flush=True)
    for n in names[1:]:
        total = (totals[n][0] / totals[n][1]) / (totals[names[0]][0] / totals[names[0]][1])
        print(f"{n} / {names[0]}: {total:.2f}x over all rounds (median round "
              f"{statistics.median(ratios[n]):.2f}x, {min(ratios[n]):.2f}-{max(ratios[n]):.2f}x)")
    for n in names:
        print(f"{n}, round 0: forwards, prefill forwards, prompts prefilled: "
              f"{', '.join(counts[n])}")


def against(rev, rounds):
    """The rl case in 64 slots: revision rev's sampler against this tree's, alternating."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if subprocess.run(["git", "-C", here, "cat-file", "-e", f"{rev}^{{commit}}"],
                      capture_output=True).returncode:  # no history here (an archive, a shallow
        print(f"\n4. against {rev}: skipped, not a commit of this checkout")  # clone)
        return
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "-C", here, "archive", rev], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        print(f"\n4. against {rev}: the rl case in 64 slots, one fresh process a rollout, "
              f"1 thread, CPU time; tok/s")
        alternate({rev: (old, []), "this tree": (here, [])}, rounds)


def switches(rounds):
    """The rl case in 64 slots with every speed-up on, against each one switched off."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print("\n5. switches: the rl case in 64 slots, each of the sampler's speed-ups off against all "
          "on; one fresh process a rollout, 1 thread, CPU time; tok/s")
    alternate({"all on": (here, []), **{f"{flag} off": (here, [flag]) for flag in SPEED_UPS}},
              rounds)


def main():
    # the first paragraph of the docstring (argparse joins its lines)
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (see above)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="alternating timed rounds of the uniform part (best kept)")
    ap.add_argument("--rl-rounds", type=int, default=1,
                    help="the same for the rl part (about 75 s CPU a round)")
    ap.add_argument("--parts", default="uniform,rl,memory,against",
                    help="comma-separated, from: uniform, rl, memory, against, switches")
    ap.add_argument("--against", default=BASELINE,
                    help="a git revision whose sampler the against part runs (see above; default "
                         "the sampler before its prompt sharing, which docs/performance.md's "
                         "ratio is against)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{'CPU' if torch.get_num_threads() == 1 else 'wall'} time, "
          f"load average {os.getloadavg()[0]:.1f}")
    if "uniform" in parts:
        uniform(args.rounds)
    if "rl" in parts or "memory" in parts:
        rl(args.rl_rounds, parts)
    if "against" in parts:
        if not args.against:
            ap.error("--parts against needs --against REV (a git revision)")
        against(args.against, args.rl_rounds)
    if "switches" in parts:
        switches(args.rl_rounds)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
