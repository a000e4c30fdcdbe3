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
    python dapo.py --eval-only --model PATH --val-data aime-2024.parquet --out-dir runs/eval \\
        --max-prompt-len 2048 --max-response-len 20480 --eval-samples 32 --eval-top-p 0.7 \\
        --eval-prompts 0
"""
import os
import time
from dataclasses import asdict, dataclass, replace

import torch

import launch
from batch import Batch, group_number, groups_to_train, share_groups
from config import Config, parse_args
from data import PromptIterator, Tokenizer, encode_prompts
from infra import (checkpoint, distributed, health, interrupt, metrics, precision,
                   rollout_correction, trackers)
from model import response_logprobs
from reward import Verifier, overlong_penalty
from sampler import Engine


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
    """Which groups carry a learning signal: 0 < #correct < G (Eq. 11); a group all right or all
    wrong has zero advantage, so no gradient. acc (N,) is correctness, not the shaped reward ->
    (N/G,) bool. As verl: population std > 0, or a group of one."""
    # exercise: keep_groups
    a = acc.float().view(-1, group_size)  # (N/G, G)
    return (a.std(1, unbiased=False) > 0) | (group_size == 1)
    # end exercise


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # (): sum_it w_it l_it mask_it / denom, what to back-propagate
    loss_tok: torch.Tensor  # (B, R): l_it, before the weight, the mask and the denominator
    ratio: torch.Tensor  # (B, R): r_it, of the clamped log-ratio


def policy_loss(logp, old_logp, adv, loss_mask, eps_low, eps_high, denom, dual_clip=0.0,
                weight=1.0) -> PolicyLoss:
    """The clipped surrogate with decoupled bounds (Eq. 10), r_it = pi_theta / pi_old:

        l_it = max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high))

    summed as sum_it w_it l_it mask_it / denom: Eq. 12's token-level mean with denom = the response
    tokens of the whole mini-batch (all ranks), naive GRPO's mean of sequence means with denom =
    |o_i| * n_sequences. logp, old_logp, loss_mask (B, R); adv (B,); denom a number or (B, 1);
    weight (B, R), detached. dual_clip > 1 caps a negative-advantage token's loss at -A * c."""
    # exercise: policy_loss
    mask = loss_mask.float()
    adv = adv[:, None]  # (B, 1): one advantage for every token of a response
    # clamped: exp() above ~88.7 is inf, and one inf makes the gradient NaN (clipped anyway)
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))  # (B, R)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss_tok = torch.maximum(-adv * ratio, -adv * clipped)  # (B, R) the pessimistic of the two
    if dual_clip > 1:
        dual = (adv < 0) & (loss_tok > -adv * dual_clip)  # (B, R)
        loss_tok = torch.where(dual, -adv * dual_clip, loss_tok)
    return PolicyLoss((loss_tok * weight * mask / denom).sum(), loss_tok, ratio)
    # end exercise


def shape_rewards(lengths, score, cfg):
    """Reward = correctness + DAPO's soft overlong punishment (Eq. 13, reward.overlong_penalty):
    0 up to L_max - L_cache tokens, then linearly down to -1 at L_max. lengths, score (N,)."""
    if not cfg.overlong_shaping:
        return score.clone()
    penalty = [overlong_penalty(int(n), cfg.max_response_len, cfg.overlong_buffer,
                                cfg.overlong_factor) for n in lengths]
    return score + torch.tensor(penalty, device=score.device)  # (N,)


def tokens_in_loss(batch: Batch, cfg):
    """The response tokens in the loss: all of them, or (overlong filtering, an ablation row of
    the paper's Table 1) those of the responses that were not truncated. (B, R) bool."""
    if cfg.overlong_filtering:
        return batch.response_mask & ~batch.truncated[:, None]
    return batch.response_mask


# ------------------------------------------------------------------------------------------------
# Rollout and evaluation

@torch.no_grad()
def rollout(model, rows, tok: Tokenizer, cfg, verifier: Verifier, *, group_size, temperature,
            top_p, top_k, generator, engine: Engine | None = None) -> Batch:
    """Sample group_size responses to each row's prompt with the engine (sampler.py's by default;
    --rollout-engine vllm's) and score them with the row's verifier."""
    prompts, _ = encode_prompts(rows, tok, cfg.max_prompt_len)
    engine = engine or Engine(cfg, tok.pad_token_id)
    sampled = engine.generate(model, [p for p in prompts for _ in range(group_size)],
                              temperature=temperature, top_p=top_p, top_k=top_k,
                              eos_token_ids=tok.eos_token_ids, generator=generator)
    texts = tok.decode_rows(sampled.response_ids, sampled.lengths)  # the verifier reads text
    return Batch.from_rollout(sampled, verifier.score_responses(rows, group_size, texts),
                              group_size)


def evaluate(model, rows, tok, cfg, verifier, engine=None) -> dict:
    """avg@k (mean accuracy over k samples a problem: the paper's avg@32 on AIME) and pass@k,
    each rank taking every world_size-th problem, with a fresh generator: each draws alike."""
    rank, world, k = distributed.rank(), distributed.world_size(), cfg.eval_samples
    mine = rows[rank::world]
    generator = torch.Generator(cfg.device).manual_seed(cfg.seed + 1 + rank)
    # a rank without a problem samples one and ignores it (under FSDP forwards are collectives)
    batch = rollout(model, mine or rows[:1], tok, cfg, verifier, group_size=k, top_k=0,
                    temperature=cfg.eval_temperature, top_p=cfg.eval_top_p, generator=generator,
                    engine=engine)
    result = metrics.eval_metrics(batch, len(mine), len(rows), k)
    health.warn_evaluation(result, verifier.spec, verifier.take_errors(), batch)  # as a step
    return result


# ------------------------------------------------------------------------------------------------
# Algorithm 1, lines 2-8: sample, reward and filter until the batch is full

@dataclass
class Collected:
    to_train: Batch | None  # this rank's share of the training batch; None when nothing was kept
    generated: Batch  # every response this rank generated, kept or not (the alarms' example)
    metrics: dict  # the rollout's and dynamic sampling's, over all ranks


def collect_batch(model, prompt_iter, tok, cfg, verifier, generator, engine=None) -> Collected:
    """Generation batches from pi_old, scored, reward-shaped and filtered until --train-prompts
    groups with signal are kept over all ranks (or --max-gen-batches): this rank's share trains."""
    rank, world = distributed.rank(), distributed.world_size()
    kept: dict[int, Batch] = {}  # the groups with signal on this rank, by global group number
    gen_batches, ends = [], []  # this rank's generation batches, and the time each ended
    while True:
        n_kept = distributed.all_reduce(len(kept), name="dynamic-sampling count")  # all ranks'
        if n_kept >= cfg.train_prompts:
            break
        health.check_sampling(len(gen_batches), n_kept, cfg.train_prompts)
        if cfg.max_gen_batches and len(gen_batches) == cfg.max_gen_batches:
            break
        # --- Rollout (Algorithm 1, lines 3-5): pi_old samples G responses per prompt ---
        prompts = prompt_iter.next_batch()
        batch = rollout(model, prompts[rank::world], tok, cfg, verifier, group_size=cfg.group_size,
                        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        generator=generator, engine=engine)
        # --- DAPO technique 4: overlong reward shaping (paper Sec. 3.4, Eq. 13) ---
        batch = replace(batch, reward=shape_rewards(batch.response_lengths, batch.score, cfg))
        # --- Algorithm 1, line 9: group advantages (Eq. 9), here while each group is whole ---
        batch = replace(batch, adv=group_advantages(batch.reward, cfg.group_size))
        # --- DAPO technique 2: dynamic sampling (paper Sec. 3.2): keep the groups with signal ---
        keep = keep_groups(batch.acc, cfg.group_size) if cfg.dynamic_sampling else (
            torch.ones(batch.num_groups, dtype=torch.bool))  # (groups,) bool
        kept |= {group_number(len(gen_batches), len(prompts), i): batch.groups([i])
                 for i in keep.nonzero().flatten().tolist()}
        gen_batches.append(batch)
        ends.append(time.time())
    n_take = groups_to_train(n_kept, cfg)
    to_train = share_groups(kept, n_take, cfg.mini_batch_prompts, cfg.group_size)
    generated = Batch.cat(gen_batches)
    return Collected(to_train, generated, metrics.collection_metrics(
        generated, to_train, n_kept, n_take, ends, cfg.group_size, cfg.train_prompts,
        cfg.gen_batch_prompts))


# ------------------------------------------------------------------------------------------------
# Algorithm 1, lines 10-11: the policy update

@torch.no_grad()
def old_logprobs(model, batch: Batch, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi_old of every response token and the entropy of pi_old there, computed in
    micro-batches: (N, R) each, 0 on padding."""
    old_logp = old_entropy = None
    parts = batch.micro_batches(cfg.micro_batch_size, cfg.micro_batch_tokens)
    for index, stand_in in distributed.even_out(parts):  # as many on every rank
        micro = batch.rows(index)
        with precision.autocast(cfg.precision, cfg.device):
            logp, entropy = response_logprobs(model, micro, cfg.temperature, cfg.fused_head)
        if old_logp is None:
            old_logp = logp.new_zeros(batch.response_ids.shape)  # (N, R)
            old_entropy = torch.zeros_like(old_logp)
        if not stand_in:  # a stand-in only keeps the ranks' collectives in step
            old_logp[index, :logp.shape[1]] = logp.masked_fill(~micro.response_mask, 0.0)
            old_entropy[index, :logp.shape[1]] = entropy.masked_fill(~micro.response_mask, 0.0)
    return old_logp, old_entropy


def update_policy(model, opt, batch: Batch, cfg) -> dict:
    """One epoch over the batch in mini-batches (one optimizer step each) of micro-batches
    (gradient accumulation), each rank holding its share of every mini-batch -> the metrics."""
    model.train()
    world = distributed.world_size()
    mini_rows = cfg.mini_batch_prompts * cfg.group_size // world  # this rank's rows per step
    eps_high = cfg.eps_high if cfg.clip_higher else cfg.eps_low  # technique 1 off: PPO's clip
    stats = metrics.UpdateStats()
    # pi_old (Algorithm 1, line 4): with several optimizer steps the policy moves between them
    if len(batch) > mini_rows:
        old_logp, old_entropy = old_logprobs(model, batch, cfg)
        stats.add_old_policy(old_logp, old_entropy, batch)
        batch = replace(batch, old_logp=old_logp)
    for mini_batch in batch.split(mini_rows):
        # --- DAPO technique 3: the token-level loss's denominator, counted over the mini-batch
        # on every rank before the micro-batch split (verl PR #623, TRL #5619 divided after) ---
        # exercise: token_count
        mask = tokens_in_loss(mini_batch, cfg)  # (B, R)
        n_tokens, n_seqs = distributed.all_reduce([mask.sum().item(), mask.any(-1).sum().item()])
        # end exercise
        if n_tokens == 0:
            if mini_batch.old_logp is None:  # pi_old's entropy is logged whatever the loss mask
                stats.add_old_policy(*old_logprobs(model, mini_batch, cfg), mini_batch)
            continue
        parts = mini_batch.micro_batches(cfg.micro_batch_size, cfg.micro_batch_tokens)
        for index, stand_in in distributed.even_out(parts):  # as many on every rank
            micro = mini_batch.rows(index)
            mask = tokens_in_loss(micro, cfg) & (not stand_in)  # (B, R)
            with precision.autocast(cfg.precision, cfg.device):  # the forward: not around a step
                logp, entropy = response_logprobs(model, micro, cfg.temperature, cfg.fused_head)
            old_logp = micro.old_logp
            if old_logp is None:  # one optimizer step: this forward is pi_old's
                old_logp = logp.detach()
                stats.add_old_policy(old_logp, entropy, micro, stand_in)
            denom = n_tokens if cfg.token_level_loss else (  # off: naive GRPO's sequence mean
                mask.sum(-1, keepdim=True).clamp(min=1) * n_seqs)
            correction = rollout_correction.correct(  # pi_old / pi_sampler (not in the paper)
                old_logp, micro.rollout_logp, micro.response_mask, cfg.rollout_correction,
                cfg.rollout_is_min, cfg.rollout_is_max)
            # --- DAPO technique 1: clip-higher, in the clipped surrogate (Sec. 3.1, Eq. 10) ---
            surrogate = policy_loss(logp, old_logp, micro.adv, mask, cfg.eps_low, eps_high, denom,
                                    cfg.dual_clip, correction.weight)
            (surrogate.loss * world).backward()  # FSDP averages gradients; the loss is global
            stats.add_loss(surrogate, logp, old_logp, micro.adv, mask, correction)
        # Algorithm 1, line 11: one AdamW step on the mini-batch's gradient, its norm clipped
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grad_norm, finite = checkpoint.gradient_is_finite(grad_norm)  # else skipped, and said
        if finite:
            opt.step()
            checkpoint.check_finite(model, "after an optimizer step")
        opt.zero_grad(set_to_none=True)
        stats.add_step(grad_norm, finite)
    return stats.result(batch)


# ------------------------------------------------------------------------------------------------
# The training loop (paper Algorithm 1)

def set_lr(opt, cfg, step):
    """A linear warm-up from 0, then constant (paper Sec. 4.1; verl's constant-with-warm-up)."""
    for group in opt.param_groups:
        group["lr"] = cfg.lr * min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr


def train(cfg: Config, model, tok, tok_dir, resume_dir, train_rows, val_rows,
          verifier: Verifier, engine: Engine):  # a launch.Setup
    if cfg.eval_only:
        result = evaluate(model, val_rows, tok, cfg, verifier, engine)
        metrics.report_eval(result, cfg.out_dir, asdict(cfg), trackers.open_all(cfg))
        return result
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    prompt_iter = PromptIterator(train_rows, cfg.gen_batch_prompts, cfg.seed)
    generator = torch.Generator(cfg.device).manual_seed(cfg.seed + distributed.rank())
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    start = checkpoint.resume(resume_dir, model, opt, prompt_iter, generator, metrics_path,
                              cfg.steps, cfg.eval_every) if resume_dir else 0
    log = metrics.RunLog(metrics_path, start, cfg.steps,
                         trackers.open_all(cfg, start, metrics_path))
    alarms = health.Alarms(cfg.stop_when_stuck, verifier.spec)
    stop = interrupt.Stop()  # Ctrl-C, SIGTERM: the step finishes, is saved, then the run exits
    for step in range(start, cfg.steps):  # Algorithm 1, line 1
        if cfg.eval_every and step % cfg.eval_every == 0:
            log.evaluated(step, evaluate(model, val_rows, tok, cfg, verifier, engine))
        t0 = time.time()
        set_lr(opt, cfg, step)
        # --- Algorithm 1, lines 2-8: sample, reward, filter, until the batch is full ---
        collected = collect_batch(model, prompt_iter, tok, cfg, verifier, generator, engine)
        t_gen, logged = time.time() - t0, collected.metrics
        if collected.to_train is not None:
            # --- Algorithm 1, lines 10-11: optimizer steps on the batch (Eq. 8) ---
            with engine.updating(model):  # vLLM: asleep on a GPU, then given the new weights
                logged |= update_policy(model, opt, collected.to_train, cfg)
        done = step + 1  # the steps taken: what metrics.jsonl and the checkpoints count
        log.step(done, logged, opt.param_groups[0]["lr"], t_gen, time.time() - t0 - t_gen)
        stuck = alarms.check(done, logged, collected.generated, tok, verifier.take_errors())
        stopping = stop.requested()  # Ctrl-C or SIGTERM, on any rank (infra/interrupt.py)
        if stuck or stopping or (cfg.save_every and done % cfg.save_every == 0) or \
                done == cfg.steps:
            checkpoint.save(cfg.out_dir, done, model, tok_dir, opt, prompt_iter, generator,
                            asdict(cfg), keep_last=cfg.keep_checkpoints)
        if stuck:
            raise alarms.error()
        if stopping:
            raise stop.exit(done)  # says how to resume; exit status 130 or 143
    alarms.finish()  # a run that took no optimizer step trained nothing: a non-zero exit
    # the evaluation at --steps; a resume at --steps makes it if it was never logged (a kill)
    if checkpoint.final_evaluation_due(metrics_path, start, cfg.steps, cfg.eval_every):
        log.evaluated(cfg.steps, evaluate(model, val_rows, tok, cfg, verifier, engine))
        log.say_eval_change(cfg.eval_samples)
    return log.last_val


def main(cfg: Config):
    with launch.session(cfg) as cfg:  # the checks, the processes; cfg with the device resolved
        cfg = launch.plan(cfg)  # the memory plan, printed; --rollout-slots auto resolved
        return None if cfg.plan else train(cfg, **vars(launch.setup(cfg)))  # --plan: it alone


if __name__ == "__main__":
    with launch.user_errors_in_one_line():  # `error: ...` for a user's mistake, no traceback
        main(parse_args(description=__doc__))
    distributed.exit_after_shutdown()
