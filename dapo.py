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
    python dapo.py --help           # every flag, with the paper's value
    python dapo.py --eval-only --model PATH --val-data aime-2024.parquet --out-dir runs/eval \\
        --max-prompt-len 2048 --max-response-len 20480 --eval-samples 32 --eval-top-p 0.7 \\
        --eval-prompts 0
"""
import time
from dataclasses import replace

import torch

import launch
import losses
from batch import Batch, Collected, GroupBuffer, groups_to_train
from config import Config, parse_args
from data import PromptIterator, Tokenizer, encode_prompts
from infra import distributed, metrics, precision
from infra.run import Run, report_eval
from losses import PolicyLoss
from logprobs import response_logprobs
from reward import Verifier, overlong_penalty


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


def advantages(rewards, cfg):
    """Eq. 9's group advantage, or with --scale-rewards batch / none TRL's batch-scaled one or Dr.
    GRPO's unscaled one (losses.advantages). rewards (N,) -> (N,)."""
    if cfg.scale_rewards == "group":
        return group_advantages(rewards, cfg.group_size)
    return losses.advantages(rewards, cfg.group_size, cfg.scale_rewards)


def keep_groups(acc, group_size):
    """Which groups carry a learning signal: 0 < #correct < G (Eq. 11); a group all right or all
    wrong has zero advantage, so no gradient. acc (N,) is correctness, not the shaped reward ->
    (N/G,) bool. As verl: population std > 0, or a group of one."""
    # exercise: keep_groups
    a = acc.float().view(-1, group_size)  # (N/G, G)
    return (a.std(1, unbiased=False) > 0) | (group_size == 1)
    # end exercise


def policy_loss(logp, old_logp, adv, loss_mask, eps_low, eps_high, denom) -> PolicyLoss:
    """The clipped surrogate with decoupled bounds (Eq. 10), r_it = pi_theta / pi_old:

        l_it = max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high))

    summed as sum_it l_it mask_it / denom: Eq. 12's token-level mean with denom = the response
    tokens of the whole mini-batch (all ranks), naive GRPO's mean of sequence means with denom =
    |o_i| * n_sequences. logp, old_logp, loss_mask (B, R); adv (B,); denom a number or (B, 1)."""
    # exercise: policy_loss
    mask = loss_mask.float()
    adv = adv[:, None]  # (B, 1): one advantage for every token of a response
    # The log-ratio is clamped: exp() above ~88.7 is inf, and one inf makes the gradient NaN
    # (such a ratio is clipped anyway).
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))  # (B, R)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss_tok = torch.maximum(-adv * ratio, -adv * clipped)  # (B, R) the pessimistic of the two
    return PolicyLoss((loss_tok * mask / denom).sum(), loss_tok, ratio)
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
            top_p, top_k, generator, engine=None) -> Batch:
    """Sample group_size responses to each row's prompt with the engine (sampler.py's by default;
    --rollout-engine vllm's) and score them with the row's verifier."""
    prompts, _ = encode_prompts(rows, tok, cfg.max_prompt_len)
    engine = engine or launch.SamplerRollout(cfg, tok.pad_token_id)
    sampled = engine.generate(model, [p for p in prompts for _ in range(group_size)],
                              temperature=temperature, top_p=top_p, top_k=top_k,
                              eos_token_ids=tok.eos_token_ids, generator=generator)
    texts = tok.decode_rows(sampled.response_ids, sampled.lengths)  # the verifier reads text
    return Batch.from_rollout(sampled, verifier.verify_rollout(rows, group_size, texts),
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
    return metrics.eval_metrics(batch, len(mine), len(rows), k, verifier)


# ------------------------------------------------------------------------------------------------
# Algorithm 1, lines 2-8: sample, reward and filter until the batch is full

def collect_batch(model, prompt_iter, tok, cfg, verifier, generator, engine=None) -> Collected:
    """Generation batches from pi_old, scored, reward-shaped and filtered into the buffer until it
    holds --train-prompts groups with signal (or --max-gen-batches were drawn)."""
    rank, world = distributed.rank(), distributed.world_size()
    buffer = GroupBuffer(cfg.train_prompts, cfg.max_gen_batches)
    while not buffer.done():  # Algorithm 1, lines 7-8: until the buffer holds N
        # --- Rollout (Algorithm 1, lines 3-5): pi_old samples G responses per prompt ---
        prompts = prompt_iter.next_batch()  # Algorithm 1, line 2
        batch = rollout(model, prompts[rank::world], tok, cfg, verifier, group_size=cfg.group_size,
                        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        generator=generator, engine=engine)  # this rank's share of the prompts
        # --- DAPO technique 4: overlong reward shaping (paper Sec. 3.4, Eq. 13) ---
        batch = replace(batch, reward=shape_rewards(batch.response_lengths, batch.score, cfg))
        # --- Algorithm 1, line 9: group advantages (Eq. 9), here while each group is whole ---
        batch = replace(batch, adv=advantages(batch.reward, cfg))
        # --- DAPO technique 2: dynamic sampling (paper Sec. 3.2): keep the groups with signal ---
        keep = keep_groups(batch.acc, cfg.group_size) | (not cfg.dynamic_sampling)  # (groups,)
        buffer.add(batch, keep, len(prompts))  # Algorithm 1, line 6
    n_trained = groups_to_train(buffer.n_kept, cfg)
    to_train = buffer.take(n_trained, cfg.mini_batch_prompts, cfg.group_size)
    generated = Batch.cat(buffer.generated)
    return Collected(to_train, generated, metrics.collection_metrics(
        generated, to_train, buffer.n_kept, n_trained, buffer.end_times, cfg.group_size,
        cfg.train_prompts, cfg.gen_batch_prompts), time.time() - buffer.started)


# ------------------------------------------------------------------------------------------------
# Algorithm 1, lines 10-11: the policy update

def update_policy(model, opt, batch: Batch, cfg) -> dict:
    """One epoch over the batch in mini-batches, one optimizer step each, of micro-batches
    (gradient accumulation), each rank holding its share of every mini-batch -> the metrics."""
    model.train()
    world, stats = distributed.world_size(), metrics.UpdateStats()
    mini_rows = cfg.mini_batch_prompts * cfg.group_size // world  # this rank's rows per step
    # pi_old <- pi_theta (Algorithm 1, line 3). When the batch is one optimizer step, its forward
    # runs before the policy moves: its log-probs, detached, are pi_old's, and cost nothing. Else
    # (several steps, or no token in the loss and so no forward to read) one no-grad pass first.
    in_loss = distributed.all_reduce(tokens_in_loss(batch, cfg).sum().item(), name="loss tokens")
    one_step = len(batch) <= mini_rows and in_loss > 0
    if not one_step:
        batch = with_old_logprobs(model, batch, cfg, stats)
    for mini_batch in batch.split(mini_rows):
        # --- DAPO technique 3: the token-level loss's denominator, before the micro-batch split
        # exercise: token_count
        mask = tokens_in_loss(mini_batch, cfg)  # (B, R)
        n_tokens, n_seqs = distributed.all_reduce([mask.sum().item(), mask.any(-1).sum().item()])
        # end exercise
        if n_tokens == 0:
            continue
        for micro in mini_batch.micro_batches(cfg.micro_batch_size, cfg.micro_batch_tokens):
            # Autocast around each forward, never around an optimizer step (infra/precision.py).
            with precision.autocast(cfg.precision, cfg.device):
                logp, entropy = response_logprobs(model, micro, cfg.temperature, cfg.fused_head)
            if micro.old_logp is None:
                micro = replace(micro, old_logp=logp.detach())
                stats.add_old_policy(micro.old_logp, entropy, micro)
            surrogate = micro_batch_loss(logp, micro, n_tokens, n_seqs, cfg, stats)
            # Eq. 12's mean is over every rank's tokens and each rank's loss is its share of it;
            # FSDP averages the ranks' gradients: times W, the average is the mean's gradient
            (surrogate.loss * world).backward()
        # Algorithm 1, line 11: one AdamW step on the mini-batch's gradient, its norm clipped
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        # skipped (and said) when the gradient holds a NaN or an inf, as AMP's GradScaler does
        grad_norm, stepped = precision.optimizer_step(opt, model, grad_norm)
        opt.zero_grad(set_to_none=True)
        stats.add_step(grad_norm, stepped)
    return stats.result(batch)


def micro_batch_loss(logp, micro: Batch, n_tokens, n_seqs, cfg, stats) -> PolicyLoss:
    """A micro-batch's share of the mini-batch's loss (its clip fractions and the rest go into
    stats): the clip-higher surrogate over Eq. 12's denominator, then verl's additions; with
    --loss-mode or --loss-agg-mode, one of DAPO's neighbours (losses.py) in its place."""
    mask = tokens_in_loss(micro, cfg)  # (B, R)
    # Eq. 12's token count; naive GRPO's |o_i| x sequences, Dr. GRPO's constant (--loss-agg-mode)
    denom = losses.loss_denominator(mask, cfg.loss_agg_mode, n_tokens, n_seqs,
                                    cfg.max_response_len)
    eps_high = cfg.eps_high if cfg.clip_higher else cfg.eps_low  # technique 1 off: PPO's clip
    if cfg.loss_mode == "vanilla":
        # --- DAPO technique 1: clip-higher, in the clipped surrogate (Sec. 3.1, Eq. 10) ---
        surrogate = policy_loss(logp, micro.old_logp, micro.adv, mask, cfg.eps_low, eps_high,
                                denom)
    else:  # GSPO, CISPO or KL-Cov in its place
        surrogate = losses.neighbour_loss(cfg, logp, micro.old_logp, micro.adv, mask, eps_high,
                                          denom)
    # verl's additions, not in the paper (losses.py): the rollout correction's weights (pi_old /
    # pi_sampler) and the dual clip, each off by default
    correction = losses.rollout_correction_weights(micro, cfg)
    surrogate = losses.dual_clip_and_weights(surrogate, micro.adv, mask, denom, cfg.dual_clip,
                                             correction.weight)
    stats.add_loss(surrogate, logp, micro.old_logp, micro.adv, mask, correction)
    return surrogate


@torch.no_grad()
def with_old_logprobs(model, batch: Batch, cfg, stats) -> Batch:
    """The batch with log pi_old of every response token (old_logp, (N, R), 0 on padding),
    computed in micro-batches before any optimizer step; pi_old's entropy goes into stats."""
    def forward(micro: Batch):
        with precision.autocast(cfg.precision, cfg.device):
            return response_logprobs(model, micro, cfg.temperature, cfg.fused_head)

    old_logp, old_entropy = batch.per_token(forward, cfg.micro_batch_size, cfg.micro_batch_tokens)
    stats.add_old_policy(old_logp, old_entropy, batch)
    return replace(batch, old_logp=old_logp)


# ------------------------------------------------------------------------------------------------
# The training loop (paper Algorithm 1)

def set_lr(opt, cfg, step):
    """A linear warm-up from 0, then constant (paper Sec. 4.1; verl's constant-with-warm-up)."""
    for group in opt.param_groups:
        group["lr"] = cfg.lr * min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr


def train(cfg: Config, setup: launch.Setup):
    """Algorithm 1 on setup's policy and data -> the last evaluation's metrics. What is not the
    algorithm (resume, the log, the alarms, Ctrl-C, the checkpoints) is Run's (infra/run.py)."""
    model, tok, val_rows, verifier, engine = (setup.model, setup.tok, setup.val_rows,
                                              setup.verifier, setup.engine)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    prompt_iter = PromptIterator(setup.train_rows, cfg.gen_batch_prompts, cfg.seed)
    generator = torch.Generator(cfg.device).manual_seed(cfg.seed + distributed.rank())
    run = Run(cfg, setup, opt, prompt_iter, generator)  # from --resume's checkpoint, if given
    for step in run.steps():  # Algorithm 1, line 1
        if run.evaluation_due(step):
            run.evaluated(step, evaluate(model, val_rows, tok, cfg, verifier, engine))
        set_lr(opt, cfg, step)
        # --- Algorithm 1, lines 2-8: sample, reward, filter, until the batch is full ---
        collected = collect_batch(model, prompt_iter, tok, cfg, verifier, generator, engine)
        trained = {}
        if collected.to_train is not None:
            # --- Algorithm 1, lines 10-11: optimizer steps on the batch (Eq. 8) ---
            with engine.updating(model):
                trained = update_policy(model, opt, collected.to_train, cfg)
        run.end_step(step + 1, collected, trained)  # logged, checked, saved; stops if asked
    run.check_trained()  # a run that took no optimizer step trained nothing: a non-zero exit
    if run.final_evaluation_due():
        run.evaluated(cfg.steps, evaluate(model, val_rows, tok, cfg, verifier, engine), final=True)
    return run.last_val


def evaluate_only(cfg: Config, setup: launch.Setup) -> dict:
    """--eval-only: the policy's avg@k and pass@k on --val-data, written to out_dir/eval.json."""
    result = evaluate(setup.model, setup.val_rows, setup.tok, cfg, setup.verifier, setup.engine)
    report_eval(result, cfg)
    return result


def main(cfg: Config):
    with launch.session(cfg) as cfg:  # the checks, the processes; cfg with the device resolved
        cfg = launch.plan(cfg)  # the precision and the memory plan, printed (--plan: no more)
        if cfg.plan:
            return None
        return (evaluate_only if cfg.eval_only else train)(cfg, launch.setup(cfg))


if __name__ == "__main__":
    with launch.user_errors_in_one_line():  # `error: ...` for a user's mistake, no traceback
        main(parse_args(description=__doc__))
    distributed.exit_after_shutdown()
