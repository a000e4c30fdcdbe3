"""dapo.py: each DAPO technique on hand-computed cases, the update's invariance to micro-batching
(for each --loss-mode and --loss-agg-mode, and what of it holds for KL-Cov), and the loop."""
import json
import math
import os
from dataclasses import replace

import pytest
import torch

import dapo
import losses
import toy
from dapo import Config, group_advantages, keep_groups, policy_loss, update_policy
from batches import indexed_rows, random_batch, scripted_rollout
from data import PromptIterator
from infra.errors import UserError
from infra.metrics import clip_stats, training_batch_metrics
from model import Transformer, preset
from logprobs import response_logprobs
from losses import AGGREGATIONS
from reward import Verifier
from tiny_models import flat_params, tiny_float64_model
from two_ranks import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def torch_kernel_path(monkeypatch):
    """The loop on CPU takes the kernel's PyTorch path (what `make run` does); conftest.py turns on
    Triton's interpreter for the kernel's own tests, which would make these end-to-end runs
    needlessly slow."""
    import logprobs
    from dapo_kernels import linear_logprobs_and_entropy, logprobs_and_entropy
    monkeypatch.setattr(logprobs, "logprobs_and_entropy",
                        lambda *a, **k: logprobs_and_entropy(*a, **k, backend="torch"))
    monkeypatch.setattr(logprobs, "linear_logprobs_and_entropy",
                        lambda *a, **k: linear_logprobs_and_entropy(*a, **k, backend="torch"))


# --- group advantages (Eq. 9) ---

def test_group_advantages_normalise_each_group_with_unbiased_std():
    adv = group_advantages(torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, 0.0, 0.0, 0.0]), group_size=4)
    s1 = math.sqrt(4 / 3)  # unbiased std of (1, -1, 1, -1)
    assert torch.allclose(adv[:4], torch.tensor([1, -1, 1, -1]) / (s1 + 1e-6))
    s2 = math.sqrt((1.5 ** 2 + 3 * 0.5 ** 2) / 3)  # (2, 0, 0, 0): mean 0.5
    assert torch.allclose(adv[4:], torch.tensor([1.5, -0.5, -0.5, -0.5]) / (s2 + 1e-6))


def test_all_equal_group_has_zero_advantage():
    assert torch.equal(group_advantages(torch.tensor([-1.0, -1.0, -1.0]), 3), torch.zeros(3))


def test_group_of_one_keeps_its_reward():  # mean 0, std 1 (verl's convention)
    rewards = torch.tensor([1.0, -1.0, 0.5])
    assert torch.allclose(group_advantages(rewards, 1), rewards)


# --- dynamic sampling filter (Eq. 11) ---

def test_keep_groups_drops_all_right_and_all_wrong():
    acc = torch.tensor([1, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 1], dtype=torch.bool)  # groups of 3
    assert keep_groups(acc, 3).tolist() == [False, False, True, False]


def test_keep_groups_keeps_groups_of_one():
    assert keep_groups(torch.tensor([True, False]), 1).tolist() == [True, True]


# --- clip-higher surrogate and token-level loss (Eq. 10, 12) ---

def _loss(ratio, adv, eps_high=0.28, dual_clip=0.0):
    logp = torch.log(torch.tensor([[ratio]]))
    mask, adv = torch.ones(1, 1, dtype=torch.bool), torch.tensor([adv])
    surrogate = policy_loss(logp, torch.zeros(1, 1), adv, mask, 0.2, eps_high, 1.0)
    return losses.dual_clip_and_weights(surrogate, adv, mask, 1.0, dual_clip, None).loss.item()


@pytest.mark.parametrize("ratio,adv,eps_high,expected", [
    (1.5, 1.0, 0.28, -1.28),   # positive advantage: the gain is capped at 1 + eps_high ...
    (1.5, 1.0, 0.20, -1.20),   # ... which clip-higher raises above the symmetric 1.2
    (1.1, 1.0, 0.28, -1.10),   # inside the trust region: no clipping
    (0.5, 1.0, 0.28, -0.50),   # a positive advantage below 1 - eps_low is not clipped (pessimism)
    (0.5, -1.0, 0.28, 0.80),   # negative advantage: clipped at 1 - eps_low
    (1.5, -1.0, 0.28, 1.50),   # a negative advantage with a large ratio is not clipped (pessimism)
])
def test_clip_higher_surrogate_on_hand_cases(ratio, adv, eps_high, expected):
    assert _loss(ratio, adv, eps_high) == pytest.approx(expected, abs=1e-6)


@pytest.mark.needs("policy_loss")
def test_dual_clip_caps_negative_advantage_loss():
    assert _loss(5.0, -1.0) == pytest.approx(5.0, abs=1e-5)
    assert _loss(5.0, -1.0, dual_clip=3.0) == pytest.approx(3.0, abs=1e-6)


def test_clipped_tokens_get_no_gradient():
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), mask, 0.2, 0.28, 2.0).loss
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == pytest.approx(-1.1 / 2)


def test_token_level_loss_weighs_every_token_equally():
    # two responses, 1 and 3 tokens, per-token loss = -A * ratio = -A at ratio 1
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([2.0, 1.0])
    token_level = policy_loss(logp, logp, adv, mask, 0.2, 0.28, denom=4).loss
    assert token_level.item() == pytest.approx(-(2 + 1 + 1 + 1) / 4)
    per_sequence = policy_loss(logp, logp, adv, mask, 0.2, 0.28,
                               denom=mask.sum(-1, keepdim=True) * 2).loss
    assert per_sequence.item() == pytest.approx(-(2 / 1 + 3 / 3) / 2)


@pytest.mark.needs("policy_loss")
def test_a_token_weight_scales_its_loss_but_not_the_token_count():
    # the rollout correction's weight w (infra/rollout_correction.py): sum_t w_t l_t / denom, and
    # a token masked by the correction (w = 0) stays in Eq. 12's count, as in TRL and verl
    logp, adv = torch.zeros(1, 3), torch.tensor([1.0])  # r = 1 on every token: l = -A = -1
    mask, weight = torch.ones(1, 3, dtype=torch.bool), torch.tensor([[2.0, 0.0, 0.5]])
    surrogate = policy_loss(logp, logp, adv, mask, 0.2, 0.28, denom=3.0)
    out = losses.dual_clip_and_weights(surrogate, adv, mask, 3.0, dual_clip=0.0, weight=weight)
    assert out.loss.item() == pytest.approx(-(2.0 + 0.0 + 0.5) / 3)
    assert out.loss_tok.tolist() == [[-1.0, -1.0, -1.0]] and out.ratio.tolist() == [[1, 1, 1]]


# --- the update: gradient independent of the micro-batch split ---

SPLITS = (dict(micro_batch_size=1, micro_batch_tokens=0),
          dict(micro_batch_size=2, micro_batch_tokens=0),
          dict(micro_batch_size=4, micro_batch_tokens=0),
          dict(micro_batch_tokens=1), dict(micro_batch_tokens=20), dict(micro_batch_tokens=40))
# GSPO clips one ratio per response, and this batch's sequence ratios lie within 15% of 1: at
# 0.02 its clip binds on 3 of the 7 responses in the loss (at DAPO's 0.2 / 0.28 on none, at its
# paper's 3e-4 / 4e-4 on 5), so that both branches of its max() are in the step
CLIP = {"vanilla": {}, "gspo": dict(eps_low=0.02, eps_high=0.02), "cispo": {}}


def configs_by_split(**cfg) -> list[Config]:
    """cfg under each of SPLITS, with overlong filtering (a response masked out of the loss)."""
    base = dict(group_size=4, grad_clip=1e9, overlong_filtering=True)
    return [Config(**{**base, **cfg, **split}) for split in SPLITS]


def sgd_steps(batch, configs):
    """The weights and the metrics of update_policy on batch under each config (one SGD step of lr
    1 per mini-batch), from the same float64 model; and how far the first moved the weights."""
    results = []
    for cfg in configs:
        model = tiny_float64_model()
        m = update_policy(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, cfg)
        results.append((flat_params(model), m))
    moved = (results[0][0] - flat_params(tiny_float64_model())).abs().max()
    return results, moved


@pytest.mark.parity
@pytest.mark.needs("policy_loss", "token_count", "logprobs_forward", "logprobs_backward", "rope",
                   "attention")
@pytest.mark.parametrize("loss_agg_mode", AGGREGATIONS)
@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "cispo"])
def test_update_is_the_same_for_any_micro_batch_split(loss_mode, loss_agg_mode):
    """1, 2 or 4 rows per micro-batch, or rows sorted by length under a budget of 1 (one row
    each), 20 or 40 padded tokens: the same weights, for every --loss-mode whose loss is a sum
    over responses (KL-Cov's is not: the tests below) under every --loss-agg-mode, because the
    denominator is counted over the mini-batch before the split (Dr. GRPO's constant is
    --max-response-len, not a micro-batch's padded width) and GSPO's sequence ratio is a
    response's own. The whole cross product: a case costs ~0.4 s. --scale-rewards is not here:
    the advantages are made before the update (test_distributed.py's 2 ranks check the batch
    std). In float64, the splits, which sum the same terms in other orders, differ by 3e-16 to
    4e-15 of the step (measured; a per-micro-batch denominator: ~0.5), so 1e-12 holds on any
    CPU."""
    batch = random_batch(50, dtype=torch.float64)  # old_logp given: the policy is not pi_old
    configs = configs_by_split(mini_batch_prompts=2, loss_mode=loss_mode,
                               loss_agg_mode=loss_agg_mode, **CLIP[loss_mode])
    results, moved = sgd_steps(batch, configs)
    assert moved > 1e-2  # the update did something
    assert 0 < results[0][1]["actor/pg_clipfrac"] < 1  # the clip binds on some tokens, not all
    for params, m in results[1:]:
        assert (params - results[0][0]).abs().max() < 1e-12 * moved
        assert m["actor/pg_loss"] == pytest.approx(results[0][1]["actor/pg_loss"], rel=1e-12)


# KL-Cov penalises the top k = max(1, int(n_valid x --kl-cov-ratio)) tokens by covariance among
# the valid tokens of the micro-batch it is called on (verl's compute_policy_loss_kl_cov): its loss
# depends on the split by definition. What holds whatever the split, and what does not:

def penalised_tokens(batch, cfg) -> int:
    """The tokens KL-Cov penalises in update_policy at verl's --kl-cov-ratio 2e-4: one in each
    micro-batch with a token in the loss (2e-4 x its few tokens is below 1)."""
    return sum(int(dapo.tokens_in_loss(mini, cfg)[rows].any())
               for mini in batch.split(cfg.mini_batch_prompts * cfg.group_size)
               for rows in mini.micro_batch_rows(cfg.micro_batch_size, cfg.micro_batch_tokens))


@pytest.mark.parity
@pytest.mark.needs("token_count", "logprobs_forward", "logprobs_backward", "rope", "attention")
def test_kl_cov_first_step_of_a_rollout_is_the_same_for_any_micro_batch_split():
    """At a rollout's first optimizer step pi_theta is pi_old: logp == old_logp on every token,
    and |logp - old_logp|, whose derivative torch takes as 0 at 0, adds nothing to the gradient.
    Whichever tokens each split penalises, the step is the unclipped surrogate's, the one of
    --ppo-kl-coef 0. Exactly so when pi_old's log-probs are the update's own forward's, detached
    (one mini-batch per rollout, as here); with several, pi_old has a forward of its own over
    other micro-batches (dapo.with_old_logprobs), equal up to round-off (4e-16 measured with
    --micro-batch-tokens 40), and |x|' at x = +-4e-16 is +-1: a penalised token's gradient is
    then --ppo-kl-coef times the round-off's sign (verl's old_log_prob is a forward of its own
    too). float64: ~5e-16 of the step apart."""
    batch = replace(random_batch(50, dtype=torch.float64), old_logp=None)  # as collect_batch's
    configs = configs_by_split(mini_batch_prompts=2, loss_mode="kl_cov")
    results, moved = sgd_steps(batch, configs)
    assert moved > 1e-2
    n_tokens = dapo.tokens_in_loss(batch, configs[0]).sum().item()
    penalised = [round(m["actor/pg_clipfrac"] * n_tokens) for _, m in results]
    assert penalised == [penalised_tokens(batch, cfg) for cfg in configs]
    assert len(set(penalised)) > 1, penalised  # the splits penalise different tokens...
    unpenalised, _ = sgd_steps(batch, [replace(cfg, ppo_kl_coef=0.0) for cfg in configs])
    for (params, _), (plain, _) in zip(results, unpenalised):  # ...and take the same step
        assert (params - results[0][0]).abs().max() < 1e-12 * moved
        # the penalty's gradient is 0, not small
        assert torch.equal(params, plain), (params - plain).abs().max()


@pytest.mark.needs("token_count", "logprobs_forward", "logprobs_backward", "rope", "attention")
def test_kl_cov_once_the_policy_moved_depends_on_the_micro_batch_split():
    """Two optimizer steps: at the second, pi_theta has moved from pi_old, the penalty
    |logp - old_logp| has a gradient on each penalised token, and which tokens those are is each
    micro-batch's top k (one per micro-batch with a token in the loss): 1 row per micro-batch
    and 4 take steps ~3% of the step apart (measured), not float64 round-off."""
    batch = replace(random_batch(50, dtype=torch.float64), old_logp=None)
    configs = configs_by_split(mini_batch_prompts=1, loss_mode="kl_cov")  # 2 mini-batches
    results, moved = sgd_steps(batch, configs)
    n_tokens = dapo.tokens_in_loss(batch, configs[0]).sum().item()
    for (_, m), cfg in zip(results, configs):  # each micro-batch's top 1, at both steps
        assert round(m["actor/pg_clipfrac"] * n_tokens) == penalised_tokens(batch, cfg)
    one_row, four_rows = results[0][0], results[2][0]  # micro_batch_size 1 and 4
    assert (one_row - four_rows).abs().max() > 1e-3 * moved


@pytest.mark.parity
@pytest.mark.needs("token_count", "logprobs_forward", "logprobs_backward", "rope", "attention")
def test_kl_cov_without_its_penalty_is_the_same_for_any_micro_batch_split():
    """--ppo-kl-coef 0: the selection still runs per micro-batch, and weighs nothing; what is left
    is the unclipped surrogate -A r, a sum over tokens, the same whatever the split at every step
    (two here, the second after the policy moved). float64: ~6e-16 of the step apart."""
    batch = replace(random_batch(50, dtype=torch.float64), old_logp=None)
    configs = configs_by_split(mini_batch_prompts=1, loss_mode="kl_cov", ppo_kl_coef=0.0)
    results, moved = sgd_steps(batch, configs)
    assert moved > 1e-2
    for params, m in results[1:]:
        assert (params - results[0][0]).abs().max() < 1e-12 * moved
        assert m["actor/pg_loss"] == pytest.approx(results[0][1]["actor/pg_loss"], rel=1e-12)


# --- the token count before the split (Eq. 12), with a stand-in policy and loss ---
# update_policy alone: model.py, the kernels and policy_loss() are exercises of their own

class TablePolicy(torch.nn.Module):
    """A policy without context: one logit per vocabulary token."""

    def __init__(self, vocab):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        # float64: the splits below sum the same terms in other orders
        self.logits = torch.nn.Parameter(torch.randn(vocab, generator=g, dtype=torch.float64))


def table_logprobs(model, batch, temperature, fused_head=True):  # as dapo.response_logprobs
    logp_all = (model.logits / temperature).log_softmax(-1)  # (V,)
    entropy = -(logp_all.exp() * logp_all).sum()
    logp = logp_all[batch.response_ids] * batch.response_mask  # (B, R)
    return logp, entropy.expand(logp.shape)


def unclipped_loss(logp, old_logp, adv, loss_mask, eps_low, eps_high, denom):
    """policy_loss's contract, without the clip."""
    ratio = (logp - old_logp).exp()
    loss_tok = -adv[:, None] * ratio
    return dapo.PolicyLoss((loss_tok * loss_mask / denom).sum(), loss_tok, ratio)


@pytest.fixture
def stand_ins(monkeypatch):
    """-> the denominators that update_policy hands the loss, one per micro-batch (the loss is
    computed once: its logged actor/pg_loss and clip fractions are read from the result)."""
    denoms = []

    def loss(*args):
        denoms.append(args[6])
        return unclipped_loss(*args)

    monkeypatch.setattr(dapo, "response_logprobs", table_logprobs)
    monkeypatch.setattr(dapo, "policy_loss", loss)
    return denoms


@pytest.mark.needs("policy_loss", "token_count")
def test_the_clip_statistics_are_those_of_the_loss_that_was_trained(monkeypatch):
    """A policy_loss edited to clip elsewhere (a tighter clip, or none) logs its own clip
    fractions and its own pg_loss: the loop reads them from the loss's result, where it once
    recomputed the reference's clip (and an edited exercise logged the old formula's)."""
    monkeypatch.setattr(dapo, "response_logprobs", table_logprobs)
    real = dapo.policy_loss
    def tight(logp, old_logp, adv, mask, eps_low, eps_high, *rest):
        return real(logp, old_logp, adv, mask, 0.05, 0.05, *rest)
    logged = {}
    for name, loss in [("real", real), ("tight", tight), ("unclipped", unclipped_loss)]:
        monkeypatch.setattr(dapo, "policy_loss", loss)
        model = TablePolicy(50)  # 2 steps: the second one's ratios are away from 1
        cfg = Config(group_size=4, mini_batch_prompts=1, grad_clip=1e9)
        logged[name] = update_policy(model, torch.optim.SGD(model.parameters(), lr=30.0),
                                     random_batch(50, dtype=torch.float64), cfg)
    clipfrac = {name: m["actor/pg_clipfrac"] for name, m in logged.items()}
    assert clipfrac["tight"] > clipfrac["real"] > clipfrac["unclipped"] == 0, clipfrac
    losses = {m["actor/pg_loss"] for m in logged.values()}
    assert len(losses) == 3, losses


@pytest.mark.parametrize("loss_agg_mode", AGGREGATIONS)
def test_the_loss_denominator_is_the_mini_batch_token_count(stand_ins, loss_agg_mode):
    batch = random_batch(50)  # 8 responses of 1-8 tokens, response 3 truncated
    cfg = Config(group_size=4, mini_batch_prompts=1, micro_batch_size=3, micro_batch_tokens=0,
                 overlong_filtering=True, loss_agg_mode=loss_agg_mode)
    model = TablePolicy(50)
    update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, cfg)
    mask = batch.response_mask & ~batch.truncated[:, None]  # overlong filtering: response 3 is out
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # (8, 1)
    expected = []
    for mini in (slice(0, 4), slice(4, 8)):  # mini-batches of 4 rows, micro-batches of 3 and 1
        for micro in ((slice(mini.start, mini.start + 3)), slice(mini.start + 3, mini.stop)):
            n_seqs = mask[mini].any(-1).sum().item()  # the sequences in the loss
            if loss_agg_mode == "token-mean":  # every token of the mini-batch, wherever it falls
                expected.append(mask[mini].sum().item())
            elif loss_agg_mode == "seq-mean-token-mean":  # naive GRPO: each sequence's length
                expected.append(lengths[micro] * n_seqs)
            else:  # Dr. GRPO: the response length limit, for every sequence
                expected.append(cfg.max_response_len * n_seqs)
    assert len(stand_ins) == len(expected)
    for got, want in zip(stand_ins, expected):
        assert torch.equal(torch.as_tensor(got, dtype=torch.float32),
                           torch.as_tensor(want, dtype=torch.float32))


@pytest.mark.parity
def test_a_stand_in_policy_update_is_the_same_for_any_micro_batch_split(stand_ins):
    results = []
    for split in (dict(micro_batch_size=1, micro_batch_tokens=0),
                  dict(micro_batch_size=3, micro_batch_tokens=0),
                  dict(micro_batch_size=8, micro_batch_tokens=0),
                  dict(micro_batch_tokens=1), dict(micro_batch_tokens=30)):
        model = TablePolicy(50)
        cfg = Config(group_size=4, mini_batch_prompts=2, grad_clip=1e9, overlong_filtering=True,
                     **split)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        update_policy(model, opt, random_batch(50, dtype=torch.float64), cfg)
        results.append(model.logits.detach().clone())
    moved = (results[0] - TablePolicy(50).logits).abs().max()
    assert moved > 1e-3  # the update did something
    for logits in results[1:]:  # float64 round-off, ~1e-16 of the step
        assert (logits - results[0]).abs().max() < 1e-9 * moved


@pytest.mark.parity
@pytest.mark.needs("policy_loss", "token_count", "logprobs_forward", "logprobs_backward", "rope",
                   "attention")
@pytest.mark.parametrize("tied", [True, False])
def test_update_is_the_same_with_the_fused_and_the_unfused_head(tied):
    """Two SGD steps in float64: the fused head sums the same products in chunks, the unfused one
    in one matmul, so they differ by float64 round-off, ~1e-16 of the step."""
    weights = []
    for fused in (True, False):
        model = tiny_float64_model(tied)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        cfg = Config(group_size=4, mini_batch_prompts=1, micro_batch_size=3, micro_batch_tokens=0,
                     fused_head=fused)
        update_policy(model, opt, random_batch(50, dtype=torch.float64), cfg)
        weights.append(flat_params(model))
    moved = (weights[1] - flat_params(tiny_float64_model(tied))).abs().max()
    assert moved > 1e-2  # the steps moved the weights
    assert (weights[0] - weights[1]).abs().max() < 1e-9 * moved


@pytest.mark.needs("policy_loss", "token_count", "logprobs_forward", "logprobs_backward", "rope",
                   "attention")
def test_non_finite_gradient_skips_the_update(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=50))
    before = [p.detach().clone() for p in model.parameters()]
    real = dapo.policy_loss
    def nan_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        return replace(out, loss=out.loss * float("nan"))
    monkeypatch.setattr(dapo, "policy_loss", nan_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = update_policy(model, opt, random_batch(50), Config(group_size=4))
    assert m["train/skipped_updates"] == 1 and m["train/updates"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --- the loop, end to end on a tiny random model ---

def _cfg(model_dir, out_dir, **kw):
    """A few tiny steps of the random model. It never answers right, so every group has zero
    advantage: without dynamic sampling each step still trains (a run that takes no optimizer
    step exits non-zero, having trained nothing); the tests of dynamic sampling turn it on."""
    small = dict(model=model_dir, out_dir=str(out_dir), steps=3, train_prompts=4, gen_prompts=4,
                 group_size=4, max_gen_batches=2, max_response_len=12, overlong_buffer=4,
                 mini_batch_prompts=2, micro_batch_size=8, eval_every=2, eval_prompts=4,
                 eval_samples=2, lr=1e-3, dynamic_sampling=False)
    return Config(**{**small, **kw})


@pytest.mark.needs("all")
def test_three_steps_write_metrics_and_a_transformers_loadable_checkpoint(tiny_model_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    # a random model never writes "Answer:", so every group is all wrong: without dynamic
    # sampling the steps still train (on zero advantages)
    dapo.main(_cfg(tiny_model_dir, tmp_path, dynamic_sampling=False))
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train = [m for m in lines if "rollout/acc" in m]
    assert [m["step"] for m in train] == [1, 2, 3]
    assert {"critic/score/mean", "response_length/mean", "train/num_gen_batches", "timing/gen_s",
            "actor/entropy", "train/updates"} <= set(train[0])
    assert [m["step"] for m in lines if "val/acc" in m] == [0, 2, 3]
    ckpt = tmp_path / "checkpoints" / "step_000003" / "model"
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    ours = Transformer.from_pretrained(str(ckpt))
    x = torch.randint(0, ours.config.vocab_size, (1, 7))
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max() < 1e-5
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000003"


@pytest.mark.needs("all")
def test_resume_continues_exactly(tiny_model_dir, tmp_path):
    dapo.main(_cfg(tiny_model_dir, tmp_path / "straight", steps=4, eval_every=0))
    dapo.main(_cfg(tiny_model_dir, tmp_path / "resumed", steps=2, eval_every=0))
    dapo.main(_cfg(tiny_model_dir, tmp_path / "resumed", steps=4, eval_every=0, resume=True))
    step_4 = os.path.join("checkpoints", "step_000004", "model")
    a = Transformer.from_pretrained(str(tmp_path / "straight" / step_4))
    b = Transformer.from_pretrained(str(tmp_path / "resumed" / step_4))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.needs("all")
def test_dynamic_sampling_cap_trains_whole_mini_batches_and_says_so(tiny_model_dir, tmp_path,
                                                                     monkeypatch, capsys):
    # rows 0-3 in a generation batch of 2 prompts: all right, all wrong, right once, right once
    monkeypatch.setattr(dapo, "rollout", scripted_rollout)
    monkeypatch.setattr(toy, "toy_rows", lambda n, seed, split: indexed_rows(8))
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=1, eval_every=0, train_prompts=4,
                   gen_prompts=2, max_gen_batches=3, mini_batch_prompts=2, dynamic_sampling=True))
    m = json.loads(open(tmp_path / "metrics.jsonl").readlines()[1])  # after the settings row
    assert m["train/num_gen_batches"] == 3 and m["train/gen_cap_hit"] == 1
    kept = 6 - m["train/groups_filtered"]  # groups with signal among the 3 x 2 generated
    assert m["train/groups_kept"] == kept - kept % 2 and m["train/groups_surplus"] == kept % 2
    assert m["train/updates"] == m["train/groups_kept"] // 2  # whole mini-batches only
    assert (f"with {kept} groups with signal, fewer than --train-prompts; trained on the "
            f"{kept - kept % 2} of whole mini-batches") in "".join(capsys.readouterr())


@pytest.mark.needs("keep_groups", "overlong_penalty", "group_advantages")
def test_dynamic_sampling_cap_stops_with_an_error_when_asked(monkeypatch):
    monkeypatch.setattr(dapo, "rollout", scripted_rollout)
    cfg = Config(train_prompts=4, gen_prompts=4, group_size=2, mini_batch_prompts=2,
                 max_gen_batches=1, on_gen_cap="error")
    iterator = PromptIterator([indexed_rows(4)[k] for k in (0, 1, 2, 3)], 4, seed=0)
    with pytest.raises(UserError, match="found 2 of 4 groups with signal in --max-gen-batches"):
        dapo.collect_batch(torch.nn.Linear(1, 1), iterator, None, cfg, Verifier(), None)


@pytest.mark.needs("keep_groups", "overlong_penalty", "group_advantages")
def test_filtered_counts_groups_without_signal_not_the_surplus(monkeypatch):
    # 3 groups with signal and 1 all-correct, for a batch of 2: 1 filtered, 1 surplus
    monkeypatch.setattr(dapo, "rollout", scripted_rollout)
    rows = [indexed_rows(8)[k] for k in (0, 2, 3, 6)]  # all right, right once (x3)
    cfg = Config(train_prompts=2, gen_prompts=4, group_size=2, mini_batch_prompts=2)
    collected = dapo.collect_batch(torch.nn.Linear(1, 1), PromptIterator(rows, 4, 0), None, cfg,
                                   Verifier(), None)
    m = collected.metrics
    assert m["train/groups_filtered"] == 1 and m["train/groups_surplus"] == 1
    assert m["train/groups_kept"] == collected.to_train.num_groups == 2


@pytest.mark.needs("keep_groups", "overlong_penalty", "group_advantages")
@pytest.mark.parametrize("split", ["groups", "rows"])
def test_two_ranks_keep_the_groups_one_process_keeps(tmp_path, monkeypatch, split):
    """From the same (scripted) generations, 2 ranks train each mini-batch on the same responses
    as one process, although the ranks found groups with signal at different rates: whole groups
    with 2 prompts per mini-batch, and with 1 (fewer than the ranks, as the paper's 32 prompts on
    128 GPUs) each rank one of the group's 2 responses."""
    import collect_worker
    monkeypatch.setattr(dapo, "rollout", scripted_rollout)
    cfg = replace(collect_worker.CFG, mini_batch_prompts=1) if split == "rows" else \
        collect_worker.CFG
    one, one_metrics = collect_worker.collect(cfg)
    torchrun("tests/collect_worker.py", str(tmp_path), *(["rows"] if split == "rows" else []))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    two = [sorted(a + b) for a, b in zip(ranks[0]["mini_batches"], ranks[1]["mini_batches"])]
    assert two == [sorted(m) for m in one]
    share = 1 if split == "rows" else 4  # an even split: responses per rank and mini-batch
    assert all(len(a) == share for r in ranks for a in r["mini_batches"])
    assert ranks[0]["metrics"]["train/num_gen_batches"] == one_metrics["train/num_gen_batches"]
    # the case is not trivial: rank 0 took prompts 0, 2, 4 of each generation batch, rank 1 the
    # others, and one of them held more than its half of the groups with signal
    owned = {r: {g for m in one for g in m if collect_worker.position(g) % 2 == r} for r in (0, 1)}
    assert len(owned[0]) != len(owned[1])


def test_log_ratio_is_clamped_so_an_overflowing_ratio_keeps_the_gradient_finite():
    # log-ratio 90: exp overflows to inf and the whole gradient would be NaN; clamped to 20 as
    # verl does, the token is clipped (no gradient) and the other keeps its gradient -A / denom
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = policy_loss(logp, torch.tensor([[-91.0, -2.0]]), torch.tensor([1.0]),
                       torch.ones(1, 2, dtype=torch.bool), 0.2, 0.28, denom=2.0).loss
    loss.backward()
    assert torch.isfinite(loss) and logp.grad.tolist() == [[0.0, -0.5]]


@pytest.mark.needs("policy_loss")
def test_clip_statistics_mean_what_verl_means():
    # tokens: up-clipped (A > 0, r = 1.5), low-clipped (A < 0, r = 0.5), dual-clipped (A < 0,
    # r = 5 with c = 3), inside (r = 1)
    ratio = torch.tensor([[1.5], [0.5], [5.0], [1.0]])
    old_logp = torch.full((4, 1), math.log(0.1))
    logp, adv = old_logp + ratio.log(), torch.tensor([1.0, -1.0, -1.0, 1.0])
    mask = torch.ones(4, 1, dtype=torch.bool)
    out = losses.dual_clip_and_weights(policy_loss(logp, old_logp, adv, mask, 0.2, 0.28, 1.0),
                                       adv, mask, 1.0, dual_clip=3.0, weight=None)
    stats = clip_stats(out, logp, old_logp, adv, mask)
    assert stats["clip_high"] == 1 and stats["clip_low"] == 1 and stats["dual_clip"] == 1
    assert stats["pg_loss"].item() == pytest.approx(-1.28 + 0.8 + 3.0 - 1.0)
    assert stats["up_clipped_prob"].item() == pytest.approx(0.1)  # pi_old of the up-clipped one
    assert stats["token_prob"].item() == pytest.approx(0.4)


def test_training_batch_score_includes_the_overlong_penalty():
    batch = random_batch(50, n=4, group_size=2)
    batch = replace(batch, reward=torch.tensor([1.0, -1.5, -1.0, 0.5]))  # score + penalty
    m = training_batch_metrics(batch)
    assert m["critic/score/mean"] == pytest.approx(-0.25) == m["critic/rewards/mean"]
    assert m["response_length/mean"] == batch.response_mask.sum().item() / 4


@pytest.mark.parity
@pytest.mark.needs("policy_loss", "token_count", "logprobs_forward", "logprobs_backward", "rope",
                   "attention")
def test_entropy_is_pi_olds_before_the_update():
    # float64: the whole batch at once here, micro-batches in the update
    batch = replace(random_batch(50, dtype=torch.float64), old_logp=None)  # as collect_batch's
    with torch.no_grad():
        _, entropy = response_logprobs(tiny_float64_model(), batch, 1.0)
    expected = (entropy * batch.response_mask).sum() / batch.response_mask.sum()
    for mini_batch_prompts in (1, 2):  # 2 optimizer steps (pi_old's own forward), then 1
        model = tiny_float64_model()
        m = update_policy(model, torch.optim.SGD(model.parameters(), lr=10.0), batch,
                          Config(group_size=4, mini_batch_prompts=mini_batch_prompts))
        assert m["actor/entropy"] == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize("warmup,expected", [(3, [0, 1 / 3, 2 / 3, 1, 1]), (0, [1] * 5)])
def test_learning_rate_warms_up_from_zero(warmup, expected):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    lrs = []
    for step in range(5):
        dapo.set_lr(opt, Config(lr=1.0, warmup_steps=warmup), step)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx(expected)


@pytest.mark.needs("extract_answer", "normalize", "filter_logits", "sample", "rope", "attention",
                   "kv_cache")
def test_eval_only_prints_avg_and_pass_at_k_and_writes_them_to_eval_json(tiny_model_dir,
                                                                        tmp_path, capsys):
    dapo.main(_cfg(tiny_model_dir, tmp_path, eval_only=True))
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert set(out) == {"val/acc", "val/pass@2"} and 0 <= out["val/acc"] <= out["val/pass@2"] <= 1
    assert lines[-2] == f"written to {tmp_path / 'eval.json'}:"
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved.pop("config")["model"] == tiny_model_dir and saved == out


def test_the_eval_only_example_of_the_help_is_the_papers_aime_evaluation():
    # before: `--eval-only --model PATH --val-data aime-2024.parquet --eval-samples 32` evaluated
    # with the demo's 64-token prompts and 40-token responses
    from config import parse_args
    text = dapo.__doc__.replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "--eval-only" in line)
    cfg = parse_args(line.split("python dapo.py")[1].split("#")[0].split())
    assert cfg.eval_only and cfg.val_data == "aime-2024.parquet"
    assert (cfg.max_prompt_len, cfg.max_response_len) == (2048, 20480)
    assert (cfg.eval_samples, cfg.eval_temperature, cfg.eval_top_p, cfg.eval_prompts) == \
        (32, 1.0, 0.7, 0)


