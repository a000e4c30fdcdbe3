"""
DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al. 2025, arXiv 2503.14476).

DAPO is GRPO (sample G answers per prompt, reward each, use the group-normalised reward as every
token's advantage) with four changes, each a short named function below, called under a banner
where Algorithm 1 of the paper applies it:
1. clip-higher       policy_loss(): the upper clip bound is decoupled and raised  (Sec. 3.1, Eq. 10)
2. dynamic sampling  keep_groups(): drop groups whose answers are all right or
                     all wrong, and sample more prompts until the batch is full   (Sec. 3.2, Eq. 11)
3. token-level loss  policy_loss(): one mean over every token of the mini-batch   (Sec. 3.3, Eq. 12)
4. overlong shaping  shape_rewards(): a soft length penalty near the limit        (Sec. 3.4, Eq. 13)
No KL term and no reference model. Entropy is measured and logged, never added to the loss.

    python dapo.py                  # the embedded demo: a tiny model learns the toy task on CPU
    python dapo.py --help           # every flag; the README has the paper's full command line
    python dapo.py --eval-only --model PATH --val-data aime-2024.parquet --eval-samples 32
"""
import contextlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, replace

import torch
from tqdm import tqdm

import checkpoint
import distributed
from batch import Batch
from config import Config, check_flags, parse_args
from data import (PromptIterator, Tokenizer, check_vocab, encode_prompts, load_rows,
                  load_tokenizer)
from kernels import linear_logprobs_and_entropy, logprobs_and_entropy
from model import Qwen2
from reward import overlong_penalty, score_response
from sampler import generate
from toy import demo_base_model, make_toy_tokenizer, toy_rows


# ------------------------------------------------------------------------------------------------
# The DAPO techniques, one function each (course assignments point at these names)

def group_advantages(rewards, group_size, eps=1e-6):
    """GRPO's advantage (paper Eq. 9), the same for every token of response i:

        A_i = (R_i - mean(R_group)) / (std(R_group) + eps)

    rewards (N,), each group's G responses contiguous -> (N,). std is unbiased (N - 1), as
    torch.std and verl; a group of one sample gets mean 0 and std 1 (verl's convention)."""
    # exercise: group_advantages
    r = rewards.view(-1, group_size)  # (N/G, G)
    if group_size == 1:
        return (r / (1 + eps)).flatten()
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).flatten()  # (N,)
    # end exercise


def keep_groups(acc, group_size):
    """Which groups carry a learning signal: 0 < #correct < G (Eq. 11's constraint). A group whose
    answers are all right or all wrong has zero advantage everywhere: no gradient, only a smaller
    effective batch. acc (N,) is correctness, not the shaped reward (a group all correct but with
    different overlong penalties is still dropped) -> (N/G,) bool. As verl: population std > 0,
    or a group of one."""
    # exercise: keep_groups
    a = acc.float().view(-1, group_size)  # (N/G, G)
    return (a.std(1, unbiased=False) > 0) | (group_size == 1)
    # end exercise


def policy_loss(logp, old_logp, adv, loss_mask, eps_low, eps_high, denom, dual_clip=0.0):
    """The clipped surrogate with decoupled bounds (Eq. 10), r_it = pi_theta / pi_old:

        l_it = max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high))

    summed as sum_it l_it * mask_it / denom. With denom = the number of response tokens in the
    whole mini-batch (counted before it is split into micro-batches, and over every rank), this is
    Eq. 12's token-level mean: every token weighs the same, so long responses are not diluted.
    Naive GRPO's loss (a mean per sequence, then over sequences) is denom = |o_i| * n_sequences.
    logp, old_logp, loss_mask (B, R); adv (B,); denom a number or (B, 1).
    dual_clip > 1 caps the loss of a negative-advantage token at -A * c (verl's dual clip).
    Returns the loss and the sums over masked tokens of the statistics the loop logs."""
    # exercise: policy_loss
    mask = loss_mask.float()
    adv = adv[:, None]  # (B, 1): one advantage for every token of a response
    # clamped as verl does: exp() of a log-ratio above ~88.7 is inf, and one inf makes the whole
    # gradient NaN (a clamped token gets no gradient: it is clipped anyway)
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))  # (B, R)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss_tok = torch.maximum(-adv * ratio, -adv * clipped)  # (B, R) the pessimistic of the two
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip > 1:
        dual = (adv < 0) & (loss_tok > -adv * dual_clip)  # (B, R)
        loss_tok = torch.where(dual, -adv * dual_clip, loss_tok)
    loss = (loss_tok * mask / denom).sum()
    # end exercise
    with torch.no_grad():  # sums over the tokens in the loss; the loop divides by their count
        up_clipped = (adv > 0) & (ratio > 1 + eps_high)  # (B, R)
        old_prob = old_logp.exp() * mask
        stats = {
            "pg_loss": (loss_tok * mask).sum(),
            "clip_high": (up_clipped * mask).sum(),
            "clip_low": (((adv < 0) & (ratio < 1 - eps_low)) * mask).sum(),
            "dual_clip": (dual * mask).sum(),
            "kl": ((old_logp - logp) * mask).sum(),  # first-order KL(pi_old || pi), as verl
            "up_clipped_prob": (old_prob * up_clipped).sum(),  # paper Fig. 3a: rare tokens
            "token_prob": old_prob.sum(),  # paper Fig. 7d
        }
    return loss, stats


def shape_rewards(lengths, score, cfg):
    """Reward = correctness + DAPO's soft overlong punishment (Eq. 13, reward.overlong_penalty):
    0 up to L_max - L_cache tokens, then linearly down to -1 at L_max. lengths, score (N,)."""
    if not cfg.overlong_shaping:
        return score.clone()
    penalty = [overlong_penalty(int(n), cfg.max_response_len, cfg.overlong_buffer,
                                cfg.overlong_factor) for n in lengths]
    return score + torch.tensor(penalty, device=score.device)  # (N,)


# ------------------------------------------------------------------------------------------------
# Rollout, scoring and evaluation

@torch.no_grad()
def rollout(model, rows, tok: Tokenizer, cfg, *, group_size, temperature, top_p, top_k,
            generator) -> Batch:
    """Sample group_size responses to each row's prompt and score them with the row's verifier.
    All of them go to the sampler at once; --rollout-batch-size of them decode at a time (the
    rows of the KV cache, which bound the rollout's memory), a finished one making room for the
    next."""
    prompts, _ = encode_prompts(rows, tok, cfg.max_prompt_len)
    sequences = [p for p in prompts for _ in range(group_size)]
    out = generate(model, sequences, cfg.max_response_len, temperature=temperature, top_p=top_p,
                   top_k=top_k, eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                   generator=generator, slots=min(cfg.rollout_batch_size or len(sequences),
                                                  len(sequences)), compile=cfg.compile)
    # decoded only for the verifier, which reads text
    scores = [score_response(row["data_source"], tok.decode(ids[:n].tolist()),
                             row["reward_model"]["ground_truth"])
              for row, ids, n in zip([r for r in rows for _ in range(group_size)],
                                     out.response_ids, out.lengths.tolist())]
    device = out.response_ids.device
    return Batch(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask,
                 response_ids=out.response_ids, response_mask=out.response_mask,
                 score=torch.tensor([s["score"] for s in scores], device=device),
                 acc=torch.tensor([bool(s["acc"]) for s in scores], device=device),
                 truncated=out.truncated, group_size=group_size)


def response_logprobs(model, batch: Batch, temperature, fused_head=True):
    """log pi(o_t | q, o_<t) and the entropy of that distribution, for every response token:
    (B, R) each, fp32 (0 on padding with the fused head). The output layer runs inside the model's
    forward (so that FSDP has it gathered) on response positions only. Fused (the default), it
    runs chunk by chunk inside the log-prob kernel and the (B, R, V) logits never exist; unfused,
    they do (6 GB for one 20k-token response at Qwen2.5's vocabulary), and the kernel still never
    materialises their fp32 softmax."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)  # (B, P + R)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)  # (B, P + R)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # RoPE counts real tokens only
    P = batch.prompt_ids.shape[1]

    def head(hidden, weight):  # hidden (B, P + R, C); column P - 1 + t predicts response token t
        hidden = hidden[:, P - 1:-1]  # (B, R, C)
        if fused_head:
            return linear_logprobs_and_entropy(hidden, weight, batch.response_ids, temperature,
                                               mask=batch.response_mask)
        logits = hidden @ weight.T  # (B, R, V)
        logp, entropy = logprobs_and_entropy(logits, batch.response_ids, temperature)
        return logp.clone(), entropy.clone()  # not views: FSDP2 loses the hooks of in-place views

    return model(ids, positions=positions, attention_mask=mask, head=head)  # (B, R) x 2


def evaluate(model, rows, tok, cfg, generator) -> dict:
    """avg@k (mean accuracy over k samples per problem: the paper's avg@32 on AIME) and pass@k
    (any of the k right). Under torch.distributed each rank takes every world_size-th problem
    and the counts are summed."""
    rank, world, k = distributed.rank(), distributed.world_size(), cfg.eval_samples
    mine = rows[rank::world]
    with distributed.gathered(model):  # a rank without a problem samples one and ignores it
        batch = rollout(model, mine or rows[:1], tok, cfg, group_size=k,
                        temperature=cfg.eval_temperature, top_p=cfg.eval_top_p, top_k=0,
                        generator=generator)
    acc = batch.acc.float().view(-1, k)[:len(mine)]  # (problems, k)
    right, any_right = distributed.all_reduce([acc.sum().item(), acc.amax(1).sum().item()],
                                              device=cfg.device)
    return {"val/acc": right / (len(rows) * k), f"val/pass@{k}": any_right / len(rows)}


# ------------------------------------------------------------------------------------------------
# Algorithm 1, lines 2-8: sample, reward and filter until the batch is full

def collect_batch(model, prompt_iter, tok, cfg, generator) -> tuple[Batch | None, dict]:
    """Generation batches of prompts from pi_old (the current policy), scored, reward-shaped
    (technique 4) and filtered (technique 2), until train_prompts groups with signal are kept
    over all ranks, or max_gen_batches is reached. Returns this rank's share of the training
    batch (None if nothing was kept) and the rollout's metrics, summed over ranks."""
    rank, world = distributed.rank(), distributed.world_size()
    kept: dict[int, Batch] = {}  # the groups with signal on this rank, by global group number
    seen, n_gen = [], 0
    while distributed.all_reduce(len(kept), device=cfg.device,
                                 name="dynamic-sampling count") < cfg.train_prompts:
        if cfg.max_gen_batches and n_gen == cfg.max_gen_batches:
            break
        # --- Rollout (Algorithm 1, lines 3-5): pi_old samples G responses per prompt ---
        prompts = prompt_iter.next_batch()
        with distributed.gathered(model):  # under FSDP: gather the weights once per generation
            batch = rollout(model, prompts[rank::world], tok, cfg, group_size=cfg.group_size,
                            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            generator=generator)
        # --- DAPO technique 4: overlong reward shaping (paper Sec. 3.4, Eq. 13) ---
        batch = replace(batch, reward=shape_rewards(batch.response_lengths, batch.score, cfg))
        seen.append(batch)
        # --- DAPO technique 2: dynamic sampling (paper Sec. 3.2): keep the groups with signal ---
        keep = torch.ones(batch.num_groups, dtype=torch.bool)
        if cfg.dynamic_sampling:
            keep = keep_groups(batch.acc, cfg.group_size)  # (groups,) bool
        for i in keep.nonzero().flatten().tolist():  # this rank's i-th prompt is prompts[i W + r]
            kept[n_gen * len(prompts) + i * world + rank] = batch.groups([i])
        n_gen += 1
    n_kept = distributed.all_reduce(len(kept), device=cfg.device)
    n_take = min(n_kept, cfg.train_prompts)
    cap_hit = n_kept < cfg.train_prompts
    if cap_hit:
        if cfg.on_gen_cap == "error":  # verl's behaviour
            raise RuntimeError(
                f"dynamic sampling found {n_kept} of {cfg.train_prompts} groups with signal in "
                f"--max-gen-batches {cfg.max_gen_batches} generation batches; raise the cap (0 = "
                "none), or --on-gen-cap train to train on the whole mini-batches kept")
        # train on whole mini-batches only: a partial one would take a full optimizer step
        n_take -= n_take % cfg.mini_batch_prompts
        say(f"dynamic sampling stopped at --max-gen-batches {cfg.max_gen_batches} with {n_kept} "
            f"of {cfg.train_prompts} groups with signal; training on {n_take}")
    # this rank's share of the first n_take, as one process would have kept them (distributed.py)
    shared = distributed.share_in_order(kept, n_take, cfg.mini_batch_prompts, cfg.device)
    batch = Batch.cat(shared) if n_take else None
    metrics = rollout_metrics(Batch.cat(seen), cfg) | {
        "train/num_gen_batches": n_gen, "train/gen_cap_hit": int(cap_hit),
        "train/groups_kept": n_take, "train/groups_surplus": n_kept - n_take}
    metrics["train/groups_filtered"] = n_gen * prompt_iter.batch_size - n_kept
    return batch, metrics


def rollout_metrics(seen: Batch, cfg) -> dict:
    """What the policy did this step, over every response generated (before the filter), summed
    over ranks. verl logs its rollout statistics over the trained batch only (see
    training_batch_metrics); these names are this project's own."""
    acc = seen.acc.float().view(-1, cfg.group_size)  # (groups, G)
    lengths = seen.response_lengths.float()
    sums = {
        "n": len(seen), "score": seen.score.sum().item(), "reward": seen.reward.sum().item(),
        "right": acc.sum().item(), "length": lengths.sum().item(),
        "truncated": seen.truncated.sum().item(),
        "all_right": (acc.min(1).values == 1).sum().item(),
        "all_wrong": (acc.max(1).values == 0).sum().item(),
    }
    totals = distributed.all_reduce([float(v) for v in sums.values()], device=cfg.device)
    s = dict(zip(sums, totals))
    n, groups = s["n"], s["n"] / cfg.group_size
    return {
        "rollout/acc": s["right"] / n, "rollout/score/mean": s["score"] / n,
        "rollout/reward/mean": s["reward"] / n, "rollout/response_length/mean": s["length"] / n,
        "rollout/response_length/max": distributed.all_reduce(lengths.max().item(), "max",
                                                              cfg.device),
        "rollout/clip_ratio": s["truncated"] / n,
        "rollout/frac_all_correct": s["all_right"] / groups,
        "rollout/frac_all_wrong": s["all_wrong"] / groups,
    }


def training_batch_metrics(batch: Batch, cfg) -> dict:
    """verl's data metrics, with verl's meanings: over the batch that is trained on, the score is
    the reward the advantage is computed from (the overlong penalty included); with no KL term
    the "rewards" are the same."""
    lengths = batch.response_lengths.float()
    n, score, length, truncated = distributed.all_reduce(
        [len(batch), batch.reward.sum().item(), lengths.sum().item(),
         batch.truncated.sum().item()], device=cfg.device)
    return {"critic/score/mean": score / n, "critic/rewards/mean": score / n,
            "response_length/mean": length / n, "response_length/clip_ratio": truncated / n,
            "response_length/max": distributed.all_reduce(lengths.max().item(), "max", cfg.device)}


# ------------------------------------------------------------------------------------------------
# Algorithm 1, lines 10-11: the policy update

def update_policy(model, opt, batch: Batch, cfg, eps_high) -> dict:
    """One epoch over the batch in mini-batches (one optimizer step each) of micro-batches
    (gradient accumulation). Under torch.distributed each rank holds its share of every
    mini-batch. Returns the step's training metrics, summed over ranks."""
    model.train()
    world = distributed.world_size()
    mini_rows = cfg.mini_batch_prompts // world * cfg.group_size  # this rank's rows per step
    sums = dict.fromkeys(STAT_NAMES, 0.0)
    # pi_old (Algorithm 1, line 4): with several optimizer steps per rollout the policy moves
    # between them, so the log-probs of the policy that sampled the batch are recomputed now by
    # the training model (the sampler's own differ in the last bits: its cached path sums in
    # another order). With one step, pi_old = pi_theta.detach() and this forward is skipped.
    if len(batch) > mini_rows:
        old_logp, sums["entropy"] = old_logprobs(model, batch, cfg)
        batch = replace(batch, old_logp=old_logp)
    grad_norms, n_updates, n_skipped = [], 0, 0
    for mini_batch in batch.split(mini_rows):
        # --- DAPO technique 3: the token-level loss's denominator, counted over the whole
        # mini-batch on every rank before it is split into micro-batches, so that the gradient
        # does not depend on the split (verl PR #623, TRL #5619: dividing per micro-batch) ---
        # exercise: token_count
        mask = loss_mask(mini_batch, cfg)  # (B, R)
        n_tokens, n_seqs = distributed.all_reduce(
            [mask.sum().item(), mask.any(-1).sum().item()], device=cfg.device)
        # end exercise
        if n_tokens == 0:
            continue
        for rows, real in micro_batches(mini_batch, cfg):
            micro = mini_batch.rows(rows)
            mask = loss_mask(micro, cfg) & real  # (B, R); a stand-in micro-batch trains nothing
            # (B, R) x 2
            logp, entropy = response_logprobs(model, micro, cfg.temperature, cfg.fused_head)
            if micro.old_logp is None:  # one optimizer step: this forward is pi_old's
                old_logp = logp.detach()
                sums["entropy"] += (entropy.detach() * micro.response_mask * real).sum().item()
            else:
                old_logp = micro.old_logp
            if cfg.token_level_loss:
                denom = n_tokens
            else:  # naive GRPO: each sequence's mean, then the mean over sequences
                denom = mask.sum(-1, keepdim=True).clamp(min=1) * n_seqs
            # --- DAPO technique 1: clip-higher, in the clipped surrogate (Sec. 3.1, Eq. 10) ---
            loss, stats = policy_loss(logp, old_logp, micro.adv, mask, cfg.eps_low, eps_high,
                                      denom, cfg.dual_clip)
            (loss * world).backward()  # FSDP averages gradients over ranks; the loss is global
            for k, v in stats.items():
                sums[k] += v.item()
            sums["tokens"] += mask.sum().item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grad_norm = distributed.as_local(grad_norm)
        if torch.isfinite(grad_norm):
            opt.step()
            n_updates += 1
            # NaN weights would train on (every group then looks all-wrong) into every checkpoint
            checkpoint.check_finite(model, "after an optimizer step")
        else:  # a NaN/inf anywhere in the gradient: skip the update, the weights stay finite
            n_skipped += 1
            say(f"non-finite gradient norm ({grad_norm.item()}): update skipped")
        opt.zero_grad(set_to_none=True)
        grad_norms.append(grad_norm.item())
    sums["all_tokens"] = batch.response_mask.sum().item()
    sums["trained_tokens"] = (batch.prompt_mask.sum() + batch.response_mask.sum()).item()
    s = dict(zip(sums, distributed.all_reduce(list(sums.values()), device=cfg.device)))
    finite = [g for g in grad_norms if math.isfinite(g)]
    tokens, all_tokens = max(s["tokens"], 1), max(s["all_tokens"], 1)
    return {
        # verl's names and meanings (verl/trainer/ppo/core_algos.py, dp_actor.py)
        "actor/pg_loss": s["pg_loss"] / tokens,
        "actor/pg_clipfrac": (s["clip_high"] + s["clip_low"]) / tokens,  # either bound binds
        "actor/pg_clipfrac_lower": s["dual_clip"] / tokens,  # the dual clip binds
        "actor/ppo_kl": s["kl"] / tokens,
        "actor/entropy": s["entropy"] / all_tokens,  # of pi_old, before the update
        "actor/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
        # this project's: each clip bound on its own, and what the paper plots in Fig. 3a, 7d
        "dapo/clipfrac_high": s["clip_high"] / tokens, "dapo/clipfrac_low": s["clip_low"] / tokens,
        "dapo/up_clipped_prob": s["up_clipped_prob"] / max(s["clip_high"], 1),
        "dapo/token_prob": s["token_prob"] / tokens,
        "train/updates": n_updates, "train/skipped_updates": n_skipped,
        "train/tokens": s["trained_tokens"],
    }


STAT_NAMES = ("pg_loss", "clip_high", "clip_low", "dual_clip", "kl", "up_clipped_prob",
              "token_prob", "entropy", "tokens")


def loss_mask(batch: Batch, cfg):
    """The response tokens in the loss: all of them, or (overlong filtering, an ablation row of
    the paper's Table 1) those of the responses that were not truncated. (B, R) bool."""
    if cfg.overlong_filtering:
        return batch.response_mask & ~batch.truncated[:, None]
    return batch.response_mask


@torch.no_grad()
def old_logprobs(model, batch: Batch, cfg):
    """log pi_old of every response token, in micro-batches: (N, R) fp32 (float64 for a float64
    model), 0 on padding; and the sum of pi_old's entropy over those tokens."""
    old_logp = None
    entropy_sum = 0.0
    for rows, real in micro_batches(batch, cfg):
        micro = batch.rows(rows)
        # (B, R_micro) x 2
        logp, entropy = response_logprobs(model, micro, cfg.temperature, cfg.fused_head)
        if old_logp is None:
            old_logp = logp.new_zeros(batch.response_ids.shape)  # (N, R)
        if real:
            old_logp[rows, :logp.shape[1]] = logp.masked_fill(~micro.response_mask, 0.0)
            entropy_sum += (entropy * micro.response_mask).sum().item()
    return old_logp, entropy_sum


def micro_batches(batch: Batch, cfg, pad: bool = True) -> list[tuple[torch.Tensor, bool]]:
    """(row indices, real) of each micro-batch: --micro-batch-size rows at a time or, with
    --micro-batch-tokens, rows sorted by length and packed while the micro-batch's padded size
    (rows x its longest prompt + longest response) stays within the budget, so that little of
    the forward and backward is spent on padding and memory is bounded by tokens (verl's
    use_dynamic_bsz). A longer row goes alone. The loss's denominator is counted before the
    split, so the split changes no gradient. Every rank makes as many as the one with the most
    (each forward is a collective under FSDP), with stand-ins (real=False) that train nothing."""
    if cfg.micro_batch_tokens:
        prompt_len, response_len = batch.prompt_mask.sum(-1), batch.response_lengths  # (N,)
        order = (prompt_len + response_len).argsort(descending=True, stable=True).tolist()
        parts, current, widest_prompt, widest_response = [], [], 0, 0
        for i in order:
            p = max(widest_prompt, int(prompt_len[i]))
            r = max(widest_response, int(response_len[i]))
            if current and (len(current) + 1) * (p + r) > cfg.micro_batch_tokens:
                parts.append(current)
                current, p, r = [], int(prompt_len[i]), int(response_len[i])
            current.append(i)
            widest_prompt, widest_response = p, r
        parts.append(current)
    else:
        parts = [list(range(i, min(i + cfg.micro_batch_size, len(batch))))
                 for i in range(0, len(batch), cfg.micro_batch_size)]
    device = batch.prompt_ids.device
    out = [(torch.tensor(rows, device=device), True) for rows in parts]
    if not pad:
        return out
    most = int(distributed.all_reduce(len(out), "max", cfg.device, name="micro-batch count"))
    return out + [(out[0][0][:1], False)] * (most - len(out))


# ------------------------------------------------------------------------------------------------
# The training loop (paper Algorithm 1)

def train(cfg: Config):
    rank = distributed.rank()
    model, tok, tok_dir, resume_dir = load_policy(cfg)
    train_rows, val_rows = load_data(cfg, tok)
    eps_high = cfg.eps_high if cfg.clip_higher else cfg.eps_low  # technique 1 off: PPO's clip
    if cfg.eval_only:
        result = evaluate(model, val_rows, tok, cfg, eval_generator(cfg))
        if rank == 0:
            print(json.dumps(result))
        return result
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999),
                            weight_decay=cfg.weight_decay)
    gen_prompts = cfg.gen_prompts if cfg.dynamic_sampling else cfg.train_prompts
    prompt_iter = PromptIterator(train_rows, gen_prompts, cfg.seed)
    generator = torch.Generator(cfg.device).manual_seed(cfg.seed + rank)
    start = 0
    if resume_dir:
        start = checkpoint.load_trainer_state(resume_dir, opt, prompt_iter, generator)
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if rank == 0 and resume_dir:  # rows logged after the checkpoint was saved are logged again
        checkpoint.trim_metrics(metrics_path, start)
    first_val = last_val = None
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="dapo",
               dynamic_ncols=True, disable=rank != 0)
    for step in bar:  # Algorithm 1, line 1
        if cfg.eval_every and step % cfg.eval_every == 0:
            last_val = evaluate(model, val_rows, tok, cfg, eval_generator(cfg))
            first_val = first_val or last_val
            log_metrics(metrics_path, {"step": step, **last_val})
        t0 = time.time()
        set_lr(opt, cfg, step)
        # --- Algorithm 1, lines 2-8: sample, reward, filter, until the batch is full ---
        batch, metrics = collect_batch(model, prompt_iter, tok, cfg, generator)
        t_gen = time.time() - t0
        if batch is not None:
            metrics |= training_batch_metrics(batch, cfg)
            # --- Algorithm 1, line 9: group advantages (paper Eq. 9), one per response ---
            batch = replace(batch, adv=group_advantages(batch.reward, cfg.group_size))
            # --- Algorithm 1, lines 10-11: optimizer steps on the batch (Eq. 8) ---
            metrics |= update_policy(model, opt, batch, cfg, eps_high)
        t_train = time.time() - t0 - t_gen
        tokens = metrics.pop("train/tokens", 0)
        metrics |= {"step": step + 1, "actor/lr": opt.param_groups[0]["lr"],
                    "timing/gen_s": t_gen, "timing/train_s": t_train,
                    "perf/tokens_per_s": tokens / max(t_gen + t_train, 1e-9)}
        log_metrics(metrics_path, metrics)
        bar.set_postfix(progress_summary(metrics))
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
            checkpoint.save(cfg.out_dir, step + 1, model, tok_dir, opt, prompt_iter, generator,
                            asdict(cfg), keep_last=cfg.keep_checkpoints)
    if cfg.eval_every and start < cfg.steps:
        last_val = evaluate(model, val_rows, tok, cfg, eval_generator(cfg))
        log_metrics(metrics_path, {"step": cfg.steps, **last_val})
        if first_val:
            k = cfg.eval_samples
            say(f"val/acc (avg@{k}): {first_val['val/acc']:.3f} at step {start} -> "
                f"{last_val['val/acc']:.3f} at step {cfg.steps}; pass@{k}: "
                f"{first_val[f'val/pass@{k}']:.3f} -> {last_val[f'val/pass@{k}']:.3f}")
    return last_val


def set_lr(opt, cfg, step):
    """A linear warm-up over the first rollout steps, then constant (paper Sec. 4.1), from 0 at
    step 0 as verl's constant-with-warm-up schedule."""
    for group in opt.param_groups:
        group["lr"] = cfg.lr * min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr


def eval_generator(cfg):
    """A fresh generator per evaluation: every evaluation draws the same random numbers."""
    return torch.Generator(cfg.device).manual_seed(cfg.seed + 1 + distributed.rank())


def log_metrics(path, metrics: dict):
    if distributed.rank() == 0:
        with open(path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


def progress_summary(m: dict) -> dict:
    """The progress bar's numbers: the rollout's, and the policy's entropy when it trained."""
    out = {"acc": f"{m['rollout/acc']:.2f}", "reward": f"{m['rollout/reward/mean']:.2f}",
           "len": f"{m['rollout/response_length/mean']:.1f}"}
    if "actor/entropy" in m:  # no update when dynamic sampling kept less than a mini-batch
        out["entropy"] = f"{m['actor/entropy']:.2f}"
    return out


def say(text):
    if distributed.rank() == 0:
        tqdm.write(text)


# ------------------------------------------------------------------------------------------------
# Set-up: the policy, the tokenizer and the data

def load_policy(cfg) -> tuple[Qwen2, Tokenizer, str, str | None]:
    """The policy in fp32 (the master weights) and its tokenizer, from --model, from the latest
    checkpoint with --resume, or the demo's base model; sharded with FSDP2 on several processes.
    Returns (model, tokenizer, the tokenizer's directory, the checkpoint to resume or None)."""
    torch.manual_seed(cfg.seed)
    if cfg.eval_only:  # writes nothing to out_dir
        resume_dir = checkpoint.latest(cfg.out_dir) if cfg.resume else None
    else:  # never silently reuse a directory that holds a run
        resume_dir = checkpoint.prepare_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite)
    if resume_dir:  # refuse settings that would change the algorithm halfway through a run
        checkpoint.check_resume_config(checkpoint.saved_config(resume_dir), asdict(cfg),
                                       where=resume_dir)
    if resume_dir or cfg.model:
        tok_dir = os.path.join(resume_dir, "model") if resume_dir else cfg.model
        model = Qwen2.from_pretrained(tok_dir, dtype=torch.float32, device=cfg.device)
    else:
        tok_dir, model = build_demo_policy(cfg)
    tok = load_tokenizer(tok_dir)
    check_vocab(model.config.vocab_size, tok, tok_dir)
    model.activation_checkpointing = cfg.activation_checkpointing
    if distributed.world_size() > 1:  # on GPUs: bf16 compute, fp32 master weights and reductions
        distributed.shard(model, mixed_precision=cfg.device.startswith("cuda"))
    return model, tok, tok_dir, resume_dir


def build_demo_policy(cfg) -> tuple[str, Qwen2]:
    """The embedded demo: the toy tokenizer and a tiny model after a brief supervised warm-up
    (toy.py). Rank 0 trains it once and caches it; the other ranks then load the cache."""
    tok_dir = os.path.join(cfg.out_dir, "tokenizer")
    if distributed.rank() == 0:
        make_toy_tokenizer(tok_dir)
        model = demo_base_model(load_tokenizer(tok_dir), cfg.device, seed=cfg.seed)
    distributed.barrier()
    if distributed.rank() != 0:
        model = demo_base_model(load_tokenizer(tok_dir), cfg.device, seed=cfg.seed)
    return tok_dir, model


def load_data(cfg, tok) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows: DAPO-Math-17k / AIME-2024 files, or the toy task's splits.
    Every row of a file is checked now (a reward function for it, a prompt that renders and
    encodes), not when a step first draws it."""
    if cfg.train_data:
        train_rows = load_rows(cfg.train_data, tok)
    else:
        train_rows = toy_rows(20000, seed=cfg.seed, split="train")
    if cfg.val_data:
        val_rows = load_rows(cfg.val_data, tok)
    else:
        val_rows = toy_rows(1000, seed=cfg.seed, split="test")
    gen_prompts = cfg.gen_prompts if cfg.dynamic_sampling else cfg.train_prompts
    if not cfg.eval_only and len(train_rows) < gen_prompts:
        flag = "--gen-prompts" if cfg.dynamic_sampling else "--train-prompts"
        raise ValueError(f"{cfg.train_data}: {len(train_rows)} usable rows, fewer than {flag} "
                         f"{gen_prompts} (the prompts of one generation batch)")
    return train_rows, val_rows[:cfg.eval_prompts or None]


def main(cfg: Config):
    check_flags(cfg, world=int(os.environ.get("WORLD_SIZE", "1")))
    rank, world, cfg.device = distributed.init(cfg.device, timeout_s=cfg.dist_timeout)
    # data.py reports through logging: rank 0 shows it, the others only warnings
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    # one GPU: fp32 weights, bf16 compute by autocast (under FSDP the mixed-precision policy)
    autocast = contextlib.nullcontext()
    if cfg.device.startswith("cuda") and world == 1:
        autocast = torch.autocast("cuda", torch.bfloat16)
    try:
        with autocast:
            return train(cfg)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main(parse_args(description=__doc__))
    distributed.exit_after_shutdown()
