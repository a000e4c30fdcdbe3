"""
Rollout correction: the sampler and the trainer disagree a little about the same tokens.

The sampler's log-prob of the token it drew, log pi_rollout(y_t), and the trainer's at the same
weights, log pi_old(y_t), differ by precision (a bf16 sampler, an fp32 trainer), kernels and the
KV cache's order of sums. The batch is then slightly off-policy: the clipped surrogate's ratio is
pi_theta / pi_old, but the tokens were drawn from pi_rollout. An importance weight per token,

    rho_t = pi_old(y_t) / pi_rollout(y_t)          detached: it changes the measure, not the loss

multiplies each token's loss (losses.dual_clip_and_weights's `weight`) in one of four ways. The
names are TRL's (`vllm_importance_sampling_mode`); verl has the same under
`algorithm.rollout_correction`:

    token_truncate     clamp(rho_t, C_min, C_max)         truncated IS (Yao et al. 2025, "Your
                                                          efficient RL framework secretly brings
                                                          you off-policy RL training"); verl's
                                                          rollout_is: token
    token_mask         rho_t, or 0 outside [C_min, C_max]  masked IS (IcePop); verl's rollout_is:
                                                          token with a "lower_upper" threshold
    sequence_truncate  clamp(rho_seq, C_min, C_max)       verl's rollout_is: sequence (Seq-TIS)
    sequence_mask      rho_seq, or 0 outside the bounds   TRL's default mode

rho_seq = prod_t rho_t = exp(sum_t log rho_t) over the response, the same for its every token.
Log-ratios are clamped to [-20, 20] before the exp, as verl does. A masked token keeps its place
in the token-level mean's denominator, with weight 0: TRL divides by every completion token
(`num_items_in_batch`), and verl's masked IS "does not modify response_mask". (verl's rejection
sampling, `rollout_rs`, which does take tokens out of the count, is not implemented here.)

Stats also sums what verl logs as `rollout_corr/...` (docs/metrics.md says what each means).
"""
import math
from dataclasses import dataclass

import torch

from infra import distributed
from infra.errors import UserError

MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SAFETY_BOUND = 20.0  # |log rho| at most: exp(20) = 4.9e8, as verl's


@dataclass
class Correction:
    """The importance weight of each token of a micro-batch, and the ratio it came from."""
    weight: torch.Tensor | None  # (B, R): what multiplies the token's loss, detached; None: none
    rho: torch.Tensor | None = None  # (B, R): pi_old / pi_rollout of the token, or its sequence
    c_min: float = 0.0  # the bounds rho was truncated to, or masked outside of
    c_max: float = math.inf


def correct(old_logp, rollout_logp, response_mask, mode: str, c_min: float,
            c_max: float) -> Correction:
    """The weights of --rollout-correction `mode` (the module docstring) for a micro-batch, from
    the trainer's pi_old (B, R) and the sampler's log-probs of the same tokens (B, R) or None,
    response_mask (B, R). Mode none: no weight (None), so that the loss is the paper's to the last
    bit."""
    if mode == "none":
        return Correction(None)
    if rollout_logp is None:
        raise UserError(f"--rollout-correction {mode} needs the sampler's log-probs of its "
                        "tokens, and this batch has none (Batch.rollout_logp)")
    with torch.no_grad():
        log_rho = (old_logp - rollout_logp).masked_fill(~response_mask, 0.0)  # (B, R)
        if mode.startswith("sequence"):  # every token of a response carries its product
            log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)  # (B, R)
        rho = log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
        if mode.endswith("truncate"):
            weight = rho.clamp(c_min, c_max)
        else:
            weight = rho.masked_fill((rho < c_min) | (rho > c_max), 0.0)
    return Correction(weight, rho, c_min, c_max)


# the mismatch over every response token of pi_old (the diagnostics verl logs whatever the mode)
MISMATCH_NAMES = ("tokens", "kl", "k3_kl", "rho_sq", "seqs", "rho_sq_seq", "train_ppl",
                  "rollout_ppl")
# the weights over the tokens in the loss (with a mode only)
WEIGHT_NAMES = ("tokens", "weight", "weight_sq", "high", "low")


class Stats:
    """Sums over micro-batches (and ranks, at the end) of the sampler/trainer mismatch and of the
    weights the loss used; result() gives them verl's names."""

    def __init__(self):
        self.mismatch = dict.fromkeys(MISMATCH_NAMES, 0.0)
        self.weights = dict.fromkeys(WEIGHT_NAMES, 0.0)
        self.extremes = [-math.inf, -math.inf]  # max of the weight, max of minus the weight

    @torch.no_grad()
    def add_mismatch(self, train_logp, rollout_logp, response_mask):
        """pi_old's log-probs (B, R) against the sampler's, in float64 over the response tokens."""
        mask = response_mask
        zero = torch.zeros((), dtype=torch.float64, device=mask.device)
        train = torch.where(mask, train_logp.double(), zero)  # (B, R), 0 on padding
        rollout = torch.where(mask, rollout_logp.double(), zero)
        log_rho = train - rollout  # (B, R)
        lengths = mask.sum(-1)  # (B,)
        seqs = lengths > 0
        # clamped as verl, where an exp of a sum of many tokens' log-ratios could overflow
        seq_log_rho = log_rho.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)[seqs]  # (S,)
        sums = {
            "tokens": mask.sum(), "kl": -log_rho.sum(),  # KL(pi_rollout || pi_old), k1
            "k3_kl": torch.where(mask, log_rho.exp() - log_rho - 1, zero).sum(),
            "rho_sq": torch.where(mask, (2 * log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp(),
                                  zero).sum(),
            "seqs": seqs.sum(), "rho_sq_seq": (2 * seq_log_rho).exp().sum(),
            # perplexity per sequence, exp(-mean_t log p), then their mean (verl's)
            "train_ppl": (-train.sum(-1)[seqs] / lengths[seqs]).exp().sum(),
            "rollout_ppl": (-rollout.sum(-1)[seqs] / lengths[seqs]).exp().sum()}
        for name, value in sums.items():
            self.mismatch[name] += value.item()

    @torch.no_grad()
    def add_weights(self, correction: Correction, loss_mask):
        """The weights of the tokens in the loss, (B, R) loss_mask; none without a mode."""
        if correction.rho is None:
            return
        rho, weight = correction.rho.double()[loss_mask], correction.weight.double()[loss_mask]
        sums = {"tokens": len(weight), "weight": weight.sum(), "weight_sq": weight.square().sum(),
                "high": (rho > correction.c_max).sum(), "low": (rho < correction.c_min).sum()}
        for name, value in sums.items():
            self.weights[name] += float(value)
        if len(weight):
            self.extremes = [max(self.extremes[0], weight.max().item()),
                             max(self.extremes[1], -weight.min().item())]

    def result(self) -> dict:
        """rollout_corr/... over all ranks: the mismatch when the batch had the sampler's
        log-probs, the weights when a mode was on; {} without either."""
        out = {}
        m = dict(zip(self.mismatch, distributed.all_reduce(list(self.mismatch.values()))))
        if m["tokens"]:
            out |= {"rollout_corr/kl": m["kl"] / m["tokens"],
                    "rollout_corr/k3_kl": m["k3_kl"] / m["tokens"],
                    "rollout_corr/chi2_token": m["rho_sq"] / m["tokens"] - 1,
                    "rollout_corr/chi2_seq": m["rho_sq_seq"] / m["seqs"] - 1,
                    "rollout_corr/training_ppl": m["train_ppl"] / m["seqs"],
                    "rollout_corr/rollout_ppl": m["rollout_ppl"] / m["seqs"]}
        w = dict(zip(self.weights, distributed.all_reduce(list(self.weights.values()))))
        if w["tokens"]:
            top, minus_bottom = distributed.all_reduce(self.extremes, "max")
            mean = w["weight"] / w["tokens"]
            mean_sq = w["weight_sq"] / w["tokens"]
            out |= {"rollout_corr/rollout_is_mean": mean,
                    "rollout_corr/rollout_is_std": math.sqrt(max(mean_sq - mean ** 2, 0.0)),
                    "rollout_corr/rollout_is_min": -minus_bottom,
                    "rollout_corr/rollout_is_max": top,
                    # 1 / mean(w_norm^2) with w_norm = w / mean(w): 1 when every weight is equal
                    "rollout_corr/rollout_is_eff_sample_size":
                        mean ** 2 / mean_sq if mean_sq else 0.0,
                    "rollout_corr/rollout_is_ratio_fraction_high": w["high"] / w["tokens"],
                    "rollout_corr/rollout_is_ratio_fraction_low": w["low"] / w["tokens"]}
        return out
