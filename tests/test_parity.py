"""The sampler's log-probs against the trainer's pi_old (training/rollout_*_diff_* in
metrics.jsonl): equal up to round-off when the two compute the same distribution, far apart when
one side tempers twice or renormalises after top-p, and the warning that says so."""
import json

import pytest
import torch

import dapo
import sampler
from batch import Batch
from infra import health
from infra.metrics import UpdateStats
from model import Transformer, preset
from logprobs import response_logprobs
from reward import Verdicts
from test_dapo import _cfg

TEMPERATURE, TOP_P = 0.5, 0.9


def test_parity_sums_what_it_says_on_constructed_log_probs():
    train = torch.tensor([[-1.0, -2.0, -3.0]])  # (1, 3); the last token is padding
    rollout = torch.tensor([[-1.5, -2.0, 9.0]])
    mask = torch.tensor([[True, True, False]])
    stats = UpdateStats()
    stats.add_parity(train, rollout, mask)
    p = stats.parity()
    assert p["training/rollout_logp_diff_mean"] == pytest.approx(0.25, rel=1e-12)
    assert p["training/rollout_logp_diff_max"] == pytest.approx(0.5, rel=1e-12)
    ratio = abs(torch.tensor(0.5, dtype=torch.float64).exp().item() - 1)
    assert p["training/rollout_ratio_diff_max"] == pytest.approx(ratio, rel=1e-12)
    probs = abs(torch.tensor([-1.0, -1.5], dtype=torch.float64).exp().diff().item())
    assert p["training/rollout_probs_diff_mean"] == pytest.approx(probs / 2, rel=1e-12)
    stats.add_parity(torch.tensor([[float("nan")]]), torch.tensor([[-1.0]]), mask[:, :1])
    assert torch.tensor(stats.parity()["training/rollout_logp_diff_max"]).isnan()
    assert UpdateStats().parity() == {}  # a batch without the sampler's log-probs logs none


@pytest.mark.parity
@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache", "logprobs_forward")
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (TEMPERATURE, 5, TOP_P)])
def test_sampler_and_trainer_log_probs_agree_in_float64(temperature, top_k, top_p):
    # The sampler's decode (one token at a time from its KV cache) and the trainer's forward (the
    # whole sequence at once) sum in other orders; in float64 that is ~1e-15. But the sampler
    # takes its log-softmax of the logits cast to fp32, so its log-probs carry fp32 round-off: a
    # few epsilon of the logits' and the log-partition's size. 16 eps (1 + |logp|) bounds that on
    # any order of the 64 terms' sum (measured: 1.9 eps |logp| at most); an error of the
    # algorithm (a position off by one, a temperature on one side) is 1e-3 or more.
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=64)).double().eval()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    out = sampler.generate(model, prompts, 12, temperature=temperature, top_k=top_k,
                           top_p=top_p, eos_token_ids=[],
                           generator=torch.Generator().manual_seed(0))
    n = len(prompts)
    batch = Batch.from_rollout(out, Verdicts([-1.0] * n, [False] * n, [False] * n, None), 1)
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch, temperature, fused_head=False)
    train, rollout = logp.double()[batch.response_mask], batch.rollout_logp.double()[
        batch.response_mask]
    bound = 16 * torch.finfo(torch.float32).eps * (1 + train.abs())
    assert len(train) == 48 and ((train - rollout).abs() <= bound).all(), \
        (train - rollout).abs().max()


def _one_step(tiny_model_dir, tmp_path, **kw) -> dict:
    """One rollout step on the random tiny model (all groups wrong: no dynamic sampling), its
    metrics row."""
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=1, eval_every=0, dynamic_sampling=False,
                   temperature=TEMPERATURE, top_p=TOP_P, **kw))
    return json.loads(open(tmp_path / "metrics.jsonl").readlines()[1])  # after the settings


# one mini-batch (pi_old is the update's own first forward) and two (with_old_logprobs())
MINI_BATCHES = pytest.mark.parametrize("mini_batch_prompts", [4, 2])


@pytest.mark.needs("all")
@MINI_BATCHES
def test_a_real_step_logs_parity_at_fp32_round_off(tiny_model_dir, tmp_path, capsys,
                                                   mini_batch_prompts):
    # fp32: the sampler's cached decode and the trainer's forward round differently, ~1e-7 per
    # operation (fp32 epsilon 1.2e-7) growing through the layers and the log-softmax's sum; 1e-4
    # is ~800 epsilon, and a planted mismatch (below) is over 100 times larger
    m = _one_step(tiny_model_dir, tmp_path, mini_batch_prompts=mini_batch_prompts)
    with capsys.disabled():  # the figure, for -s
        print({k: f"{v:.2e}" for k, v in m.items() if k.startswith("training/rollout_")})
    assert m["training/rollout_logp_diff_max"] < 1e-4
    assert m["training/rollout_ratio_diff_max"] < 1e-4
    assert "the sampler's log-probs" not in capsys.readouterr().out


def _temper_twice(logits, temperature, top_k, top_p, generator=None):
    token, _ = REAL_SAMPLE(logits, temperature, top_k, top_p, generator)
    twice = logits / temperature / temperature
    return token, twice.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)


def _renormalised_after_top_p(logits, temperature, top_k, top_p, generator=None):
    token, _ = REAL_SAMPLE(logits, temperature, top_k, top_p, generator)
    kept = sampler.filter_logits(logits / temperature, top_k, top_p)
    return token, kept.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)


REAL_SAMPLE = sampler.sample


@pytest.mark.needs("all")
@MINI_BATCHES
@pytest.mark.parametrize("planted", [_temper_twice, _renormalised_after_top_p])
def test_a_planted_mismatch_shows_in_parity_and_warns(tiny_model_dir, tmp_path, capsys,
                                                      monkeypatch, planted, mini_batch_prompts):
    monkeypatch.setattr(sampler, "sample", planted)
    m = _one_step(tiny_model_dir, tmp_path, mini_batch_prompts=mini_batch_prompts)
    with capsys.disabled():
        print(planted.__name__,
              {k: f"{v:.2e}" for k, v in m.items() if k.startswith("training/rollout_")})
    assert m["training/rollout_logp_diff_mean"] > health.PARITY_ALARM
    out = capsys.readouterr().out
    assert "warning: step 1: training/rollout_logp_diff_mean" in out
    assert "a temperature or top-p applied on one side only" in out
