"""sampler.py on a tiny random Qwen2: cached decoding against full forwards and transformers,
log-probs, EOS, truncation, continuous batching over fewer slots than sequences, distributed
lockstep."""
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sampler
from model import KVCache, Transformer, preset
from rendezvous import file_init
from sampler import SPEED_UPS, filter_logits, generate, sample

# fp32: cached decoding and a full forward add the same numbers in a slightly different order
TOL = 1e-5
VOCAB = 97
# ragged: 3, 9, 1, 5 tokens
PROMPTS = [[5, 17, 3], [8, 2, 44, 61, 9, 23, 30, 71, 1], [60], [12, 12, 40, 88, 7]]


def tiny_model(vocab=VOCAB, seed=0, head_scale=20.0):
    """head_scale > 1 sharpens the next-token distributions (greedy argmaxes far from ties); 1 keeps
    them flat."""
    torch.manual_seed(seed)
    model = Transformer(preset("tiny", vocab_size=vocab, tie_word_embeddings=False))
    # random biases and norm weights, so that a mis-placed pad or position changes the output
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        model.lm_head.weight.mul_(head_scale)
    return model.eval()


def count_forwards(model):
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(1))
    return calls


def full_forward(model, input_ids, attention_mask):
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids, positions=positions, attention_mask=attention_mask)  # (B, S, V)


# --------------------------------------------------------------------------------------------------
# filter_logits on known logits

def kept(logits):
    return (logits > float("-inf")).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 3.0, -2.0, 2.5, 0.0])
    assert kept(filter_logits(logits, top_k=1)) == [1]
    assert kept(filter_logits(logits, top_k=3)) == [0, 1, 3]
    # survivors are untouched
    assert torch.equal(filter_logits(logits, top_k=3)[[0, 1, 3]], logits[[0, 1, 3]])


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([5.0, 4.0, 1.0, 4.0, 4.0])
    assert kept(filter_logits(logits, top_k=2)) == [0, 1, 3, 4]


def test_top_p_keeps_the_smallest_nucleus_holding_top_p():
    # token 1 holds 0.5, tokens 2 and 3 are tied at 0.2
    logits = torch.tensor([0.1, 0.5, 0.2, 0.2]).log()
    assert kept(filter_logits(logits, top_p=0.45)) == [1]
    # 0.5 < 0.55: one 0.2 is needed, so its twin too
    assert kept(filter_logits(logits, top_p=0.55)) == [1, 2, 3]
    # 0.9 >= 0.85: the 0.1 token is not needed
    assert kept(filter_logits(logits, top_p=0.85)) == [1, 2, 3]
    assert kept(filter_logits(logits, top_p=0.95)) == [0, 1, 2, 3]


def test_top_p_nucleus_stops_as_soon_as_it_holds_top_p():
    # powers of two: the float softmax and cumsum are exact
    logits = torch.tensor([0.25, 0.5, 0.125, 0.125]).log()
    # 0.5 already holds 0.5: nothing more is needed
    assert kept(filter_logits(logits, top_p=0.5)) == [1]
    assert kept(filter_logits(logits, top_p=0.75)) == [0, 1]


def test_top_p_always_keeps_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 2.0, -1.0]])
    out = filter_logits(logits, top_p=1e-9)
    assert kept(out[0]) == [1]
    assert kept(out[1]) == [0, 1]  # a tie for the maximum keeps both


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert kept(filter_logits(logits, top_p=0.5)) == [0, 1]  # 0.4 < 0.5 over the whole vocabulary
    assert kept(filter_logits(logits, top_k=2, top_p=0.5)) == [0]  # 4/7 >= 0.5 after top-k


def test_top_k_0_and_top_p_1_are_no_ops():
    logits = torch.randn(3, 50) * 10
    logits[0, :5] = -30.0  # tiny probabilities that a float cumsum would round away at top_p = 1.0
    assert torch.equal(filter_logits(logits, top_k=0, top_p=1.0), logits)
    assert torch.equal(filter_logits(logits, top_k=50), logits)


def test_rows_are_filtered_independently():
    logits = torch.randn(4, 30)
    out = filter_logits(logits, top_k=7, top_p=0.6)
    for i in range(4):
        assert torch.equal(out[i], filter_logits(logits[i], top_k=7, top_p=0.6))


# --------------------------------------------------------------------------------------------------
# sample on known logits

@pytest.fixture
def top_k_only(monkeypatch):
    """sample() truncates through filter_logits(), an exercise of its own: a plain top-k stands in
    for it here, so that these tests grade sample() alone (they use no top-p)."""
    def top_k(logits, top_k=0, top_p=1.0):
        if not top_k:
            return logits
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, float("-inf"))
    monkeypatch.setattr(sampler, "filter_logits", top_k)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.6, 0), (1.0, 2)])
def test_sample_draws_in_proportion_to_the_tempered_softmax(top_k_only, temperature, top_k):
    logits = torch.tensor([1.0, 0.0, -1.0, 1.5]).expand(4000, 4)
    token, _ = sample(logits, temperature, top_k, 1.0, torch.Generator().manual_seed(0))
    kept = torch.tensor([1.0, 0.0, -1.0, 1.5])
    if top_k:
        kept[[1, 2]] = -math.inf
    p = (kept / temperature).softmax(-1)
    freq = torch.bincount(token, minlength=4) / 4000
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / 4000).sqrt()).all(), (freq, p)  # 4 std devs


def test_sample_logprob_is_the_policys_before_truncation(top_k_only):
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1)) * 3
    token, logp = sample(logits, 0.7, 1, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(token, logits.argmax(-1))  # top-1 leaves the argmax alone...
    expected = (logits / 0.7).log_softmax(-1).gather(-1, token[:, None])[:, 0]
    # ...whose log-prob is the policy's, not 0
    assert logp.dtype == torch.float32 and (logp - expected).abs().max() < 1e-6
    assert (logp < -1e-3).all()


def test_greedy_sample_takes_the_argmax(top_k_only):
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(2)) * 3
    token, logp = sample(logits, 0.0, 0, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(token, logits.argmax(-1))
    assert (logp - logits.log_softmax(-1).gather(-1, token[:, None])[:, 0]).abs().max() < 1e-6


def test_sample_is_reproducible_with_a_generator(top_k_only):
    logits = torch.zeros(200, 10)

    def draw(seed):
        return sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(seed))[0]
    assert torch.equal(draw(1), draw(1)) and not torch.equal(draw(1), draw(2))


def test_sampling_never_draws_a_token_of_zero_probability(top_k_only):
    logits = torch.full((2000, 6), float("-inf"))
    # every row: all the mass on token 2, the tokens before and after it impossible
    logits[:, 2] = 0.0
    logits[1::2, 4] = 0.0  # odd rows: tokens 2 and 4, half each
    token, _ = sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(0))
    assert (token[0::2] == 2).all()
    assert set(token[1::2].tolist()) == {2, 4}


def test_draw_follows_the_distribution_across_blocks_of_the_vocabulary():
    """1536 tokens: three blocks of 512 for draw()'s first level. Mass on the first and last token
    of a block, in the middle of another and spread thin over a third: each drawn in proportion
    (4 binomial standard deviations), and nothing else."""
    probs = torch.zeros(1536)
    probs[[0, 511, 700, 1535]] = torch.tensor([0.1, 0.2, 0.3, 0.2])
    probs[1024:1535] = 0.2 / 511  # the last block's other tokens, together 0.2
    n = 20000
    token = sampler.draw(probs.expand(n, 1536), torch.Generator().manual_seed(0))
    freq = torch.bincount(token, minlength=1536) / n
    for group in ([0], [511], [700], [1535], list(range(1024, 1535))):
        p, f = probs[group].sum(), freq[group].sum()
        assert (f - p).abs() <= 4 * (p * (1 - p) / n).sqrt(), (group[0], f, p)
    assert freq[probs == 0].sum() == 0


def test_copy_rows_reads_every_row_before_writing_and_stops_at_n():
    k = torch.randn(3, 2, 6, 4)
    cache = KVCache([k.clone()], [-k])
    sampler.copy_rows(cache, [1, 0, 0], [0, 1, 2], 4)  # rows 0 and 1 swap, row 2 takes row 0's
    expected = k.clone()
    expected[:, :, :4] = k[[1, 0, 0], :, :4]
    assert torch.equal(cache.k[0], expected) and torch.equal(cache.v[0], -expected)


# --------------------------------------------------------------------------------------------------
# generate: one batch of slots

def full_sequences(r):
    """prompt + response of each row, left-padded as one batch -> input_ids, attention_mask
    (N, P + T)."""
    return (torch.cat([r.prompt_ids, r.response_ids], 1),
            torch.cat([r.prompt_mask, r.response_mask], 1))


@pytest.mark.needs("sample", "rope", "attention", "kv_cache")
def test_greedy_cached_decoding_matches_a_full_forward_at_every_step():
    model = tiny_model()
    r = generate(model, PROMPTS, max_new_tokens=12, temperature=0, eos_token_ids=[])
    # the reference: the whole left-padded batch re-run from scratch, without a cache, for every
    # new token
    ids, mask = r.prompt_ids, r.prompt_mask
    for t in range(12):
        next_token = full_forward(model, ids, mask)[:, -1].argmax(-1)  # (B,)
        ids = torch.cat([ids, next_token[:, None]], 1)
        mask = torch.cat([mask, torch.ones(len(PROMPTS), 1, dtype=torch.bool)], 1)
    assert torch.equal(r.response_ids, ids[:, -12:])
    # the prompts really lead to different continuations
    assert len(set(r.response_ids[:, 0].tolist())) > 1


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
@pytest.mark.parametrize("speed_ups", ["on", "off"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_those_of_a_full_forward_at_the_temperature_before_truncation(
        monkeypatch, temperature, speed_ups):
    for name in SPEED_UPS if speed_ups == "off" else []:
        monkeypatch.setattr(sampler, name, False)
    model = tiny_model(head_scale=4.0)  # broad enough that EOS ids come up
    r = generate(model, PROMPTS * 3, max_new_tokens=16, temperature=temperature, top_k=20,
                 top_p=0.9, eos_token_ids=[3, 9, 11], generator=torch.Generator().manual_seed(0),
                 slots=5)
    input_ids, attention_mask = full_sequences(r)
    P, T = r.prompt_ids.shape[1], r.response_ids.shape[1]
    # the columns predicting responses
    logits = full_forward(model, input_ids, attention_mask)[:, P - 1:P - 1 + T]
    logp_all = torch.log_softmax(logits / temperature, -1)
    ref = logp_all.gather(-1, r.response_ids[..., None]).squeeze(-1)  # (N, T)
    m = r.response_mask
    # rows ended at different steps, so slots were refilled mid-way
    assert r.lengths.min() < r.lengths.max()
    assert (r.logprobs[m] - ref[m]).abs().max() < TOL
    assert (r.logprobs[~m] == 0).all()


@pytest.mark.needs("sample", "rope", "attention", "kv_cache")
def test_greedy_logprobs_are_log_softmax_of_the_raw_logits():
    model = tiny_model()
    r = generate(model, PROMPTS, max_new_tokens=6, temperature=0, eos_token_ids=[])
    input_ids, attention_mask = full_sequences(r)
    P = r.prompt_ids.shape[1]
    logits = full_forward(model, input_ids, attention_mask)[:, P - 1:P - 1 + 6]
    ref = torch.log_softmax(logits, -1).gather(-1, r.response_ids[..., None]).squeeze(-1)
    assert (r.logprobs - ref).abs().max() < TOL


# 5: the pad id is itself an EOS id, as <|endoftext|> is for Qwen
@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
@pytest.mark.parametrize("pad", [0, 5])
def test_eos_ends_a_response_and_sets_mask_lengths_and_truncated(pad):
    model = tiny_model(vocab=32, head_scale=1.0)  # near-uniform: each EOS id about 1/32 per token
    eos_ids, max_new = [5, 9], 24
    r = generate(model, [[1, 2, 3]] * 12 + [[4] * 7] * 12, max_new_tokens=max_new,
                 eos_token_ids=eos_ids, pad_token_id=pad,
                 generator=torch.Generator().manual_seed(0), slots=7)
    B, T = r.response_ids.shape
    assert T == r.lengths.max() <= max_new
    # this seed exercises both ends of a response
    assert r.truncated.any() and not r.truncated.all()
    is_eos = torch.isin(r.response_ids, torch.tensor(eos_ids))
    for i in range(B):
        n = r.lengths[i].item()
        assert torch.equal(r.response_mask[i], torch.arange(T) < n)
        assert not is_eos[i, :n - 1].any()  # nothing before the end is an EOS
        # the last token is an EOS iff not truncated
        assert bool(is_eos[i, n - 1]) != bool(r.truncated[i])
        assert not r.truncated[i] or n == max_new
        assert (r.response_ids[i, n:] == pad).all() and (r.logprobs[i, n:] == 0).all()
        assert (r.logprobs[i, :n] < 0).all()
    last = {r.response_ids[i, r.lengths[i] - 1].item() for i in range(B) if not r.truncated[i]}
    assert last == set(eos_ids)


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
def test_max_new_tokens_is_respected():
    model = tiny_model()
    calls = count_forwards(model)
    r = generate(model, PROMPTS, max_new_tokens=7, eos_token_ids=[],
                 generator=torch.Generator().manual_seed(0))
    assert r.response_ids.shape == (len(PROMPTS), 7)
    assert (r.lengths == 7).all() and r.truncated.all() and r.response_mask.all()
    # one prefill and 6 decode steps: the last token needs no forward after it
    assert len(calls) == 7


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
def test_loop_stops_once_every_row_has_finished():
    model = tiny_model(vocab=32, head_scale=1.0)
    calls = count_forwards(model)
    r = generate(model, [[1, 2]] * 8, max_new_tokens=300, eos_token_ids=[5, 9],
                 generator=torch.Generator().manual_seed(0))
    assert not r.truncated.any()
    # the step that produced the last EOS was the last forward
    assert len(calls) == r.lengths.max() < 300


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
def test_same_seed_same_samples_and_different_seeds_differ():
    model = tiny_model()

    def run(seed):
        return generate(model, PROMPTS, max_new_tokens=12, top_p=0.95, eos_token_ids=[],
                        generator=torch.Generator().manual_seed(seed))
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
def test_sampling_follows_the_truncated_distribution():
    model = tiny_model()
    r = generate(model, [[7, 8]] * 400, max_new_tokens=1, temperature=1.0, top_k=2,
                 eos_token_ids=[], generator=torch.Generator().manual_seed(0))
    logits = full_forward(model, torch.tensor([[7, 8]]), torch.ones(1, 2, dtype=torch.bool))[0, -1]
    p2, top2 = torch.topk(logits, 2).values.softmax(-1), torch.topk(logits, 2).indices
    assert set(r.response_ids[:, 0].tolist()) <= set(top2.tolist())
    freq = (r.response_ids[:, 0] == top2[0]).float().mean().item()
    # 4 binomial standard deviations
    assert abs(freq - p2[0].item()) < 4 * math.sqrt(p2[0] * p2[1] / 400)


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
def test_progress_bar_changes_nothing_and_training_mode_is_restored(capsys):
    model = tiny_model().train()
    kw = dict(max_new_tokens=5, eos_token_ids=[])
    quiet = generate(model, PROMPTS, generator=torch.Generator().manual_seed(3), **kw)
    loud = generate(model, PROMPTS, generator=torch.Generator().manual_seed(3), progress=True, **kw)
    assert torch.equal(quiet.response_ids, loud.response_ids)
    assert "generate" in capsys.readouterr().err
    assert model.training


@pytest.mark.needs("sample", "rope", "attention", "kv_cache")
@pytest.mark.parametrize("compact", [True, False])
def test_once_nothing_waits_a_decode_step_feeds_only_the_busy_slots(monkeypatch, compact):
    """COMPACT_SLOTS: the rows of a forward after the prefill are the sequences still going (a
    row moves into the slot of one that ended); off, every slot decodes to the end."""
    monkeypatch.setattr(sampler, "COMPACT_SLOTS", compact)
    model = tiny_model()
    rows = []  # per forward, its rows
    model.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    r = generate(model, PROMPTS, max_new_tokens=8, temperature=0, eos_token_ids=[UNEQUAL_EOS])
    lengths = r.lengths.tolist()
    assert len(set(lengths)) > 2  # greedy: rows end after 2, 4 and 8 tokens
    # the forward after token t feeds the sequences longer than t
    going = [sum(n > t for n in lengths) for t in range(1, max(lengths))]
    assert rows[1:] == (going if compact else [len(PROMPTS)] * len(going))


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        generate(tiny_model(), [[1, 2], []], max_new_tokens=3)


# --------------------------------------------------------------------------------------------------
# continuous batching: more sequences than slots

RAGGED = [[5, 17, 3], [8, 2, 44, 61, 9, 23, 30, 71, 1], [60], [12, 12, 40, 88, 7], [90, 4],
          [33] * 11, [1, 2, 3, 4]]


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    """The same random weights in transformers' Qwen2ForCausalLM and ours, with an EOS id that
    greedy decoding reaches early in some rows and never in others, and transformers' greedy
    generation of each prompt alone."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, rope_theta=1e6,
                                   tie_word_embeddings=False, max_position_embeddings=512)
    hf = transformers.Qwen2ForCausalLM(cfg).float().eval()
    # random biases and norms; a sharp head keeps greedy argmaxes far from float ties
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        hf.lm_head.weight.mul_(20.0)
    d = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(d)
    ours = Transformer.from_pretrained(str(d), dtype=torch.float32).eval()
    first = generate(ours, RAGGED[:1], max_new_tokens=3, temperature=0, eos_token_ids=[])
    eos = first.response_ids[0, 2].item()
    alone = []
    with torch.no_grad():
        for p in RAGGED:
            out = hf.generate(torch.tensor([p]),
                              attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
            alone.append(out[0, len(p):].tolist())
    return ours, eos, alone


@pytest.mark.needs("sample", "rope", "attention", "kv_cache")
@pytest.mark.parametrize("slots,compile",
                         [(1, False), (3, False), (None, False), (1, True), (3, True)])
def test_greedy_rows_equal_transformers_generate_on_each_prompt_alone(hf_and_ours, slots, compile):
    ours, eos, alone = hf_and_ours
    r = generate(ours, RAGGED, max_new_tokens=12, temperature=0, eos_token_ids=[eos], slots=slots,
                 compile=compile)
    # some rows end early, some never
    assert min(len(a) for a in alone) < 12 == max(len(a) for a in alone)
    for i, expected in enumerate(alone):
        assert r.response_ids[i, :r.lengths[i]].tolist() == expected
        assert bool(r.truncated[i]) == (expected[-1] != eos)


@pytest.mark.needs("sample", "rope", "attention", "kv_cache")
def test_greedy_rows_of_repeated_prompts_equal_transformers(hf_and_ours):
    # repeats side by side and apart: refills copy the keys of slots holding the same prompt
    ours, eos, alone = hf_and_ours
    which = [0, 0, 1, 3, 3, 3, 5, 0, 6, 6, 1]
    r = generate(ours, [RAGGED[i] for i in which], max_new_tokens=12, temperature=0,
                 eos_token_ids=[eos], slots=3)
    for row, i in enumerate(which):
        assert r.response_ids[row, :r.lengths[row]].tolist() == alone[i]


@pytest.mark.needs("sample", "rope", "attention", "kv_cache")
@pytest.mark.parametrize("off", [(), SPEED_UPS], ids=["all on", "all off"])
def test_greedy_rows_equal_transformers_with_speed_ups_switched_off(hf_and_ours, monkeypatch, off):
    """With the speed-ups on, or all off (plain batched decoding): the same greedy tokens. Repeated
    prompts in fewer slots than sequences, so that refills share prompts; and the switch switches:
    a prefill per sequence when off."""
    for name in off:
        monkeypatch.setattr(sampler, name, False)
    prefilled = []  # per prefill, its prompts
    prefill_slots = sampler.prefill_slots
    monkeypatch.setattr(sampler, "prefill_slots", lambda model, ps, slots, kv: (
        prefilled.append(len(ps)), prefill_slots(model, ps, slots, kv))[1])
    ours, eos, alone = hf_and_ours
    which = [0, 0, 1, 3, 3, 3, 5, 0, 6, 6, 1, 2, 4]
    r = generate(ours, [RAGGED[i] for i in which], max_new_tokens=12, temperature=0,
                 eos_token_ids=[eos], slots=4)
    for row, i in enumerate(which):
        assert r.response_ids[row, :r.lengths[row]].tolist() == alone[i]
    assert (sum(prefilled) == len(which)) == ("COPY_HELD_PROMPTS" in off)


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
def test_kv_cache_is_allocated_once_for_the_slots_whatever_the_number_of_sequences():
    model = tiny_model()
    shapes = []
    new_kv_cache = model.new_kv_cache
    model.new_kv_cache = lambda B, max_len: shapes.append((B, max_len)) or new_kv_cache(B, max_len)
    prompts = PROMPTS * 6  # 24 sequences, the longest prompt 9 tokens
    r = generate(model, prompts, max_new_tokens=5, eos_token_ids=[3], slots=4,
                 generator=torch.Generator().manual_seed(0))
    assert shapes == [(4, 9 + 5)]
    assert r.response_ids.shape[0] == len(prompts)


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
def test_draws_do_not_depend_on_the_slot():
    """1400 copies of one prompt, 2 tokens each, in 7 slots: every sequence lasts exactly 2 steps,
    so sequence i runs in slot i % 7. With top_k=2 each sequence is one of 4 token pairs. Pearson's
    chi-square test of the 7 x 4 table of counts against the exact pair probabilities (from full
    forwards): 7 * 3 = 21 degrees of freedom, rejected above 46.8 (p = 0.001). A slot that read
    stale keys, or a refill that lost a prompt's keys, shifts its pairs' frequencies. And the 7
    slots of one step draw independently: 200 steps in which all 7 draw the same pair happen about
    0.5 times by chance (each pair's probability is below 0.35), every time if they shared their
    random numbers."""
    model = tiny_model(head_scale=2.0)  # flat enough that all four pairs are common
    prompt, n, slots = [7, 8], 1400, 7
    r = generate(model, [prompt] * n, max_new_tokens=2, top_k=2, eos_token_ids=[], slots=slots,
                 generator=torch.Generator().manual_seed(0))
    logits = full_forward(model, torch.tensor([prompt]), torch.ones(1, 2, dtype=torch.bool))[0, -1]
    first = filter_logits(logits, top_k=2).softmax(-1)  # (V,)
    pairs, probs = [], []
    for a in first.nonzero().flatten().tolist():
        ids = torch.tensor([prompt + [a]])
        logits = full_forward(model, ids, torch.ones(1, 3, dtype=torch.bool))[0, -1]
        second = filter_logits(logits, top_k=2)
        for b, p_b in enumerate(second.softmax(-1).tolist()):
            if p_b > 0:
                pairs.append((a, b))
                probs.append(first[a].item() * p_b)
    assert len(pairs) == 4 and 0.1 < min(probs) and max(probs) < 0.35
    drawn = [tuple(row) for row in r.response_ids.tolist()]
    chi2 = 0.0
    for s in range(slots):
        in_slot = drawn[s::slots]
        for pair, p in zip(pairs, probs):
            expected = p * len(in_slot)
            chi2 += (in_slot.count(pair) - expected) ** 2 / expected
    assert sum(drawn.count(pair) for pair in pairs) == n  # every draw is one of the four pairs
    assert chi2 < 46.8
    # and the slots of one step draw independently: all 7 alike has probability
    # < 4 * 0.35^7 = 0.0026
    alike = sum(len(set(drawn[i:i + slots])) == 1 for i in range(0, n, slots))
    assert alike <= 3


@pytest.mark.parity
@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
@pytest.mark.parametrize("grouped", [True, False])
def test_a_prompt_held_by_a_slot_is_copied_not_prefilled_and_samples_the_same(monkeypatch, grouped):
    """G = 6 samples of each of 3 prompts in 4 slots (grouped, as dapo.py passes them, or
    interleaved), lengths ragged: a slot that takes a prompt another slot holds copies that slot's
    keys/values instead of prefilling it. Against the same run with a prefill per sequence (float64,
    so that the two orders of arithmetic cannot flip a draw): the same tokens, and log-probs within
    a few fp32 epsilons (the sampler's logits are fp32)."""
    model = tiny_model(head_scale=4.0).double()
    A, B, C = [5, 17, 3], [8, 2, 44, 61, 9, 23, 30], [60, 1]
    prompts = [A] * 6 + [B] * 6 + [C] * 6 if grouped else [A, B, C] * 6
    prefilled = []  # the prompts of each prefill forward
    prefill_slots = sampler.prefill_slots
    monkeypatch.setattr(sampler, "prefill_slots", lambda model, ps, slots, kv: (
        prefilled.append(ps), prefill_slots(model, ps, slots, kv))[1])

    def run():
        return generate(model, prompts, max_new_tokens=12, eos_token_ids=[3, 9, 11], slots=4,
                        generator=torch.Generator().manual_seed(0))
    shared = run()
    assert all(len(set(map(tuple, ps))) == len(ps) for ps in prefilled)  # no prompt twice in one
    assert sum(map(len, prefilled)) < len(prompts)
    if grouped:
        # a refill places 4 sequences at most, so there were at least 18 / 4 of them: had each one
        # prefilled a prompt, none would have copied all its keys from slots already decoding
        assert sum(map(len, prefilled)) < 18 / 4
    monkeypatch.setattr(sampler, "COPY_HELD_PROMPTS", False)
    prefilled.clear()
    alone = run()
    assert sum(map(len, prefilled)) == len(prompts)
    assert shared.lengths.min() < shared.lengths.max()  # slots were refilled mid-way
    assert torch.equal(shared.response_ids, alone.response_ids)
    assert torch.equal(shared.lengths, alone.lengths)
    tol = 8 * torch.finfo(torch.float32).eps * alone.logprobs.abs().max().clamp(min=1)
    assert (shared.logprobs - alone.logprobs).abs().max() < tol
    # and both are the log-probs of a full forward over prompt + response (the model's own numbers)
    input_ids, attention_mask = full_sequences(shared)
    P, T = shared.prompt_ids.shape[1], shared.response_ids.shape[1]
    logits = full_forward(model, input_ids, attention_mask)[:, P - 1:P - 1 + T]
    ref = logits.log_softmax(-1).gather(-1, shared.response_ids[..., None]).squeeze(-1)
    m = shared.response_mask
    assert (shared.logprobs[m] - ref[m]).abs().max() < tol


# --------------------------------------------------------------------------------------------------
# distributed: two gloo ranks run the same forwards however their work differs

def _two_rank_worker(rank, world_size, init_method, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        model = tiny_model()
        calls = count_forwards(model)
        # 1. rank 0's rows all end at their first token (every token is an EOS), rank 1's never end
        eos = list(range(VOCAB)) if rank == 0 else []
        r = generate(model, PROMPTS, max_new_tokens=6, eos_token_ids=eos,
                     generator=torch.Generator().manual_seed(0))
        lockstep = dict(forwards=len(calls), T=r.response_ids.shape[1],
                        truncated=int(r.truncated.sum()))
        # 2. three times more sequences on rank 0 than on rank 1, in 2 slots each, ending at
        # different steps
        calls.clear()
        r = generate(model, unequal_work(rank), max_new_tokens=8, temperature=0,
                     eos_token_ids=[UNEQUAL_EOS], slots=2)
        torch.save(dict(lockstep=lockstep, forwards=len(calls), response_ids=r.response_ids,
                        lengths=r.lengths),
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


UNEQUAL_EOS = 4  # greedy on PROMPTS: rows end after 2, 4 and 8 tokens


def unequal_work(rank):
    return PROMPTS * 3 if rank == 0 else PROMPTS


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both scenarios of _two_rank_worker in one spawn of two processes -> {rank: what it saved}."""
    out = tmp_path_factory.mktemp("ranks")
    # a rendezvous file, not a port: two suites on one machine cannot collide
    ctx = mp.spawn(_two_rank_worker, args=(2, file_init(out), str(out)), nprocs=2, join=False)
    # a rank that stops early leaves the other blocked in a collective
    deadline = time.monotonic() + 120
    try:
        finished = False  # join() returns each time one process exits: True once all have
        while not finished and time.monotonic() < deadline:
            finished = ctx.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    assert finished, "a rank hung: the ranks fell out of lockstep"
    return {r: torch.load(out / f"rank{r}.pt") for r in range(2)}


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
def test_ranks_run_the_same_number_of_forwards(two_ranks):
    # 6 forwards though its rows ended at 1
    assert two_ranks[0]["lockstep"] == dict(forwards=6, T=1, truncated=0)
    assert two_ranks[1]["lockstep"] == dict(forwards=6, T=6, truncated=len(PROMPTS))


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")
def test_ranks_with_unequal_work_finish_with_the_results_of_one_process(two_ranks):
    assert two_ranks[0]["forwards"] == two_ranks[1]["forwards"]
    model = tiny_model()
    for rank in range(2):
        alone = generate(model, unequal_work(rank), max_new_tokens=8, temperature=0,
                         eos_token_ids=[UNEQUAL_EOS], slots=2)
        assert torch.equal(two_ranks[rank]["lengths"], alone.lengths)
        assert torch.equal(two_ranks[rank]["response_ids"], alone.response_ids)
    # rows end at different steps
    assert two_ranks[0]["lengths"].min() < two_ranks[0]["lengths"].max()
