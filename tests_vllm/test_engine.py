"""infra/vllm_engine.py against sampler.py and the trainer's forward, in one process: one engine
(~40 s to start on CPU) for the module, re-synced to the policy by each test."""
import copy

import pytest
import torch

from config import Config
from conftest import MEMORY
from data import load_tokenizer
from infra.vllm_engine import VLLMEngine
from model import Transformer
from logprobs import response_logprobs
from sampler import Rollout, generate

EPS = torch.finfo(torch.float32).eps
MAX_NEW = 12
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 200, 13, 77, 150, 9], [250, 3]]


def bound(logp):
    """How far two fp32 computations of a log-prob may be apart: vLLM's kernels and the trainer's
    forward (or the sampler's cached decode) round differently, ~eps per operation, and the
    log-softmax's sum carries |logp|'s own rounding: 16 eps (1 + |logp|), the bound
    tests/test_parity.py holds the sampler to against the trainer. Measured here: 4.8e-7, 4 eps;
    an engine one optimizer step behind is off by more than 0.1."""
    return 16 * EPS * (1 + logp.abs())


@pytest.fixture(scope="module")
def setup(tiny_dir):
    model = Transformer.from_pretrained(tiny_dir, dtype=torch.float32)
    tok = load_tokenizer(tiny_dir)
    cfg = Config(rollout_engine="vllm", vllm_gpu_memory_utilization=MEMORY, max_prompt_len=16,
                 max_response_len=MAX_NEW, seed=0)
    engine = VLLMEngine(cfg, model)
    yield model, tok, engine
    engine.close()


def sample(engine, model, tok, temperature, seed=0) -> Rollout:
    """The engine's responses to PROMPTS, as sampler.generate returns them."""
    got = engine.generate(model, PROMPTS, MAX_NEW, temperature=temperature, top_p=1.0, top_k=0,
                          eos_token_ids=tok.eos_token_ids,
                          generator=torch.Generator().manual_seed(seed))
    return Rollout.from_responses(PROMPTS, got.token_ids, got.logprobs, got.truncated,
                                  tok.pad_token_id, "cpu")


@pytest.mark.parity
def test_greedy_rollouts_are_the_samplers_tokens(setup):
    model, tok, engine = setup
    engine.sync(model)
    ours = generate(model, PROMPTS, MAX_NEW, temperature=0, eos_token_ids=tok.eos_token_ids,
                    pad_token_id=tok.pad_token_id)
    theirs = sample(engine, model, tok, temperature=0)
    assert torch.equal(theirs.response_ids, ours.response_ids)
    assert torch.equal(theirs.lengths, ours.lengths)
    assert torch.equal(theirs.truncated, ours.truncated)
    mask = ours.response_mask
    gap = (theirs.logprobs - ours.logprobs).abs()[mask]
    assert (gap <= bound(ours.logprobs[mask])).all(), gap.max()


def test_an_eos_ends_the_response_and_is_its_last_token(setup):
    model, tok, engine = setup
    engine.sync(model)
    first = generate(model, PROMPTS[:1], 1, temperature=0, eos_token_ids=[]).response_ids[0, 0]
    got = engine.generate(model, PROMPTS[:1], MAX_NEW, temperature=0, top_p=1.0, top_k=0,
                          eos_token_ids=[int(first)], generator=torch.Generator())
    assert got.token_ids == [[int(first)]] and got.truncated == [False]


@pytest.mark.parity
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_tokens_logprobs_are_the_trainers(setup, temperature):
    # vLLM's processed_logprobs: log_softmax(logits / T) of the drawn token, what the sampler
    # records and what the trainer computes at the same temperature
    model, tok, engine = setup
    engine.sync(model)
    out = sample(engine, model, tok, temperature)
    with torch.no_grad():
        train, _ = response_logprobs(model, out, temperature)  # (N, R)
    mask = out.response_mask
    gap = (out.logprobs - train).abs()[mask]
    assert mask.sum() > 20 and (gap <= bound(train[mask])).all(), \
        gap.max()


@pytest.mark.parity
def test_after_an_optimizer_step_the_engine_samples_the_new_policy(setup):
    model, tok, engine = setup
    model = copy.deepcopy(model)  # the module's model stays as loaded
    engine.sync(model)
    before = sample(engine, model, tok, temperature=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    logp, _ = response_logprobs(model, before, 1.0)
    (-logp[before.response_mask].sum()).backward()  # make the sampled tokens likelier
    opt.step()
    with pytest.raises(RuntimeError, match="not the policy's"):  # the version check
        sample(engine, model, tok, temperature=1.0)
    engine.sync(model)
    after = sample(engine, model, tok, temperature=1.0)
    with torch.no_grad():
        train, _ = response_logprobs(model, after, 1.0)
        moved, _ = response_logprobs(model, before, 1.0)
    mask = after.response_mask
    gap = (after.logprobs - train).abs()[mask]
    assert (gap <= bound(train[mask])).all(), gap.max()
    # the step moved the policy far beyond that bound: a stale engine would fail above
    assert (moved - before.logprobs)[before.response_mask].abs().max() > 0.1


def test_a_dead_engine_is_a_clear_error(setup):
    # last: it kills the module's engine (on CPU a second one would not fit the share of RAM
    # that vLLM reserves for the whole process, the first engine included)
    model, tok, engine = setup
    engine.sync(model)
    engine.llm.llm_engine.engine_core.shutdown()  # what a crashed engine leaves behind
    with pytest.raises(RuntimeError, match="the vLLM engine failed during a rollout"):
        sample(engine, model, tok, temperature=1.0)
