"""
Speed on the real model of `make real` (SmolLM2-135M-Instruct, converted by examples/smollm2.py):
its rollout against transformers' generate, and one RL step of dapo.py with the fused output
layer on and off. CPU, one thread by default, CPU time, the variants alternating round by round.

    .venv/bin/python benchmarks/bench_real.py                 # both parts, ~10 minutes of CPU
    .venv/bin/python benchmarks/bench_real.py --parts step --rounds 2

Skipped, saying so, when the model directory is absent (`make real` or examples/smollm2.py
writes it).

1. rollout: experiments/real.py's rollout, 8 held-out sums x G = 8 at temperature 1, up to 32 new
   tokens, <|im_end|> ends a response; fp32 on both sides (transformers' model in fp32 too).
   Ours: sampler.generate in 64 slots. Theirs: transformers' generate on the same 64 left-padded
   prompts at once. Useful tokens/s: response tokens up to and including the EOS. Each side draws
   its own samples, so lengths differ by chance: tokens/s, not seconds, is what compares.
2. step: dapo.collect_batch + dapo.update_policy with real.py's settings (8 prompts x 8, one
   optimizer step; dynamic sampling off, so a step is one rollout) three ways: bf16 autocast with
   --fused-head on (real.py's) and off, and fp32. Each round starts from the same weights, a fresh
   optimizer and the same sampling seed: in bf16 both heads train on the same responses.
"""
import argparse
import os
import statistics
import sys
from dataclasses import replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "experiments")]
import dapo  # noqa: E402
import real  # noqa: E402
import smollm2  # noqa: E402
import sums  # noqa: E402
from common import (FixedRows, clock, left_padded, lengths_to_eos,  # noqa: E402
                    timed_rounds)
from config import parse_args  # noqa: E402
from data import encode_prompts, load_rows, load_tokenizer  # noqa: E402
from launch import load_verifier  # noqa: E402
from infra import gguf  # noqa: E402
from model import Qwen2  # noqa: E402
from sampler import generate  # noqa: E402

PROMPTS, G, SLOTS = 8, 8, 64
NEW_TOKENS = real.SETTINGS["max_response_len"]


def prompts_of(model_dir: str, tmp: str) -> tuple[list[list[int]], object]:
    """The first PROMPTS held-out sums, each G times, through the model's chat template."""
    _, val = sums.write_task(tmp)
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}]}
            for r in real.first_rows(val, PROMPTS)]
    tok = load_tokenizer(model_dir)
    prompts, _ = encode_prompts(rows, tok, real.SETTINGS["max_prompt_len"])
    return [p for p in prompts for _ in range(G)], tok


def rollout_part(model_dir: str, rounds: int, tmp: str):
    import transformers
    transformers.utils.logging.disable_progress_bar()
    prompts, tok = prompts_of(model_dir, tmp)
    ours = Qwen2.from_pretrained(model_dir, dtype=torch.float32).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
    eos = tok.eos_token_ids
    ids, mask = left_padded(prompts, tok.pad_token_id)  # (N, P)

    def run_ours():
        out = generate(ours, prompts, NEW_TOKENS, eos_token_ids=eos, pad_token_id=tok.pad_token_id,
                       generator=torch.Generator().manual_seed(0), slots=SLOTS)
        return int(out.lengths.sum())

    @torch.no_grad()
    def run_theirs():
        torch.manual_seed(0)
        out = theirs.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                              top_p=1.0, top_k=0, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                              pad_token_id=tok.pad_token_id)
        return sum(lengths_to_eos(out[:, ids.shape[1]:], eos))

    timed = timed_rounds(rounds, {"ours (sampler.generate, 64 slots)": run_ours,
                                  "transformers generate": run_theirs})
    print(f"rollout: {len(prompts)} sequences ({PROMPTS} prompts x {G}), up to {NEW_TOKENS} new "
          f"tokens, fp32, {torch.get_num_threads()} thread(s), {rounds} rounds")
    rates = {}
    for name, rows in timed.items():
        rates[name] = [tokens / seconds for seconds, tokens in rows]
        print(f"  {name:<36} tok/s per round: " + ", ".join(f"{r:.0f}" for r in rates[name]) +
              f"  (tokens: {', '.join(str(t) for _, t in rows)})")
    ours_r, theirs_r = rates.values()
    ratios = [a / b for a, b in zip(ours_r, theirs_r)]
    print(f"  ours / transformers, round by round: {', '.join(f'{r:.2f}x' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}x")


def step_part(model_dir: str, rounds: int, tmp: str):
    train, val = sums.write_task(tmp)
    cfg = parse_args(real.dapo_argv(model_dir, real.Task(train, val), tmp, seed=0))
    cfg = replace(cfg, device="cpu", dynamic_sampling=False)  # one generation batch a step
    verifier = load_verifier(cfg)
    tok = load_tokenizer(model_dir)
    rows = load_rows(train, tok, has_scorer=verifier.has_scorer)[:cfg.train_prompts]
    base = Qwen2.from_pretrained(model_dir, dtype=torch.float32)
    start = {k: v.clone() for k, v in base.state_dict().items()}

    def step(fused: bool, precision: str):
        base.load_state_dict(start)
        opt = torch.optim.AdamW(base.parameters(), lr=cfg.lr)
        run = replace(cfg, fused_head=fused, precision=precision)
        t0 = clock()
        collected = dapo.collect_batch(base, FixedRows(rows), tok, run, verifier,
                                       torch.Generator().manual_seed(0))
        t_collect = clock() - t0
        dapo.update_policy(base, opt, collected.to_train, run)
        return t_collect, clock() - t0 - t_collect, int(collected.to_train.response_mask.sum())

    timed = timed_rounds(rounds, {"bf16, fused head": lambda: step(True, "bf16"),
                                  "bf16, unfused head": lambda: step(False, "bf16"),
                                  "fp32, fused head": lambda: step(True, "fp32")})
    print(f"RL step: {cfg.train_prompts} prompts x {cfg.group_size}, one optimizer step, "
          f"{torch.get_num_threads()} thread(s), {rounds} rounds (seconds)")
    for name, results in timed.items():
        collect = [r[0] for _, r in results]
        update = [r[1] for _, r in results]
        print(f"  {name:<19} collect {', '.join(f'{c:.1f}' for c in collect)}; update "
              f"{', '.join(f'{u:.1f}' for u in update)} (response tokens "
              f"{', '.join(str(r[2]) for _, r in results)})")
    fused, unfused, fp32 = ([r[0] + r[1] for _, r in results] for results in timed.values())
    for name, other in (("unfused head", unfused), ("fp32", fp32)):
        ratios = ", ".join(f"{o / f:.2f}x" for f, o in zip(fused, other))
        print(f"  the whole step, {name} / bf16 fused head, round by round: {ratios}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=smollm2.OUT, help="(default: %(default)s)")
    ap.add_argument("--parts", default="rollout,step", help="(default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="(default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="(default: %(default)s)")
    args = ap.parse_args()
    if not gguf.is_converted(args.model):
        print(f"bench_real: skipped, no converted model in {args.model} (make real, or "
              "python examples/smollm2.py, writes it)")
        return
    torch.set_num_threads(args.threads)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        if "rollout" in args.parts:
            rollout_part(args.model, args.rounds, tmp)
        if "step" in args.parts:
            step_part(args.model, args.rounds, tmp)


if __name__ == "__main__":
    main()
