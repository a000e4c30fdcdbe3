"""--rollout-correction (infra/rollout_correction.py): each mode's weights on hand-computed cases,
no correction at all when the sampler agrees with the trainer, masked tokens kept in Eq. 12's
count, the gradient against float64 autograd, the rollout_corr/ metrics, and a real bf16 sampler
beside an fp32 trainer."""
import json
import math
from dataclasses import replace

import pytest
import torch

import dapo
import losses
import sampler
from batches import random_batch
from config import Config
from infra import health
from infra.rollout_correction import MODES, Stats, correct
from test_dapo import TablePolicy, _cfg, table_logprobs
from test_readme import documented_metrics
from test_dapo import torch_kernel_path  # noqa: F401 (autouse: the loop on the kernel's torch path)

CORRECTING = [mode for mode in MODES if mode != "none"]
# per token: rho = pi_old / pi_sampler; row 0 has 4 tokens (product 1.2), row 1 has 2 (product 6)
RHO = [[0.25, 0.8, 1.5, 4.0], [2.0, 3.0, 1.0, 1.0]]
MASK = torch.tensor([[True] * 4, [True, True, False, False]])
C_MIN, C_MAX = 0.5, 2.0
EXPECTED = {  # by hand from the definitions (TRL's modes), [C_min, C_max] = [0.5, 2]
    "token_truncate": [[0.5, 0.8, 1.5, 2.0], [2.0, 2.0]],
    "token_mask": [[0.0, 0.8, 1.5, 0.0], [2.0, 0.0]],  # a bound itself is inside, as TRL's
    "sequence_truncate": [[1.2] * 4, [2.0] * 2],
    "sequence_mask": [[1.2] * 4, [0.0] * 2],
}


def constructed(mode):
    """The weights of `mode` on RHO, and the batch-like holder of the sampler's log-probs; in
    float64 so that exp(log(x)) is x to 1e-15."""
    # requiring a gradient: the weight must not carry one (it changes the measure, not the loss)
    old_logp = torch.full((2, 4), -1.0, dtype=torch.float64, requires_grad=True)
    # the padding's sampler log-prob is 0 (the sampler's), far from pi_old's: it must not count
    rollout_logp = (old_logp.detach() - torch.tensor(RHO, dtype=torch.float64).log()) * MASK
    return correct(old_logp, rollout_logp, MASK, mode, C_MIN, C_MAX), old_logp, rollout_logp


@pytest.mark.parametrize("mode", CORRECTING)
def test_each_mode_weighs_tokens_as_computed_by_hand(mode):
    c, _, _ = constructed(mode)
    for row in (0, 1):
        got = c.weight[row][MASK[row]].tolist()
        assert got == pytest.approx(EXPECTED[mode][row], rel=1e-12), (row, got)
    assert torch.isfinite(c.weight).all() and not c.weight.requires_grad


def test_no_correction_is_a_weight_of_exactly_one():
    c, _, _ = constructed("none")
    assert c.weight is None and c.rho is None  # no weight: the paper's loss to the last bit


def test_the_weights_statistics_mean_what_verl_means():
    c, old_logp, rollout_logp = constructed("token_mask")
    stats = Stats()
    stats.add_mismatch(old_logp, rollout_logp, MASK)
    stats.add_weights(c, MASK)
    m = stats.result()
    rho = [0.25, 0.8, 1.5, 4.0, 2.0, 3.0]
    w = [0.0, 0.8, 1.5, 0.0, 2.0, 0.0]
    mean, mean_sq = sum(w) / 6, sum(x * x for x in w) / 6
    want = {
        "rollout_is_mean": mean, "rollout_is_min": 0.0, "rollout_is_max": 2.0,
        "rollout_is_std": math.sqrt(mean_sq - mean ** 2),
        "rollout_is_eff_sample_size": mean ** 2 / mean_sq,
        "rollout_is_ratio_fraction_high": 2 / 6, "rollout_is_ratio_fraction_low": 1 / 6,
        "kl": -sum(map(math.log, rho)) / 6,  # log p_sampler - log p_trainer
        "k3_kl": sum(r - math.log(r) - 1 for r in rho) / 6,
        "chi2_token": sum(r * r for r in rho) / 6 - 1,
        "chi2_seq": (1.2 ** 2 + 6.0 ** 2) / 2 - 1,
        "training_ppl": math.e,  # log p = -1 on every token
        # exp(-mean_t log p_sampler) per response, then their mean
        "rollout_ppl": (math.exp(1 + math.log(1.2) / 4) + math.exp(1 + math.log(6.0) / 2)) / 2,
    }
    assert {k.removeprefix("rollout_corr/") for k in m} == set(want)
    for name, value in want.items():
        assert m[f"rollout_corr/{name}"] == pytest.approx(value, rel=1e-12), name
    assert Stats().result() == {}  # nothing added: nothing logged


# --- in the update: pi_old over the sampler's, in one optimizer step and in several ---

@pytest.fixture
def table_policy(monkeypatch):
    """The update's forward on a context-free table (test_dapo.TablePolicy), in float64; ->
    the (surrogate, weight, denom) that each call of losses.dual_clip_and_weights got, where the
    correction's weight reaches the loss."""
    calls = []
    real = losses.dual_clip_and_weights
    monkeypatch.setattr(dapo, "response_logprobs", table_logprobs)

    def spy(surrogate, adv, mask, denom, dual_clip, weight):
        calls.append((surrogate, weight, denom))
        return real(surrogate, adv, mask, denom, dual_clip, weight)

    monkeypatch.setattr(losses, "dual_clip_and_weights", spy)
    return calls


def rollout_batch():
    """random_batch as collect_batch hands it over: pi_old not yet computed, the sampler's
    log-probs far from the policy's."""
    return replace(random_batch(50, dtype=torch.float64), old_logp=None)


def update(cfg, batch):
    """One update of a fresh table policy with SGD(lr=1): (its logits after, the metrics)."""
    model = TablePolicy(50)
    m = dapo.update_policy(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, cfg)
    return model.logits.detach(), m


def sampler_agreeing(batch):
    """The batch with the sampler's log-probs equal to the table policy's own, bit for bit."""
    with torch.no_grad():
        logp, _ = table_logprobs(TablePolicy(50), batch, 1.0)
    return replace(batch, rollout_logp=logp)


# one optimizer step (pi_old is the update's own forward), and two (with_old_logprobs() first)
STEPS = pytest.mark.parametrize("mini_batch_prompts", [2, 1])


@pytest.mark.needs("policy_loss", "token_count")
@STEPS
@pytest.mark.parametrize("mode", CORRECTING)
def test_a_sampler_that_agrees_with_the_trainer_is_no_correction(table_policy, mode,
                                                                 mini_batch_prompts):
    # rho = exp(0) = 1 on every token, so every mode's weight is 1 and the step is the same to
    # the last bit; pi_old must be the one the sampler agrees with (not the policy after a step)
    batch = sampler_agreeing(rollout_batch())
    cfg = Config(group_size=4, mini_batch_prompts=mini_batch_prompts, grad_clip=1e9)
    plain, m_plain = update(cfg, batch)
    corrected, m = update(replace(cfg, rollout_correction=mode, rollout_is_min=C_MIN), batch)
    assert torch.equal(plain, corrected)
    assert m["actor/pg_loss"] == m_plain["actor/pg_loss"]
    assert m["rollout_corr/rollout_is_min"] == m["rollout_corr/rollout_is_max"] == 1.0
    assert m["rollout_corr/k3_kl"] == 0.0 and m["rollout_corr/chi2_token"] == 0.0


@pytest.mark.needs("policy_loss", "token_count")
@STEPS
def test_the_weight_is_the_trainers_pi_old_over_the_samplers(table_policy, mini_batch_prompts):
    batch = rollout_batch()
    with torch.no_grad():
        pi_old, _ = table_logprobs(TablePolicy(50), batch, 1.0)  # the policy before the update
    cfg = Config(group_size=4, mini_batch_prompts=mini_batch_prompts, micro_batch_tokens=0,
                 grad_clip=1e9, rollout_correction="token_truncate", rollout_is_max=1e9)
    update(cfg, batch)
    rows = mini_batch_prompts * 4  # one micro-batch per optimizer step, its rows in order
    assert len(table_policy) == len(batch) // rows
    for step, (_, weight, _) in enumerate(table_policy):
        part = batch.rows(slice(step * rows, (step + 1) * rows))
        mask = part.response_mask
        want = (pi_old[step * rows:(step + 1) * rows, :mask.shape[1]] - part.rollout_logp).exp()
        assert torch.allclose(weight[mask], want[mask], rtol=1e-12)


@pytest.mark.needs("policy_loss", "token_count")
@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_masked_tokens_keep_their_place_in_the_token_count(table_policy, mode):
    # as TRL (its normaliser counts every completion token) and verl's masked IS (it leaves
    # response_mask as it is): weight 0, the denominator Eq. 12's
    batch = rollout_batch()
    cfg = Config(group_size=4, mini_batch_prompts=2, micro_batch_size=3, micro_batch_tokens=0)
    update(cfg, batch)
    plain = [denom for _, _, denom in table_policy]
    table_policy.clear()
    update(replace(cfg, rollout_correction=mode, rollout_is_min=C_MIN), batch)
    assert [denom for _, _, denom in table_policy] == plain == [batch.response_mask.sum()] * 3
    weights = torch.cat([w[w != 1.0].flatten() for _, w, _ in table_policy])
    assert (weights == 0).any()  # the case is not trivial: some tokens were masked


def objective(logits, batch, weight):
    """The token-level mean of -A r w over the response tokens (Eq. 12 with the correction's
    weight), at r = 1 (pi_old = pi_theta) where no clip binds, in float64: an independent
    statement of the loss for autograd."""
    logp = (logits / 1.0).log_softmax(-1)[batch.response_ids]  # (N, R)
    ratio = (logp - logp.detach()).exp()
    mask = batch.response_mask
    return (-batch.adv[:, None] * ratio * weight * mask).sum() / mask.sum()


def hand_weights(mode, logp, batch):
    """The weights from the definitions (TRL's vllm_importance_sampling_mode), for autograd."""
    log_rho = (logp - batch.rollout_logp) * batch.response_mask
    if mode.startswith("sequence"):
        log_rho = log_rho.sum(-1, keepdim=True)
    rho = log_rho.exp()
    if mode.endswith("truncate"):
        return rho.clamp(C_MIN, C_MAX)
    return torch.where((rho >= C_MIN) & (rho <= C_MAX), rho, torch.zeros_like(rho))


@pytest.mark.parity
@pytest.mark.needs("policy_loss", "token_count")
@pytest.mark.parametrize("mode", MODES)
def test_the_corrected_step_is_float64_autograds_gradient(table_policy, mode):
    batch = rollout_batch()
    cfg = Config(group_size=4, mini_batch_prompts=2, micro_batch_size=3, micro_batch_tokens=0,
                 grad_clip=1e9, rollout_correction=mode, rollout_is_min=C_MIN,
                 rollout_is_max=C_MAX)
    after, _ = update(cfg, batch)  # SGD, lr 1: the step is minus the gradient
    logits = TablePolicy(50).logits.detach().clone().requires_grad_()
    with torch.no_grad():
        logp = logits.log_softmax(-1)[batch.response_ids]
    weight = 1.0 if mode == "none" else hand_weights(mode, logp, batch)
    objective(logits, batch, weight).backward()
    step = after - TablePolicy(50).logits.detach()
    assert step.abs().max() > 1e-3  # the step did something
    assert torch.allclose(step, -logits.grad, rtol=1e-12, atol=1e-15)


# --- alarm, and a real mismatch: a bf16 sampler beside an fp32 trainer ---

def test_the_parity_warning_names_the_correction():
    causes = health.wrong_signal_causes({"training/rollout_logp_diff_mean": 0.2})
    assert len(causes) == 1 and "--rollout-correction" in causes[0]


@pytest.mark.needs("all")
def test_a_bf16_sampler_beside_an_fp32_trainer_is_measured_and_corrected(tiny_model_dir, tmp_path,
                                                                         monkeypatch):
    in_autocast = {"sampler": [], "trainer": []}

    def spy(phase, original):
        def call(*args, **kwargs):
            in_autocast[phase].append(torch.is_autocast_enabled("cpu"))
            return original(*args, **kwargs)
        return call

    monkeypatch.setattr(sampler, "generate", spy("sampler", sampler.generate))
    monkeypatch.setattr(dapo, "response_logprobs", spy("trainer", dapo.response_logprobs))
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=1, eval_every=0, dynamic_sampling=False,
                   rollout_precision="bf16", rollout_correction="token_truncate"))
    assert in_autocast["sampler"] and in_autocast["trainer"], in_autocast  # both phases ran
    assert all(in_autocast["sampler"]) and not any(in_autocast["trainer"]), in_autocast
    m = json.loads(open(tmp_path / "metrics.jsonl").readlines()[1])  # after the settings row
    # bf16 rounds the logits to ~3 significant digits: far above fp32's ~1e-7 per token
    assert m["training/rollout_logp_diff_mean"] > 1e-4
    assert m["rollout_corr/k3_kl"] > 0 and m["rollout_corr/rollout_is_max"] <= 2.0
    assert m["rollout_corr/rollout_is_min"] != 1.0  # the weights are not all 1
    assert len([k for k in m if k.startswith("rollout_corr/")]) == 13
    assert not [k for k in m if k not in documented_metrics() | {"step"}]  # docs/metrics.md
