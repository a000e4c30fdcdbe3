"""losses.py, DAPO's neighbours, equal to verl's own functions: each aggregation, advantage and
policy loss against the values verl 0.9.1 gave on the same inputs (the loss and its gradient), and
the behaviours the papers name (one ratio per response, a gradient for every clipped token, a
penalty that depends on the micro-batch).

tests/data/verl_losses.json was computed once, outside this repository, by verl's own functions:
verl 0.9.1 (the PyPI wheel; its v0.9.1 tag is commit 1876b06d0a3e4e71e06230be10af14492ca8a75b),
verl/trainer/ppo/core_algos.py (sha256 recorded in the file) under torch 2.13.0 on CPU: agg_loss,
compute_grpo_outcome_advantage (epsilon 1e-6, norm_adv_by_std_in_grpo True and False),
compute_policy_loss_vanilla, _gspo, _cispo and _kl_cov, each given an
ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=4, clip_ratio_low=0.2,
clip_ratio_high=0.28, clip_ratio_c=3 or 1e9, policy_loss=PolicyLossConfig(loss_mode, kl_cov_ratio,
ppo_kl_coef)) as each case records, and an empty global_batch_info (agg_loss counts the
micro-batch itself) unless a case names dp_size, batch_num_tokens, global_batch_size and
loss_scale_factor. Inputs: three random float64 batches of 4-6 responses of 6-8 tokens, rounded to
6 decimals (a full row, a fully masked one, a zero advantage, sequence ratios from 0.63 to 1.84 so
that tokens and responses clip on both sides, and in the third a response whose log-ratio is ~11
on every token); the mask a bool, as verl's ppo_loss passes it; verl's advantages the response's
on its tokens, 0 on padding. Each case holds the loss and its gradient with respect to log_prob
(or to loss_mat, for agg_loss) by autograd in float64. Nothing of verl is in this repository; its
values are data.
"""
import json
import os

import pytest
import torch

import dapo
import losses
from losses import (AGGREGATIONS, advantages, cispo_loss, gspo_loss, kl_cov_loss,
                    loss_denominator)

with open(os.path.join(os.path.dirname(__file__), "data", "verl_losses.json")) as f:
    VERL = json.load(f)
EPS_LOW, EPS_HIGH = 0.2, 0.28  # every case's clip_ratio_low, clip_ratio_high
# float64 keeps ~16 digits and the two computations agree to ~1e-15; 1e-12 (relative, as some
# losses are ~1e4) leaves room for another summation order, and no room for another formula
TOL = 1e-12
# float32 keeps ~7 digits; a sum of ~50 terms and exp(11) lose one or two more
TOL_FP32 = 1e-5


def close(ours, verls, tol=TOL) -> bool:
    verls = torch.as_tensor(verls, dtype=torch.float64)
    ours = ours.detach().double()
    return ours.shape == verls.shape and bool(((ours - verls).abs()
                                               <= tol * (1 + verls.abs())).all())


def batch(i, dtype=torch.float64):
    """Batch i of the data: logp (B, R) requiring grad, old_logp (B, R), mask (B, R) bool, adv."""
    b = VERL["batches"][i]
    logp = torch.tensor(b["logp"], dtype=dtype, requires_grad=True)
    old_logp = torch.tensor(b["old_logp"], dtype=dtype)
    mask = torch.tensor(b["mask"], dtype=torch.bool)
    return logp, old_logp, mask, torch.tensor(b["adv"], dtype=dtype)


def single_rank_denominator(mask, mode, norm_len=None):
    """What agg_loss counts with no global_batch_info: the micro-batch's own tokens, and its
    responses with a token in the mask."""
    return loss_denominator(mask, mode, mask.sum().item(), mask.any(-1).sum().item(), norm_len)


def cases(loss_mode, **match):
    found = [c for c in VERL["policy_loss"] if c["loss_mode"] == loss_mode
             and all(c["config"].get(k, c.get(k)) == v for k, v in match.items())]
    assert found  # a filter that matches nothing must not pass vacuously
    return found


def case_id(case):
    return f"batch{case['batch']}-{case['loss_agg_mode']}-" + "-".join(
        f"{k}{case['config'][k]}" for k in ("clip_ratio_c", "kl_cov_ratio", "ppo_kl_coef"))


# ------------------------------------------------------------------------------------------------
# Aggregation

@pytest.mark.parity
@pytest.mark.parametrize("case", VERL["agg_loss"],
                         ids=lambda c: f"batch{c['batch']}-{c['mode']}-"
                                       f"L{c.get('loss_scale_factor')}")
def test_loss_denominator_equals_verl_agg_loss(case):
    _, _, mask, _ = batch(case["batch"])
    loss_mat = torch.tensor(VERL["batches"][case["batch"]]["loss_mat"], dtype=torch.float64,
                            requires_grad=True)
    denom = single_rank_denominator(mask, case["mode"], case.get("loss_scale_factor"))
    loss = (loss_mat * mask / denom).sum()
    loss.backward()
    assert close(loss, case["value"]) and close(loss_mat.grad, case["grad"])


@pytest.mark.parity
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_loss_denominator_of_global_counts_is_verl_agg_loss_on_each_rank_over_dp_size(mode):
    # verl's agg_loss on a rank: its sum over the global counts times dp_size (FSDP averages the
    # ranks' gradients); the project multiplies by the world size where it back-propagates
    found = [c for c in VERL["agg_loss_dp2"] if c["mode"] == mode]
    assert len(found) == 6
    for case in found:
        _, _, mask, _ = batch(case["batch"])
        lo, hi = case["rows"]
        loss_mat = torch.tensor(VERL["batches"][case["batch"]]["loss_mat"], dtype=torch.float64)
        loss_mat = loss_mat[lo:hi].requires_grad_(True)
        denom = loss_denominator(mask[lo:hi], mode, case["batch_num_tokens"],
                                 case["global_batch_size"], case["loss_scale_factor"])
        loss = (loss_mat * mask[lo:hi] / denom).sum() * case["dp_size"]
        loss.backward()
        assert close(loss, case["value"]) and close(loss_mat.grad, case["grad"])


def whole_and_parts(fn, mode):
    """fn's loss on batch 1 whole, and summed over three micro-batches of it, each over
    loss_denominator() of the whole batch's counts."""
    logp, old_logp, mask, adv = batch(1)
    n_tokens, n_seqs = mask.sum().item(), mask.any(-1).sum().item()
    whole = fn(logp, old_logp, adv, mask, EPS_LOW, EPS_HIGH,
               loss_denominator(mask, mode, n_tokens, n_seqs, 16)).loss
    parts = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        denom = loss_denominator(mask[rows], mode, n_tokens, n_seqs, 16)
        parts = parts + fn(logp[rows], old_logp[rows], adv[rows], mask[rows], EPS_LOW, EPS_HIGH,
                           denom).loss
    return whole, parts


# (one test per loss: each grades its own exercise, course/assign.py's gspo and cispo)
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_gspo_loss_is_the_same_whatever_the_micro_batches(mode):
    whole, parts = whole_and_parts(gspo_loss, mode)
    assert close(parts, whole.item())


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_cispo_loss_is_the_same_whatever_the_micro_batches(mode):
    whole, parts = whole_and_parts(cispo_loss, mode)
    assert close(parts, whole.item())


def test_seq_mean_token_sum_norm_defaults_to_the_padded_width():
    mask = torch.tensor([[True, True, False, False, False], [True, False, False, False, False]])
    assert loss_denominator(mask, "seq-mean-token-sum-norm", 3, 2) == 2 * 5
    assert loss_denominator(mask, "seq-mean-token-sum-norm", 3, 2, norm_len=4096) == 2 * 4096


# ------------------------------------------------------------------------------------------------
# Advantages

def verl_advantages(group_size, norm):
    found = [c for c in VERL["advantages"]
             if c["group_size"] == group_size and c["norm_adv_by_std_in_grpo"] == norm]
    assert len(found) == 1
    return torch.tensor(found[0]["rewards"], dtype=torch.float64), found[0]["advantages"]


@pytest.mark.parity
def test_group_scale_equals_verl_grpo_outcome_advantage():
    rewards, verls = verl_advantages(4, norm=True)
    assert close(advantages(rewards, 4, "group"), verls)


@pytest.mark.parity
@pytest.mark.needs("group_advantages")
def test_dapo_group_advantages_equal_verl_grpo_outcome_advantage():
    rewards, verls = verl_advantages(4, norm=True)
    assert close(dapo.group_advantages(rewards, 4), verls)


@pytest.mark.needs("group_advantages", "dr_grpo")
@pytest.mark.parametrize("group_size", [4, 1])
def test_group_scale_is_dapo_group_advantages_to_the_bit(group_size):
    rewards, _ = verl_advantages(group_size, norm=True)
    ours = advantages(rewards, group_size, "group")
    assert ours.tolist() == dapo.group_advantages(rewards, group_size).tolist()


@pytest.mark.parity
@pytest.mark.parametrize("group_size", [4, 1])
def test_no_scale_equals_verl_grpo_advantage_without_std_as_dr_grpo(group_size):
    rewards, verls = verl_advantages(group_size, norm=False)
    assert close(advantages(rewards, group_size, "none"), verls)


def test_a_group_of_one_has_mean_0_and_std_1_as_in_verl():
    rewards, verls = verl_advantages(1, norm=True)
    # verl computes std + eps as torch.tensor(1.0) + 1e-6, a float32: 1 + 9.5e-7, not 1 + 1e-6,
    # so its float64 advantages are off by 5e-8 relative; the numbers are R_i / (1 + eps) all
    # the same
    assert close(advantages(rewards, 1, "group"), verls, tol=1e-7)
    assert advantages(rewards, 1, "group").tolist() == (rewards / (1 + 1e-6)).tolist()


def test_batch_scale_divides_by_the_std_of_every_reward():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    # group means 1/4 and 3/4; the batch's mean is 1/2, its unbiased variance 8 (1/4) / 7 = 2/7
    expected = (rewards - torch.tensor([0.25] * 4 + [0.75] * 4)) / ((2 / 7) ** 0.5 + 1e-6)
    assert close(advantages(rewards, 4, "batch"), expected)


# ------------------------------------------------------------------------------------------------
# The policy losses

@pytest.mark.parity
@pytest.mark.needs("policy_loss")
@pytest.mark.parametrize("case", cases("vanilla", clip_ratio_c=1e9), ids=case_id)
def test_dapo_policy_loss_equals_verl_compute_policy_loss_vanilla(case):
    # clip_ratio_c 1e9: verl's dual clip never binds, as DAPO's paper has none
    logp, old_logp, mask, adv = batch(case["batch"])
    denom = single_rank_denominator(mask, case["loss_agg_mode"])
    out = dapo.policy_loss(logp, old_logp, adv, mask, EPS_LOW, EPS_HIGH, denom)
    out.loss.backward()
    assert close(out.loss, case["value"]) and close(logp.grad, case["grad"])


@pytest.mark.parity
@pytest.mark.needs("policy_loss")
@pytest.mark.parametrize("case", cases("vanilla", clip_ratio_c=3.0), ids=case_id)
def test_dapo_dual_clip_equals_verl_compute_policy_loss_vanilla_dual_clip(case):
    logp, old_logp, mask, adv = batch(case["batch"])
    denom = single_rank_denominator(mask, "token-mean")
    out = dapo.policy_loss(logp, old_logp, adv, mask, EPS_LOW, EPS_HIGH, denom)
    out = losses.dual_clip_and_weights(out, adv, mask, denom, dual_clip=3.0, weight=None)
    out.loss.backward()
    assert close(out.loss, case["value"]) and close(logp.grad, case["grad"])


@pytest.mark.parity
@pytest.mark.parametrize("case", cases("gspo"), ids=case_id)
def test_gspo_loss_equals_verl_compute_policy_loss_gspo(case):
    logp, old_logp, mask, adv = batch(case["batch"])
    denom = single_rank_denominator(mask, case["loss_agg_mode"])
    out = gspo_loss(logp, old_logp, adv, mask, EPS_LOW, EPS_HIGH, denom)
    out.loss.backward()
    assert close(out.loss, case["value"]) and close(logp.grad, case["grad"])


def test_gspo_gives_every_token_of_a_response_its_sequence_ratio():
    logp, old_logp, mask, adv = batch(1)
    out = gspo_loss(logp, old_logp, adv, mask, EPS_LOW, EPS_HIGH, 1.0)
    seq = ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    assert close(out.ratio, seq.exp()[:, None].expand_as(logp))
    clipped = out.loss_tok > -adv[:, None] * out.ratio  # (B, R): whole responses or none
    assert (clipped == clipped[:, :1]).all() and clipped[mask].any() and not clipped[mask].all()


@pytest.mark.parity
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_gspo_loss_equals_trls_sequence_ratio_without_stop_gradients(mode):
    # TRL 1.16's importance_sampling_level="sequence": exp(log s_i) on every token, differentiated
    # through log s_i (batches 0 and 1: no log s_i above 10, where verl clamps and TRL does not)
    for i in (0, 1):
        logp, old_logp, mask, adv = batch(i)
        denom = single_rank_denominator(mask, mode, 16)
        out = gspo_loss(logp, old_logp, adv, mask, EPS_LOW, EPS_HIGH, denom)
        ours = torch.autograd.grad(out.loss, logp)[0]
        seq = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
            min=1)  # (B, 1)
        s, a = seq.exp(), adv[:, None]
        trl = torch.maximum(-a * s, -a * s.clamp(1 - EPS_LOW, 1 + EPS_HIGH))  # (B, 1)
        trl = (trl * mask / denom).sum()
        assert close(out.loss, trl.item()) and close(ours, torch.autograd.grad(trl, logp)[0])


@pytest.mark.parity
@pytest.mark.parametrize("case", cases("cispo"), ids=case_id)
def test_cispo_loss_equals_verl_compute_policy_loss_cispo(case):
    logp, old_logp, mask, adv = batch(case["batch"])
    denom = single_rank_denominator(mask, case["loss_agg_mode"])
    out = cispo_loss(logp, old_logp, adv, mask, EPS_LOW, EPS_HIGH, denom)
    out.loss.backward()
    assert close(out.loss, case["value"]) and close(logp.grad, case["grad"])


@pytest.mark.parametrize("case", cases("cispo"), ids=case_id)
def test_cispo_clipped_is_verl_pg_clipfrac(case):
    logp, old_logp, mask, adv = batch(case["batch"])
    out = cispo_loss(logp, old_logp, adv, mask, EPS_LOW, EPS_HIGH, 1.0)
    fraction = (out.clipped & mask).sum() / mask.sum()
    # verl's fraction is a float32 (a mean of .float()), ~7 digits
    assert abs(fraction.item() - case["metrics"]["actor/pg_clipfrac"]) < 1e-6


def test_cispo_gives_every_clipped_token_a_gradient():
    logp, old_logp, mask, adv = batch(1)
    out = cispo_loss(logp, old_logp, adv, mask, EPS_LOW, EPS_HIGH, 1.0)
    out.loss.backward()
    weight = out.ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH)
    low, high = out.clipped & mask & (out.ratio < 1), out.clipped & mask & (out.ratio > 1)
    assert low.any() and high.any()  # clipped on both sides
    assert close(logp.grad[mask], (-weight * adv[:, None])[mask])  # the clipped ones included


@pytest.mark.parity
@pytest.mark.parametrize("case", cases("kl_cov"), ids=case_id)
def test_kl_cov_loss_equals_verl_compute_policy_loss_kl_cov(case):
    logp, old_logp, mask, adv = batch(case["batch"])
    denom = single_rank_denominator(mask, case["loss_agg_mode"])
    out = kl_cov_loss(logp, old_logp, adv, mask, case["config"]["kl_cov_ratio"],
                      case["config"]["ppo_kl_coef"], denom)
    out.loss.backward()
    assert close(out.loss, case["value"]) and close(logp.grad, case["grad"])


@pytest.mark.parametrize("case", cases("kl_cov"), ids=case_id)
def test_kl_cov_clipped_marks_the_top_k_tokens_that_verl_penalises(case):
    logp, old_logp, mask, adv = batch(case["batch"])
    ratio, coef = case["config"]["kl_cov_ratio"], case["config"]["ppo_kl_coef"]
    out = kl_cov_loss(logp, old_logp, adv, mask, ratio, coef, 1.0)
    assert out.clipped.sum() == max(1, int(mask.sum().item() * ratio))
    # verl's gradient on a token without the penalty is that of -A r over the token count
    plain = -adv[:, None] * (logp - old_logp).exp() * mask / mask.sum()
    plain_grad = torch.autograd.grad(plain.sum(), logp)[0]
    differs = ~torch.isclose(plain_grad, torch.tensor(case["grad"], dtype=torch.float64),
                             rtol=TOL, atol=TOL)
    assert differs.tolist() == out.clipped.tolist()


@pytest.mark.parametrize("case", cases("kl_cov"), ids=case_id)
def test_kl_cov_penalises_the_top_k_tokens_and_no_other(case):
    # the tokens where our gradient differs from that of -A r alone are those where verl's does:
    # the penalty acts there and nowhere else, whatever its size
    logp, old_logp, mask, adv = batch(case["batch"])
    out = kl_cov_loss(logp, old_logp, adv, mask, case["config"]["kl_cov_ratio"],
                      case["config"]["ppo_kl_coef"], mask.sum().item())
    ours = torch.autograd.grad(out.loss, logp)[0]
    plain = -adv[:, None] * (logp - old_logp).exp() * mask / mask.sum()
    plain_grad = torch.autograd.grad(plain.sum(), logp)[0]

    def penalised(grad):
        return ~torch.isclose(plain_grad, grad, rtol=TOL, atol=TOL)

    verls = torch.tensor(case["grad"], dtype=torch.float64)
    assert penalised(ours).tolist() == penalised(verls).tolist() and penalised(verls).any()


def test_kl_cov_depends_on_the_micro_batch_split():
    logp, old_logp, mask, adv = batch(1)
    n_tokens = mask.sum().item()
    whole = kl_cov_loss(logp, old_logp, adv, mask, 0.2, 0.1, n_tokens)
    halves = [kl_cov_loss(logp[r], old_logp[r], adv[r], mask[r], 0.2, 0.1, n_tokens)
              for r in (slice(0, 3), slice(3, 6))]
    assert torch.cat([h.clipped for h in halves]).tolist() != whole.clipped.tolist()
    assert abs(sum(h.loss for h in halves).item() - whole.loss.item()) > 1e-6


def test_kl_cov_with_no_token_in_the_loss_penalises_nothing():
    # a filler micro-batch, every row masked: verl skips the selection (its k is 0)
    logp, old_logp, mask, adv = batch(0)
    out = kl_cov_loss(logp, old_logp, adv, torch.zeros_like(mask), 2e-4, 0.1, 1.0)
    out.loss.backward()
    assert out.loss.item() == 0 and not out.clipped.any() and not logp.grad.any()


# ------------------------------------------------------------------------------------------------
# float32

@pytest.mark.parametrize("loss_mode", ["gspo", "cispo", "kl_cov"])
def test_the_losses_compute_in_float32_what_they_compute_in_float64(loss_mode):
    ratio = {"kl_cov_ratio": 0.2} if loss_mode == "kl_cov" else {}
    case, = cases(loss_mode, loss_agg_mode="token-mean", batch=1, **ratio)
    logp, old_logp, mask, adv = batch(case["batch"], torch.float32)
    denom = single_rank_denominator(mask, "token-mean")
    if loss_mode == "kl_cov":
        out = kl_cov_loss(logp, old_logp, adv, mask, 0.2, 0.1, denom)
    else:
        fn = {"gspo": gspo_loss, "cispo": cispo_loss}[loss_mode]
        out = fn(logp, old_logp, adv, mask, EPS_LOW, EPS_HIGH, denom)
    out.loss.backward()
    assert out.loss.dtype == out.loss_tok.dtype == logp.grad.dtype == torch.float32
    assert close(out.loss, case["value"], TOL_FP32) and close(logp.grad, case["grad"], TOL_FP32)
