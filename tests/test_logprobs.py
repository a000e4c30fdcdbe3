"""logprobs.py: the policy's log-probs and entropies of sampled responses, which the RL loss
reads, against each sequence through the model alone (float64), and with each distinct prompt
through the model once against the plain forward."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import logprobs as logprobs_module
from batches import random_batch
from infra.precision import BF16_UNIT_ROUNDOFF as u
from logprobs import response_logprobs
from model import Transformer, preset
from tiny_models import flat_grads, tiny_float64_model


def batch_of_groups(vocab: int, seed: int = 0):
    """Two prompts of 5 and 3 tokens, 3 responses each (as a group's G), and a prompt of its own,
    laid out as batch.Batch lays a rollout out: prompts left-padded, responses of 1-6 tokens
    right-padded."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in (5, 3, 4)]
    which = [0, 1, 0, 2, 1, 0, 1]
    lengths = torch.tensor([6, 2, 4, 5, 1, 3, 6])
    B, P, R = len(which), 5, int(lengths.max())
    prompt_ids = torch.zeros(B, P, dtype=torch.long)
    for row, i in enumerate(which):
        prompt_ids[row, P - len(prompts[i]):] = prompts[i]
    prompt_mask = torch.arange(P) >= P - torch.tensor([len(prompts[i]) for i in which])[:, None]
    return SimpleNamespace(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                           response_ids=torch.randint(1, vocab, (B, R), generator=g),
                           response_mask=torch.arange(R) < lengths[:, None])


@pytest.mark.parity
@pytest.mark.needs("logprobs_forward", "rope", "attention", "kv_cache")
@pytest.mark.parametrize("fused_head", [True, False])
def test_rows_sharing_a_prompt_get_the_plain_forwards_log_probs_and_gradients(monkeypatch,
                                                                             fused_head):
    """PROMPT_FORWARD_ONCE: each distinct prompt through the model once, its keys read by the rows
    that repeat it, against every row from column 0 (the switch off): the same log-probs,
    entropies and gradients of every weight, in float64 up to round-off."""
    torch.manual_seed(0)
    m = Transformer(preset("tiny", vocab_size=97)).double()
    batch = batch_of_groups(97)
    weights = torch.linspace(-1, 1, batch.response_ids.shape[1], dtype=torch.float64)
    got = []
    for share in (True, False):
        monkeypatch.setattr(logprobs_module, "PROMPT_FORWARD_ONCE", share)
        m.zero_grad(set_to_none=True)
        logp, entropy = response_logprobs(m, batch, 0.7, fused_head)
        ((logp + entropy) * weights * batch.response_mask).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in m.parameters()])
        got.append((logp[batch.response_mask], entropy[batch.response_mask], grad))
    for shared, plain in zip(*got):
        assert (shared - plain).abs().max() <= 64 * torch.finfo(torch.float64).eps * (
            plain.abs().max())
        assert plain.abs().max() > 0


@pytest.mark.needs("logprobs_forward", "rope", "attention", "kv_cache")
@pytest.mark.parametrize("setting", ["on", "off", "activation checkpointing"])
def test_each_distinct_prompt_goes_through_the_model_once(monkeypatch, setting):
    """The forwards' inputs: the 3 distinct prompts (the longest 5 tokens) then the 7 responses
    alone, or, switched off or with activation checkpointing (which recomputes a block from its
    input alone), every row from column 0."""
    monkeypatch.setattr(logprobs_module, "PROMPT_FORWARD_ONCE", setting != "off")
    m = Transformer(preset("tiny", vocab_size=97))
    m.activation_checkpointing = setting == "activation checkpointing"
    shapes = []
    m.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    batch = batch_of_groups(97)
    response_logprobs(m, batch, 1.0)
    longest = int((batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).max())
    assert shapes == ([(3, 5), (7, 6)] if setting == "on" else [(7, longest)])


@pytest.mark.needs("logprobs_forward", "rope", "attention", "kv_cache")
def test_rows_sharing_a_prompt_under_bf16_autocast_get_the_plain_forwards_log_probs(monkeypatch):
    """The same under bf16 autocast (--precision bf16 on a CPU), where the shared prompt's keys
    sit in a bf16 cache and the plain forward's are cast to bf16 by autocast: log-probs within 2
    bf16 unit round-offs (the tiny model's logits are below 1, so a rounding moves one by less
    than u)."""
    torch.manual_seed(0)
    m = Transformer(preset("tiny", vocab_size=97))
    batch = batch_of_groups(97)
    logps = []
    for share in (True, False):
        monkeypatch.setattr(logprobs_module, "PROMPT_FORWARD_ONCE", share)
        with torch.autocast("cpu", torch.bfloat16):
            logps.append(response_logprobs(m, batch, 1.0)[0][batch.response_mask])
    assert (logps[0] - logps[1]).abs().max() <= 2 * u


@pytest.mark.parity
@pytest.mark.needs("logprobs_forward", "rope", "attention")
@pytest.mark.parametrize("fused_head", [True, False])
def test_response_logprobs_and_gradients_equal_each_sequence_alone(fused_head, monkeypatch):
    """The batch's rows, laid out from column 0 (prompt, response, then padding), against each
    sequence alone, in float64 (the same sums in another order): log-probs, entropies and every
    gradient. And attention takes no explicit mask (causal only: what a flash kernel accepts)."""
    model = tiny_float64_model()
    batch = random_batch(50, n=5, dtype=torch.float64)
    assert len(set(batch.prompt_mask.sum(-1).tolist())) > 1  # prompts of several lengths
    masks, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    g = torch.Generator().manual_seed(1)
    w_logp, w_entropy = (torch.randn(batch.response_ids.shape, generator=g, dtype=torch.float64)
                         * batch.response_mask for _ in range(2))  # (B, R): loss weights
    logp, entropy = response_logprobs(model, batch, 0.7, fused_head)
    assert masks and all(mask is None and causal for mask, causal in masks)
    if fused_head:
        assert (logp[~batch.response_mask] == 0).all()  # the fused head skips the padding
    ((logp * w_logp).sum() + (entropy * w_entropy).sum()).backward()
    grads = flat_grads(model)
    model.zero_grad(set_to_none=True)
    loss = 0
    for i in range(len(batch)):
        p = batch.prompt_ids[i][batch.prompt_mask[i]].tolist()
        r = batch.response_ids[i][batch.response_mask[i]].tolist()
        logits = model(torch.tensor([p + r]))[0, len(p) - 1:-1] / 0.7  # (len(r), V)
        ref = logits.log_softmax(-1)[torch.arange(len(r)), r]
        ref_entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        assert (logp[i, :len(r)] - ref).abs().max() < 1e-12
        assert (entropy[i, :len(r)] - ref_entropy).abs().max() < 1e-12
        loss = loss + (ref * w_logp[i, :len(r)]).sum() + (ref_entropy * w_entropy[i, :len(r)]).sum()
    loss.backward()
    ref_grads = flat_grads(model)
    assert (grads - ref_grads).abs().max() < 1e-12 * ref_grads.abs().max()
