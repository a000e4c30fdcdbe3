"""
The policy loss beyond the paper's: what verl puts around DAPO's clipped surrogate (dapo.py's
policy_loss), each off by default.

    dual_clip_and_weights()     the dual clip (Ye et al. 2020) for A < 0, and the rollout
                                correction's weight of each token (infra/rollout_correction.py)
    rollout_correction_weights()  those weights for a micro-batch, from pi_old / pi_sampler
"""
from dataclasses import dataclass, replace

import torch

from infra import rollout_correction


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # (): sum_it l_it mask_it / denom, what to back-propagate
    loss_tok: torch.Tensor  # (B, R): l_it, before the mask and the denominator
    ratio: torch.Tensor  # (B, R): r_it, of the clamped log-ratio


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
