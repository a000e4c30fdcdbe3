"""
Speed on the real model of `make real` (SmolLM2-135M-Instruct, converted by examples/smollm2.py):
its rollout against transformers' generate, and one RL step of dapo.py with the update's share
of the CPU's matmul peak. CPU, one thread by default, CPU time, the variants alternating round by
round.

    .venv/bin/python -m benchmarks.bench_real                 # both parts, ~10 minutes of CPU
    .venv/bin/python -m benchmarks.bench_real --parts step --rounds 2
    .venv/bin/python -m benchmarks.bench_real --parts step --precisions fp32 --arms all

Skipped, saying so, when the model directory is absent (`make real` or examples/smollm2.py
writes it).

1. rollout: experiments/real.py's rollout (RL: 8 held-out sums x G = 8; eval: 64 x 4) at
   temperature 1, up to 32 new tokens, <|im_end|> ends a response; fp32 or bf16 autocast, the
   same on both sides. Ours: sampler.generate in 64 slots. Theirs: transformers' generate on the
   same prompts, 64 left-padded rows at once. Useful tokens/s: response tokens up to and
   including the EOS. Each side draws its own samples, so lengths differ by chance: tokens/s, not
   seconds, is what compares.
2. step: dapo.collect_batch + dapo.update_policy with real.py's settings (8 prompts x 8 in
   mini-batches of 2 prompts, so 4 optimizer steps; dynamic sampling off, so a step is one
   rollout) in each precision, and with --arms each of experiments/real_neighbours.py's losses
   (gspo, cispo, ...). Each round starts from the same weights, a fresh optimizer and the same
   sampling seed. DAPO's update is run again under torch's FlopCounterMode: its FLOPs over its CPU
   time, against the one-thread matmul throughput measured at the model's own shapes
   (matmul_peak), is the roofline line.
"""
import argparse
import os
import statistics
from dataclasses import replace

import torch
from torch.utils.flop_counter import FlopCounterMode

import dapo
from benchmarks.common import FixedRows, clock, left_padded, lengths_to_eos, timed_rounds
from config import parse_args
from data import encode_prompts, load_rows, load_tokenizer
from examples import smollm2, sums
from experiments import real
from experiments.real_neighbours import ARMS
from examples import from_gguf
from launch import load_verifier
from model import Transformer
from sampler import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETTINGS = real.SETTINGS
NEW_TOKENS, SLOTS = SETTINGS["max_response_len"], SETTINGS["rollout_slots"]
# make real's two rollouts: prompts (None: every held-out problem) x samples each
SHAPES = {"rl": (SETTINGS["train_prompts"], SETTINGS["group_size"]),
          "eval": (None, SETTINGS["eval_samples"])}


def prompts_of(model_dir: str, tmp: str, n: int | None,
               samples: int) -> tuple[list[list[int]], object]:
    """The first n held-out sums (None: all), each `samples` times, through the model's chat
    template."""
    _, val = sums.write_task(tmp)
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}]}
            for r in real.first_rows(val, n or 10**9)]
    tok = load_tokenizer(model_dir)
    prompts, _ = encode_prompts(rows, tok, SETTINGS["max_prompt_len"])
    return [p for p in prompts for _ in range(samples)], tok


def in_precision(precision: str):
    """The forward phase's context: bf16 autocast over the fp32 weights (make real's rollout), or
    nothing; the same for both sides."""
    return torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16")


def rollout_part(model_dir: str, rounds: int, precisions: list[str], shapes: list[str],
                 slots: int, tmp: str):
    import transformers
    transformers.utils.logging.disable_progress_bar()
    ours = Transformer.from_pretrained(model_dir, dtype=torch.float32).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
    at_once = slots or "all"
    print(f"rollout against transformers' generate: up to {NEW_TOKENS} new tokens at temperature "
          f"1, ours in {at_once} slots, theirs in batches of {at_once} left-padded rows; "
          f"{torch.get_num_threads()} thread(s), CPU time, {rounds} round(s), tok/s min / median")
    for shape in shapes:
        prompts, tok = prompts_of(model_dir, tmp, *SHAPES[shape])
        samples = SHAPES[shape][1]
        n = len(prompts) // samples
        eos = tok.eos_token_ids

        def run_ours():
            out = generate(ours, prompts, NEW_TOKENS, eos_token_ids=eos,
                           pad_token_id=tok.pad_token_id,
                           generator=torch.Generator().manual_seed(0), slots=slots or None)
            return int(out.lengths.sum())

        @torch.no_grad()
        def run_theirs():
            torch.manual_seed(0)
            tokens = 0
            rows = slots or len(prompts)
            for i in range(0, len(prompts), rows):
                ids, mask = left_padded(prompts[i:i + rows], tok.pad_token_id)  # (n, P)
                out = theirs.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                      temperature=1.0, top_p=1.0, top_k=0,
                                      max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                                      pad_token_id=tok.pad_token_id)
                tokens += sum(lengths_to_eos(out[:, ids.shape[1]:], eos))
            return tokens

        for precision in precisions:
            def within(run):
                def timed():
                    with in_precision(precision):
                        return run()
                return timed
            timed = timed_rounds(rounds, {"ours": within(run_ours),
                                          "transformers": within(run_theirs)})
            rates = {name: [tokens / seconds for seconds, tokens in rows]
                     for name, rows in timed.items()}
            ratios = [a / b for a, b in zip(rates["ours"], rates["transformers"])]
            print(f"  {shape} ({n} prompts x {samples}), {precision}: ours {spread(rates['ours'])},"
                  f" transformers {spread(rates['transformers'])}; ours / transformers "
                  f"{spread(ratios, '.2f')}x")


def spread(values: list[float], fmt: str = ".0f") -> str:
    """min / median of the rounds."""
    return f"{min(values):{fmt}} / {statistics.median(values):{fmt}}"


def step_part(model_dir: str, rounds: int, precisions: list[str], tmp: str,
              arms: tuple[str, ...] = ("dapo",)):
    """The RL step in each precision, and with each arm's loss (experiments/real_neighbours.py's
    arms: dapo, gspo, ...); the roofline line for DAPO's."""
    train, val = sums.write_task(tmp)
    task = real.Task(train, val)
    cfgs = {arm: replace(parse_args(real.dapo_argv(model_dir, task, tmp, 0, tuple(ARMS[arm]))),
                         device="cpu", dynamic_sampling=False)  # one generation batch a step
            for arm in arms}
    cfg = cfgs[arms[0]]
    verifier = load_verifier(cfg)
    tok = load_tokenizer(model_dir)
    rows = load_rows(train, tok, rewarded=verifier.rewards)[:cfg.train_prompts]
    base = Transformer.from_pretrained(model_dir, dtype=torch.float32)
    start = {k: v.clone() for k, v in base.state_dict().items()}
    batches = {}  # per precision and arm, its last collected batch: the roofline's update

    def step(precision: str, arm: str):
        base.load_state_dict(start)
        opt = torch.optim.AdamW(base.parameters(), lr=cfg.lr)
        run = replace(cfgs[arm], precision=precision)
        t0 = clock()
        collected = dapo.collect_batch(base, FixedRows(rows), tok, run, verifier,
                                       torch.Generator().manual_seed(0))
        t_collect = clock() - t0
        dapo.update_policy(base, opt, collected.to_train, run)
        batches[precision, arm] = collected.to_train
        return t_collect, clock() - t0 - t_collect, int(collected.to_train.response_mask.sum())

    timed = timed_rounds(rounds, {(p, arm): lambda p=p, arm=arm: step(p, arm)
                                  for p in precisions for arm in arms})
    print(f"RL step (dapo.collect_batch + dapo.update_policy, make real's settings, dynamic "
          f"sampling off): {cfg.train_prompts} prompts x {cfg.group_size}, "
          f"{torch.get_num_threads()} thread(s), CPU time, {rounds} round(s), seconds min / median")
    for (precision, arm), results in timed.items():
        collect, update = [r[0] for _, r in results], [r[1] for _, r in results]
        print(f"  {precision}{'' if arm == 'dapo' else ', ' + arm}: collect "
              f"{spread(collect, '.1f')}, update {spread(update, '.1f')} (response tokens "
              f"{', '.join(str(r[2]) for _, r in results)})")
        if arm != arms[0]:
            continue
        base.load_state_dict(start)
        opt = torch.optim.AdamW(base.parameters(), lr=cfg.lr)
        with FlopCounterMode(display=False) as counter:  # the same update again, counted
            dapo.update_policy(base, opt, batches[precision, arm],
                               replace(cfg, precision=precision))
        flops, seconds = counter.get_total_flops(), statistics.median(update)
        rows_per_matmul = cfg.micro_batch_tokens or cfg.micro_batch_size * 64
        peak = matmul_peak(base.config, rows_per_matmul, PEAK_DTYPE[precision])
        print(f"  {precision} update: {flops / 1e12:.2f} TFLOP in {seconds:.1f} s = "
              f"{flops / seconds / 1e9:.0f} GFLOP/s, {100 * flops / seconds / peak:.0f}% of the "
              f"1-thread matmul peak at the model's shapes ({peak / 1e9:.0f} GFLOP/s at "
              f"{rows_per_matmul} rows)")


# what the update's matmuls run in: bf16 autocast casts both sides of a matmul to bf16
PEAK_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_peak(cfg, rows: int, dtype) -> float:
    """FLOP/s of this process on the model's own matmuls at `rows` rows: each linear layer's forward
    (x W^T) and its backward's two (g W and g^T x), the output layer's too, timed together, best
    of 3. The roof under the update: its FLOPs are these matmuls, bar attention's few."""
    C, mlp, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    calls, flops = [], 0
    for n_in, n_out in ((C, q), (C, kv), (C, kv), (q, C), (C, mlp), (C, mlp), (mlp, C), (C, V)):
        x, w, g = (torch.randn(shape, dtype=dtype)
                   for shape in ((rows, n_in), (n_out, n_in), (rows, n_out)))
        calls += [lambda x=x, w=w: x @ w.T, lambda g=g, w=w: g @ w, lambda g=g, x=x: g.T @ x]
        flops += 3 * 2 * rows * n_in * n_out
    best = float("inf")
    for _ in range(3):
        t0 = clock()
        for call in calls:
            call()
        best = min(best, clock() - t0)
    return flops / best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=smollm2.OUT, help="(default: %(default)s)")
    ap.add_argument("--parts", default="rollout,step", help="(default: %(default)s)")
    ap.add_argument("--shapes", default="rl,eval", help="the rollouts (default: %(default)s)")
    ap.add_argument("--precisions", default="fp32,bf16", help="(default: %(default)s)")
    ap.add_argument("--slots", type=int, default=SLOTS,
                    help="rollout: rows decoding at once on both sides, 0 all (default: make "
                         "real's, %(default)s)")
    ap.add_argument("--arms", default="dapo", help="the step with each of these losses, "
                    "experiments/real_neighbours.py's arms, or all (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=1, help="(default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="(default: %(default)s)")
    args = ap.parse_args()
    if not from_gguf.is_converted(args.model):
        print(f"bench_real: skipped, no converted model in {args.model} (make real, or "
              "python -m examples.smollm2, writes it)")
        return
    torch.set_num_threads(args.threads)
    precisions = args.precisions.split(",")
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        if "rollout" in args.parts:
            rollout_part(args.model, args.rounds, precisions, args.shapes.split(","), args.slots,
                         tmp)
        if "step" in args.parts:
            arms = tuple(ARMS) if args.arms == "all" else tuple(args.arms.split(","))
            step_part(args.model, args.rounds, precisions, tmp, arms)


if __name__ == "__main__":
    main()
