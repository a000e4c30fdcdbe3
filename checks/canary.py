r"""
The learning canary: does the rollout after an optimizer step sample from the weights after it?

A run in bf16 can train on stale weights without a single error: an autocast region around the
whole loop keeps the bf16 copy of every weight from before the first optimizer step, so every
later rollout and update reads step-0 weights for every linear layer. Metrics then look like a
run that learns slowly. The canary catches it in one step, through dapo.py's own functions run
inside launch.session (the process set-up a training run gets):

    1. the sampler's greedy responses to a few prompts, and its log-prob of each token
       (dapo.rollout: the rollout's precision, KV cache and sampler)
    2. one optimizer step of dapo.update_policy with a planted advantage of +1 on every response
    3. the sampler's log-probs of the same responses again, and the trainer's move: the log-probs
       of response_logprobs before and after, with autocast off (fp32 in one process; FSDP2's
       mixed precision runs bf16 on the current shards)

It passes when the sampler's log-probs moved up as the trainer's did: the gap between the two
moves (token mean) within tolerance() (bf16's rounding of a log-prob), the trainer's move at
least MIN_MOVE times that (no pass by standing still). Exit 1 otherwise.

    python -m checks.canary --precision bf16                    # one process, CPU autocast
    torchrun --nproc_per_node=2 -m checks.canary --precision bf16   # FSDP2, gloo on CPU
    python -m checks.canary --precision bf16 --device cuda      # the GPU check's
"""
import argparse
import math
import os
import sys
from dataclasses import replace

import torch

import dapo
import launch
from config import Config
from infra import distributed
from infra.precision import BF16_UNIT_ROUNDOFF
from model import Transformer, preset
from logprobs import response_logprobs
from reward import Verifier
from toy import make_toy_tokenizer, toy_rows


# bf16 keeps 8 significant bits: a rounding is off by at most u = 2^-8 of the value. A log-prob of
# a random model is about -log(V) (-5.7 for the toy tokenizer's V = 287), whose last bit in bf16 is
# log(V) u (0.022); the two moves may differ by two such bits (0.045). Measured on CPU, V = 287,
# one process: a gap of 0.001-0.002 (a token mean cancels most rounding) against moves of 0.41;
# with an autocast region around the whole run (the rollout on the weights from before the step):
# a sampler move of 0.06 against the trainer's 0.41, a gap of 0.36.
def tolerance(vocab_size: int) -> float:
    """The gap allowed between the two moves, nats per token."""
    return 2 * math.log(vocab_size) * BF16_UNIT_ROUNDOFF


MIN_MOVE = 4  # x the tolerance: the trainer's move must be one that the tolerance could not hide


def greedy(model, rows, tok, cfg):
    """The sampler's greedy responses and their log-probs, as the loop's rollout makes them."""
    return dapo.rollout(model, rows, tok, cfg, Verifier(), group_size=1, temperature=0.0,
                        top_p=1.0, top_k=0, generator=None)  # the weights gathered inside


@torch.no_grad()
def trainer_logprobs(model, batch, cfg):
    """The trainer's log-probs of the batch's responses on the weights as they are now."""
    with torch.autocast(torch.device(cfg.device).type, enabled=False):
        logp, _ = response_logprobs(model, batch, 1.0, cfg.fused_head)
    return logp.float() * batch.response_mask  # (N, R)


def token_mean(x, mask):
    """The token mean over every rank's rows."""
    total, count = distributed.all_reduce([float((x * mask).sum()), float(mask.sum())])
    return total / max(count, 1.0)


def write_model(model_dir: str, preset_name: str):
    """A random model of this preset (seed 0: the same on every rank), with the toy tokenizer."""
    tok = make_toy_tokenizer(model_dir)
    torch.manual_seed(0)
    Transformer(preset(preset_name, vocab_size=tok.vocab_size)).save_pretrained(model_dir)


def canary(cfg: Config) -> dict:
    rank, world = distributed.rank(), distributed.world_size()
    model, tok, _, _ = launch.load_policy(cfg)
    rows = toy_rows(64, seed=cfg.seed, split="train")[:cfg.train_prompts][rank::world]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    before = greedy(model, rows, tok, cfg)
    trainer_before = trainer_logprobs(model, before, cfg)
    planted = replace(before, adv=torch.ones(len(before), device=before.score.device))
    dapo.update_policy(model, opt, planted, cfg)
    after = greedy(model, rows, tok, cfg)
    trainer_after = trainer_logprobs(model, before, cfg)
    # the rows whose greedy response is the same token for token (the planted step pushed each
    # up, so nearly all)
    R = min(before.response_ids.shape[1], after.response_ids.shape[1])
    same = ((before.response_ids[:, :R] == after.response_ids[:, :R]) | ~before.response_mask[:, :R]
            ).all(-1) & (before.response_lengths == after.response_lengths)
    mask = before.response_mask & same[:, None]  # (N, R)
    sampler_move = token_mean(after.rollout_logp[:, :R] - before.rollout_logp[:, :R], mask[:, :R])
    trainer_move = token_mean(trainer_after - trainer_before, mask)
    n_same, n_rows = distributed.all_reduce([int(same.sum()), len(same)])
    tol = tolerance(model.config.vocab_size)
    return {"sampler_move": sampler_move, "trainer_move": trainer_move, "tolerance": tol,
            "gap": abs(sampler_move - trainer_move), "rows_compared": f"{n_same:.0f}/{n_rows:.0f}",
            "ok": abs(sampler_move - trainer_move) <= tol and trainer_move >= MIN_MOVE * tol
            and n_same >= n_rows / 2}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dir", default=os.path.join("runs", "canary"),
                   help="the random model (a copy per rank) and the run go here (replaced)")
    args = p.parse_args()
    # before launch.plan, whose memory plan reads the model's config.json; each rank writes its
    # own copy, as no process group exists yet to wait for rank 0's
    model_dir = os.path.join(args.dir, f"model-rank{os.environ.get('RANK', '0')}")
    write_model(model_dir, args.preset)
    cfg = Config(model=model_dir, out_dir=os.path.join(args.dir, "run"),
                 overwrite=True, device=args.device, precision=args.precision,
                 train_prompts=args.prompts, mini_batch_prompts=args.prompts,
                 max_response_len=args.max_response_len, overlong_buffer=1, max_prompt_len=64,
                 lr=args.lr,
                 grad_clip=1e9, eval_every=0)
    with launch.session(cfg) as cfg:
        result = canary(launch.plan(cfg))
    if int(os.environ.get("RANK", "0")) == 0:  # the process group is gone: rank() says 0
        print(f"learning canary ({args.precision}, {args.device}, "
              f"{distributed.launched_world()} process(es)): sampler moved "
              f"{result['sampler_move']:+.4f}, trainer {result['trainer_move']:+.4f} nats a "
              f"token (gap {result['gap']:.4f}, tolerance {result['tolerance']:.4f}; rows "
              f"{result['rows_compared']}): {'ok' if result['ok'] else 'FAILED'}")
    if not result["ok"]:
        sys.exit(1)
    distributed.exit_after_shutdown()


if __name__ == "__main__":
    main()
