"""
The policy losses and aggregations that followed DAPO, as verl defines them, beside DAPO's own in
dapo.py. Each is verl 0.9.1's function of the same idea (verl/trainer/ppo/core_algos.py), written
so that a micro-batch's loss is its share of the mini-batch's, as dapo.policy_loss writes it:

    loss = sum_it l_it mask_it / denom     denom: loss_denominator() of the mini-batch's counts

    Dr. GRPO  Liu et al. 2025, arXiv 2503.20783   advantages(scale="none"), and the aggregation
                                                  "seq-mean-token-sum-norm" (a constant length)
    GSPO      Zheng et al. 2025, arXiv 2507.18071 gspo_loss(): one ratio per response
    CISPO     MiniMax 2025, arXiv 2506.13585      cispo_loss(): the clip bounds a weight, not the
                                                  gradient
    KL-Cov    Cui et al. 2025, arXiv 2505.22617   kl_cov_loss(): a KL penalty on the few tokens of
                                                  largest covariance, no clip

Shapes: logp, old_logp, loss_mask (B, R), B responses padded to R tokens; adv (B,), one advantage
per response. Every function works in float32 and float64, and stops gradients where verl's
detach() does.

And what verl puts around every one of these losses (each off by default, not in the paper):

    dual_clip_and_weights()       the dual clip (Ye et al. 2020) for A < 0, and the rollout
                                  correction's weight of each token (infra/rollout_correction.py)
    rollout_correction_weights()  those weights for a micro-batch, from pi_old / pi_sampler
"""
from dataclasses import dataclass, replace

import torch

from infra import distributed, rollout_correction


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # (): sum_it l_it mask_it / denom, what to back-propagate
    loss_tok: torch.Tensor  # (B, R): l_it, before the mask and the denominator
    ratio: torch.Tensor  # (B, R): the ratio the clip looks at
    # (B, R) bool: where the variant's bound acts on a token, when loss_tok > -A ratio cannot say
    # it (CISPO's clipped weights, KL-Cov's penalised tokens); None: read it that way (DAPO, GSPO)
    clipped: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------
# verl's additions to any of them: the dual clip and the rollout correction's weights

def dual_clip_and_weights(surrogate: PolicyLoss, adv, loss_mask, denom, dual_clip: float,
                          weight) -> PolicyLoss:
    """The surrogate with verl's two additions, summed as policy_loss sums it: the dual clip
    (c = dual_clip > 1), l_it = min(l_it, -A_i c) where A_i < 0, which bounds what one token of a
    bad answer with a huge ratio can weigh; and the rollout correction's weights w_it (B, R),
    l_it w_it. dual_clip <= 1 and weight None: the surrogate, unchanged."""
    if dual_clip <= 1 and weight is None:
        return surrogate
    loss_tok, adv = surrogate.loss_tok, adv[:, None]  # (B, R), (B, 1)
    if dual_clip > 1:
        dual = (adv < 0) & (loss_tok > -adv * dual_clip)  # (B, R)
        loss_tok = torch.where(dual, -adv * dual_clip, loss_tok)
    weighted = loss_tok if weight is None else loss_tok * weight  # (B, R)
    loss = (weighted * loss_mask.float() / denom).sum()
    return replace(surrogate, loss=loss, loss_tok=loss_tok)


def rollout_correction_weights(micro, cfg) -> rollout_correction.Correction:
    """--rollout-correction's weight of each token of micro (a batch.Batch with pi_old's and the
    sampler's log-probs), and the ratios they came from; weight None with mode none."""
    return rollout_correction.correct(micro.old_logp, micro.rollout_logp, micro.response_mask,
                                      cfg.rollout_correction, cfg.rollout_is_min,
                                      cfg.rollout_is_max)


# ------------------------------------------------------------------------------------------------
# Aggregation: the denominator that makes sum_it l_it mask_it / denom equal verl's agg_loss

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SCALES = ("group", "batch", "none")  # advantages()'s
LOSS_MODES = ("vanilla", "gspo", "cispo", "kl_cov")  # vanilla: dapo.policy_loss


def loss_denominator(loss_mask, mode, n_tokens, n_seqs, norm_len=None):
    """What sum_it l_it mask_it / denom divides by to equal verl's agg_loss(loss_mode=mode):

        token-mean               sum_it l_it / N_tok                   DAPO Eq. 12 -> N_tok
        seq-mean-token-mean      1/N_seq sum_i 1/|o_i| sum_t l_it      naive GRPO  -> |o_i| N_seq
        seq-mean-token-sum-norm  1/N_seq sum_i sum_t l_it / L          Dr. GRPO    -> N_seq L

    n_tokens, n_seqs: the tokens in the loss and the responses of the whole mini-batch, over all
    ranks. verl's agg_loss divides each rank's sum by the same global counts and multiplies by
    dp_size, since FSDP averages the ranks' gradients; the project multiplies by the world size
    where it back-propagates, so the denominator carries no dp_size. Which responses count: verl's
    trainer passes global_batch_size = ppo_mini_batch_size x n, every response, a fully masked one
    included; agg_loss alone (dp_size 1, no count passed) counts those with a token in the mask.
    L = norm_len, Dr. GRPO's constant: verl's loss_scale_factor, None there meaning the padded
    width R of the micro-batch (a width that changes with the split unless every micro-batch is
    padded alike; Dr. GRPO's paper uses the generation limit). TRL 1.16's loss_type="dr_grpo"
    divides each micro-batch by its B x max_completion_length, every response counted: the same
    with L = max_completion_length. loss_mask (B, R) -> a number, or (B, 1) for the sequence mean.
    """
    if mode == "token-mean":
        return n_tokens
    if mode == "seq-mean-token-mean":
        # verl adds 1e-8 to each |o_i|: its bool mask sums to an int, and the float32 it becomes
        # drops the 1e-8, so its |o_i| is exact; a fully masked response sums to 0 either way
        return loss_mask.sum(-1, keepdim=True).clamp(min=1) * n_seqs  # (B, 1)
    if mode == "seq-mean-token-sum-norm":
        return n_seqs * (loss_mask.shape[-1] if norm_len is None else norm_len)
    raise ValueError(f"unknown aggregation {mode!r}: one of {AGGREGATIONS}")


# ------------------------------------------------------------------------------------------------
# Advantages: GRPO's, Dr. GRPO's and the batch-scaled one

def advantages(rewards, group_size, scale="group", eps=1e-6):
    """A_i, the same for every token of response i, from its group's rewards:

        group  (R_i - mean(R_group)) / (std(R_group) + eps)     GRPO, DAPO Eq. 9
        none   R_i - mean(R_group)                              Dr. GRPO
        batch  (R_i - mean(R_group)) / (std(R_1..R_N) + eps)    TRL's scale_rewards="batch"

    rewards (N,), each group's G responses contiguous -> (N,). std is unbiased (N - 1), as
    torch.std, verl and TRL; a group of one has mean 0 and std 1 (verl's convention). "group"
    and "none" are verl's compute_grpo_outcome_advantage with norm_adv_by_std_in_grpo True and
    False; "group" is dapo.group_advantages. TRL 1.16 adds 1e-4, not 1e-6, takes the batch std
    over every process's rewards, and gives a group of one the advantage 0 (its mean is R_i)."""
    # exercise: dr_grpo
    r = rewards.view(-1, group_size)  # (N/G, G)
    if group_size == 1:
        mean, std = torch.zeros_like(r), torch.ones_like(r)
    else:
        mean, std = r.mean(1, keepdim=True), r.std(1, keepdim=True)  # (N/G, 1)
    if scale == "none":
        return (r - mean).flatten()
    if scale == "batch":
        std = batch_std(rewards)  # one number for every response of the batch, every rank's
    elif scale != "group":
        raise ValueError(f"unknown advantage scale {scale!r}: group, batch or none")
    return ((r - mean) / (std + eps)).flatten()  # (N,)
    # end exercise


def batch_std(rewards):
    """The unbiased std of every rank's rewards (N,) (TRL gathers them over its processes): two
    sums over ranks in float64, the mean, then the squares about it; 1 for a single reward."""
    n, total = distributed.all_reduce([len(rewards), rewards.double().sum().item()],
                                      name="batch std")
    squares = distributed.all_reduce(((rewards.double() - total / n) ** 2).sum().item(),
                                     name="batch std")
    std = (squares / (n - 1)) ** 0.5 if n > 1 else 1.0
    return torch.tensor(std, dtype=rewards.dtype, device=rewards.device)


# ------------------------------------------------------------------------------------------------
# The policy losses

def neighbour_loss(cfg, logp, old_logp, adv, loss_mask, eps_high, denom) -> PolicyLoss:
    """--loss-mode's loss in place of dapo.policy_loss (vanilla): gspo, cispo or kl_cov, with
    --eps-low and eps_high (--eps-high, or --eps-low without clip-higher), --kl-cov-ratio and
    --ppo-kl-coef. Shapes: the module's."""
    if cfg.loss_mode == "gspo":
        return gspo_loss(logp, old_logp, adv, loss_mask, cfg.eps_low, eps_high, denom)
    if cfg.loss_mode == "cispo":
        return cispo_loss(logp, old_logp, adv, loss_mask, cfg.eps_low, eps_high, denom)
    if cfg.loss_mode == "kl_cov":
        return kl_cov_loss(logp, old_logp, adv, loss_mask, cfg.kl_cov_ratio, cfg.ppo_kl_coef,
                           denom)
    raise ValueError(f"unknown --loss-mode {cfg.loss_mode!r}: one of {LOSS_MODES}")

def gspo_loss(logp, old_logp, adv, loss_mask, eps_low, eps_high, denom) -> PolicyLoss:
    """GSPO's clipped surrogate on one ratio per response, the length-normalised sequence ratio

        s_i = exp(1/|o_i| sum_t (log pi_theta(o_it) - log pi_old(o_it)))
        l_it = max(-A_i s_it, -A_i clip(s_it, 1 - eps_low, 1 + eps_high))

    with s_it = sg[s_i] pi_theta(o_it) / sg[pi_theta(o_it)] (the paper's GSPO-token): its value
    is s_i on every token, its gradient goes through each token's own log-prob. As verl's
    compute_policy_loss_gspo, log s_it is clamped at 10 (so its gradient stops there) and the
    log-ratio is not clamped. verl aggregates with the loss_agg_mode it is given (token-mean by
    default; the paper and verl's docstring: seq-mean-token-mean): denom says which. TRL 1.16's
    importance_sampling_level="sequence" broadcasts exp(log s_i) without stop-gradients: with
    one advantage per response its value and gradient are these (d |o_i| s_i / d log pi(o_it) =
    s_i), except that it does not clamp. Shapes: the module's; denom as loss_denominator()."""
    # exercise: gspo
    mask = loss_mask.float()
    adv = adv[:, None]  # (B, 1)
    n = loss_mask.sum(-1).clamp(min=1)  # (B,) |o_i|; a fully masked response sums 0 over 1
    log_s = ((logp - old_logp) * mask).sum(-1) / n  # (B,) log s_i
    # verl clamps log s_it at 10 "for numerical stability": the value stops at e^10, the gradient
    # with it
    log_ratio = (logp - logp.detach() + log_s.detach()[:, None]).clamp(max=10.0)  # (B, R)
    ratio = torch.exp(log_ratio)  # (B, R) s_it: s_i in value
    loss_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    return PolicyLoss((loss_tok * mask / denom).sum(), loss_tok, ratio)
    # end exercise


def cispo_loss(logp, old_logp, adv, loss_mask, eps_low, eps_high, denom) -> PolicyLoss:
    """CISPO: REINFORCE weighted by the clipped, detached importance ratio,

        l_it = -sg[clip(r_it, 1 - eps_low, 1 + eps_high)] A_i log pi_theta(o_it)

    so every token keeps a gradient (-clip(r_it) A_i on its log-prob); the clip bounds its weight
    only. As verl's compute_policy_loss_cispo: the bounds are the PPO clip's (its clip_ratio_low
    and clip_ratio_high, no field of their own), r_it of the log-ratio clamped to [-20, 20], and
    `clipped` (its pg_clipfrac) where r_it != clip(r_it), on either side whatever A's sign. TRL
    1.16's loss_type="cispo" differs: it clamps the ratio only from above, at epsilon_high itself
    (not 1 + epsilon_high), and counts a token clipped only where A > 0. Shapes: the module's."""
    # exercise: cispo
    mask = loss_mask.float()
    adv = adv[:, None]  # (B, 1)
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))  # (B, R), clamped as in policy_loss
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)  # (B, R)
    loss_tok = -weight.detach() * adv * logp  # (B, R)
    return PolicyLoss((loss_tok * mask / denom).sum(), loss_tok, ratio, clipped=ratio != weight)
    # end exercise


def kl_cov_loss(logp, old_logp, adv, loss_mask, kl_cov_ratio, ppo_kl_coef, denom) -> PolicyLoss:
    """KL-Cov: the unclipped surrogate, and a KL penalty on the k tokens whose covariance between
    advantage and log-prob is largest (those that drive entropy down):

        cov_it = (A_i - mean A) (log pi_theta(o_it) - mean log pi_theta)   over the valid tokens
        l_it = -A_i r_it + ppo_kl_coef |log pi_theta(o_it) - log pi_old(o_it)|   on the top k
        l_it = -A_i r_it                                                        elsewhere

    k = max(1, int(n_valid kl_cov_ratio)), the means token-weighted, cov detached; no clip and no
    clamp of the log-ratio, as verl's compute_policy_loss_kl_cov (its defaults, PolicyLossConfig
    and actor.yaml: kl_cov_ratio 2e-4, ppo_kl_coef 0.1). NOTE: the top k is chosen among the
    tokens of the micro-batch this is called on, so the loss depends on the split into
    micro-batches and ranks by definition; the project follows verl. `clipped` is the top-k
    selection: the tokens the KL penalty acts on. Shapes: the module's; denom loss_denominator's."""
    # exercise: kl_cov
    mask = loss_mask.float()
    adv = adv[:, None].expand_as(logp)  # (B, R)
    ratio = torch.exp(logp - old_logp)  # (B, R)
    valid = loss_mask.flatten().nonzero().squeeze(-1)  # (n_valid,) row-major, as verl's order
    a, lp = adv.detach().flatten()[valid], logp.detach().flatten()[valid]  # (n_valid,)
    cov = (a - a.mean()) * (lp - lp.mean())  # (n_valid,)
    k = max(1, int(len(valid) * kl_cov_ratio))  # len 0: topk of nothing selects nothing
    top = valid[torch.topk(cov, min(k, len(valid))).indices]  # flat indices of the top k
    penalised = torch.zeros_like(loss_mask, dtype=torch.bool).flatten()
    penalised[top] = True
    penalised = penalised.view_as(loss_mask)  # (B, R)
    loss_tok = -adv * ratio  # (B, R)
    loss_tok = torch.where(penalised, loss_tok + ppo_kl_coef * (logp - old_logp).abs(), loss_tok)
    return PolicyLoss((loss_tok * mask / denom).sum(), loss_tok, ratio, clipped=penalised)
    # end exercise
