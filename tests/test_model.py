"""model.py against transformers' Qwen2ForCausalLM on the same random weights (no downloads): the
logits, RoPE, attention, the KV cache, checkpoints read and written. The training forward's
log-probs are tests/test_logprobs.py's."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

import model as model_module
from infra.errors import UserError
from model import (Attention, KVCache, ModelConfig, Transformer, apply_rope, attention_mask_4d,
                   preset, rope_cos_sin)

transformers = pytest.importorskip("transformers")

# fp32 logits of size ~1 (random weights), the same arithmetic as transformers in (nearly) the same
# order: bit-identical on three CPU kernel sets (unset, ATEN_CPU_CAPABILITY=avx2, =default); 64
# ulps of 1 leave room for a reduction summed in another order
TOL = 64 * torch.finfo(torch.float32).eps  # 7.6e-6


def hf_model(vocab=257, kv_heads=2, heads=4, hidden=64, tied=True, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden,
                                   intermediate_size=2 * hidden + 8, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   rope_theta=1e6, tie_word_embeddings=tied,
                                   max_position_embeddings=512)
    return randomise_biases_and_norms(transformers.Qwen2ForCausalLM(cfg).float().eval())


def randomise_biases_and_norms(m):
    """transformers inits biases and norms to constants; randomised, the tests see them."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def ours_from(hf, tmp_path):
    hf.save_pretrained(tmp_path / "hf")
    return Transformer.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()


# (vocab, kv_heads, heads, hidden, tied): kv-head ratios 1, 2 and 7, odd vocabs, tied and untied
CONFIGS = [
    (257, 4, 4, 64, True),
    (1001, 2, 4, 64, False),
    (331, 1, 7, 56, True),
    (500, 2, 14, 112, False),
]


@pytest.mark.parity
@pytest.mark.needs("rope", "attention")
@pytest.mark.parametrize("vocab,kv,heads,hidden,tied", CONFIGS)
def test_logits_match_transformers(tmp_path, vocab, kv, heads, hidden, tied):
    hf = hf_model(vocab, kv, heads, hidden, tied)
    ours = ours_from(hf, tmp_path)
    assert ours.config.num_key_value_heads == kv and ours.config.tie_word_embeddings == tied
    x = torch.randint(0, vocab, (3, 37))
    with torch.no_grad():
        ref = hf(x).logits
        got = ours(x)
    assert got.shape == ref.shape == (3, 37, vocab)
    assert (got - ref).abs().max() < TOL


@pytest.mark.parity
@pytest.mark.needs("rope", "attention")
def test_left_padded_batch_matches_each_sequence_alone(tmp_path):
    hf = hf_model(vocab=300, kv_heads=2)
    ours = ours_from(hf, tmp_path)
    seqs = [torch.randint(0, 300, (n,)) for n in (5, 12, 9)]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):], mask[i, T - len(s):] = s, True
    # each sequence's first real token at position 0
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = ours(ids, positions=positions, attention_mask=mask)
        hf_batch = hf(ids, attention_mask=mask.long(), position_ids=positions).logits
        assert torch.isfinite(batch).all()  # padding rows too: NaN there would poison a masked loss
        for i, s in enumerate(seqs):
            alone = ours(s[None])[0]
            assert (batch[i, T - len(s):] - alone).abs().max() < TOL
            assert (hf_batch[i, T - len(s):] - alone).abs().max() < TOL


@pytest.mark.parity
@pytest.mark.needs("rope", "attention", "kv_cache")
def test_cached_decode_matches_full_forward(tmp_path):
    ours = ours_from(hf_model(vocab=300), tmp_path)
    x = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        assert (cached_decode(ours, x, prefill=8) - ours(x)).abs().max() < TOL


def cached_decode(model, x, prefill: int):
    """The logits of x (B, T) from a KV cache: the first `prefill` tokens in one forward, then
    one token at a time."""
    B, T = x.shape
    cache = model.new_kv_cache(B, T)
    steps = [model(x[:, :prefill], kv_cache=cache.upto(prefill))]
    for t in range(prefill, T):
        steps.append(model(x[:, t:t + 1], positions=torch.full((B, 1), t),
                           kv_cache=cache.upto(t + 1)))
    return torch.cat(steps, 1)  # (B, T, V)


# The pieces on their own: RoPE, grouped-query attention, the KV-cache write

@pytest.mark.parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("theta,head_dim", [(1e6, 16), (1e4, 8)])
def test_rope_matches_transformers(dtype, theta, head_dim):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb
    cfg = transformers.Qwen2Config(hidden_size=4 * head_dim, num_attention_heads=4,
                                   num_key_value_heads=2, rope_theta=theta)
    rotary = Qwen2RotaryEmbedding(cfg)
    positions = torch.tensor([[0, 1, 2, 3, 40], [0, 0, 0, 1, 2]])  # the second row left-padded
    q, k = torch.randn(2, 4, 5, head_dim, dtype=dtype), torch.randn(2, 2, 5, head_dim, dtype=dtype)
    ref_cos, ref_sin = rotary(q, positions)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    cos, sin = rope_cos_sin(positions, rotary.inv_freq, dtype)
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, ref_cos[:, None]) and torch.equal(sin, ref_sin[:, None])
    # two products and a sum per element: 4 ulps of the largest value
    tol = 4 * torch.finfo(dtype).eps * max(q.abs().max().item(), k.abs().max().item())
    assert (apply_rope(q, cos, sin) - ref_q).abs().max() < tol
    assert (apply_rope(k, cos, sin) - ref_k).abs().max() < tol


@pytest.mark.parity
def test_rope_attention_scores_depend_on_the_relative_position_only():
    # in float64: an identity of the exact maths, which fp32 angles would blur by ~1e-5
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64) for _ in range(2))
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))

    def rotated(x, position):
        return apply_rope(x, *rope_cos_sin(torch.tensor([[position]]), inv_freq, torch.float64))

    def score(m, n):
        return (rotated(q, m) * rotated(k, n)).sum().item()
    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-12)
    assert score(5, 2) == pytest.approx(score(3, 0), abs=1e-12)
    assert abs(score(5, 2) - score(5, 4)) > 1e-2  # and the relative position does matter
    assert rotated(q, 7).norm().item() == pytest.approx(q.norm().item(), rel=1e-12)  # a rotation


def textbook_attention(q, k, v, sees):
    """softmax(q k^T / sqrt(D)) v where sees (B, 1, T, S) is True; query head h reads key/value
    head h // (H / Hkv)."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~sees, -math.inf)
    return scores.softmax(-1) @ v  # (B, H, T, D)


@pytest.mark.parametrize("case", ["causal", "padded", "decode"])
def test_attention_matches_the_textbook_formula(monkeypatch, case):
    # RoPE is an exercise of its own: none here
    monkeypatch.setattr(model_module, "apply_rope", lambda x, cos, sin: x)
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=11, hidden_size=48, num_attention_heads=6,
                 num_key_value_heads=2)
    attn = Attention(cfg, layer_idx=0).double()  # 6 query heads, 2 key/value heads, head_dim 8
    B, T, H, D = 2, 7, 6, 8
    x = torch.randn(B, T, 48, dtype=torch.float64)
    q, k, v = (proj(x).view(B, T, -1, D).transpose(1, 2)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    columns = torch.arange(T).expand(B, T)
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[1, :3] = False  # the second sequence left-padded by 3
    mask = attention_mask_4d(columns, T, key_mask if case == "padded" else None)  # (B, 1, T, T)
    y = textbook_attention(q, k, v, mask)
    expected = attn.o_proj(y.transpose(1, 2).reshape(B, T, H * D))
    if case == "decode":  # the last token alone, against the keys of all 7 positions

        class Cache:  # for KVCache (an exercise of its own): 6 cached positions, then this step's
            length = T

            def update(self, layer, k_new, v_new, positions, rows):
                return torch.cat([k[:, :, :-1], k_new], 2), torch.cat([v[:, :, :-1], v_new], 2)
        last = torch.full((B, 1), T - 1)
        got = attn(x[:, -1:], None, None, attention_mask_4d(last, T), Cache(), last)
        expected = expected[:, -1:]
    else:  # the causal case as the model runs it without padding: mask None
        got = attn(x, None, None, mask if case == "padded" else None)
    assert got.shape == expected.shape and (got - expected).abs().max() < 1e-10


def test_kv_cache_writes_each_token_at_its_position_in_its_row():
    # 4 rows of 10 positions, read up to 6; two sequences of 3 tokens, k and v (n, Hkv, T, D)
    cache = KVCache([torch.zeros(4, 2, 10, 3)], [torch.zeros(4, 2, 10, 3)], length=6)
    k, v = torch.randn(2, 2, 3, 3), torch.randn(2, 2, 3, 3)
    positions, rows = torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([2, 0])
    got_k, got_v = cache.update(0, k, v, positions, rows)
    for got, new, stored in ((got_k, k, cache.k[0]), (got_v, v, cache.v[0])):
        expected = torch.zeros(4, 2, 10, 3)
        expected[2, :, 0:3], expected[0, :, 3:6] = new[0], new[1]
        assert torch.equal(stored, expected)
        assert torch.equal(got, expected[rows, :, :6])  # the rows asked for, up to length 6


def test_kv_cache_without_rows_writes_the_first_rows():
    cache = KVCache([torch.zeros(3, 1, 8, 2)], [torch.zeros(3, 1, 8, 2)])  # read: all 8 positions
    first = torch.randn(3, 1, 1, 2)
    cache.update(0, first, -first, torch.tensor([[4], [0], [7]]))  # one decode token per row
    second = torch.randn(3, 1, 1, 2)
    got_k, got_v = cache.update(0, second, -second, torch.tensor([[5], [1], [0]]))
    expected = torch.zeros(3, 1, 8, 2)
    expected[0, :, 4], expected[1, :, 0], expected[2, :, 7] = first[:, :, 0]
    expected[0, :, 5], expected[1, :, 1], expected[2, :, 0] = second[:, :, 0]
    assert torch.equal(got_k, expected) and torch.equal(got_v, -expected)
    assert torch.equal(cache.k[0], expected)


@pytest.mark.parity
@pytest.mark.needs("rope", "attention", "kv_cache")
def test_compiled_blocks_train_as_the_eager_ones_and_leave_the_rollout_eager():
    """--compile's training forward (Transformer.compile_blocks): the log-probs and every gradient
    equal the eager blocks' in float64, with and without activation checkpointing (inductor fuses
    and may sum in another order: round-off only); the weights keep their names; and a forward
    with a KV cache (the rollout's) runs the plain blocks."""
    from types import SimpleNamespace

    from logprobs import response_logprobs
    from sampler import generate
    torch.manual_seed(0)
    eager = Transformer(preset("tiny", vocab_size=300)).double()
    compiled = Transformer(preset("tiny", vocab_size=300)).double()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_blocks()
    assert list(compiled.state_dict()) == list(eager.state_dict())
    prompt_mask = torch.ones(4, 6, dtype=torch.bool)
    prompt_mask[0, :2] = False  # left padding
    response_mask = torch.ones(4, 9, dtype=torch.bool)
    response_mask[1, 5:] = False
    batch = SimpleNamespace(prompt_ids=torch.randint(0, 300, (4, 6)), prompt_mask=prompt_mask,
                            response_ids=torch.randint(0, 300, (4, 9)),
                            response_mask=response_mask)
    for checkpointing in (False, True):
        logps, grads = [], []
        for m in (eager, compiled):
            m.activation_checkpointing = checkpointing
            m.train()
            m.zero_grad(set_to_none=True)
            logp, _ = response_logprobs(m, batch, 1.0)
            (logp * torch.linspace(-1, 1, 9, dtype=torch.float64)).sum().backward()
            logps.append(logp)
            grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
        scale = logps[0].abs().max()
        assert (logps[0] - logps[1]).abs().max() <= 64 * torch.finfo(torch.float64).eps * scale
        scale = grads[0].abs().max()
        assert (grads[0] - grads[1]).abs().max() <= 64 * torch.finfo(torch.float64).eps * scale

    def not_here(*args):
        raise AssertionError("a compiled block ran")
    compiled.compiled_blocks = [not_here] * len(compiled.compiled_blocks)
    prompts = [[5, 6, 7], [8, 9]]
    assert torch.equal(generate(compiled, prompts, 5, temperature=0).response_ids,
                       generate(eager, prompts, 5, temperature=0).response_ids)
    with pytest.raises(AssertionError, match="a compiled block ran"):
        compiled(torch.tensor([[5, 6, 7]]))


@pytest.mark.needs("rope", "attention")
def test_hidden_and_head_paths_give_the_logits(tmp_path):
    ours = ours_from(hf_model(vocab=300, tied=False), tmp_path)
    x = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        logits = ours(x)
        # a head that leaves the final hidden states as they are
        hidden = ours(x, head=lambda h, w: h)
        via_head = ours(x, head=lambda h, w: h @ w.T)
    assert hidden.shape == (2, 10, 64)
    assert (ours.lm_head(hidden) - logits).abs().max() < TOL
    assert (via_head - logits).abs().max() < TOL


@pytest.mark.needs("rope", "attention")
@pytest.mark.parametrize("tied", [True, False])
def test_our_checkpoint_loads_in_transformers(tmp_path, tied):
    torch.manual_seed(1)
    ours = Transformer(preset("tiny", vocab_size=211, tie_word_embeddings=tied)).eval()
    ours.save_pretrained(str(tmp_path / "ours"))
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path / "ours"),
                                                       dtype=torch.float32).eval()
    x = torch.randint(0, 211, (2, 15))
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max() < TOL
    again = Transformer.from_pretrained(str(tmp_path / "ours"))
    assert again.config == ours.config
    with torch.no_grad():
        assert torch.equal(again(x), ours(x))  # our round trip is bit-exact
    if tied:
        assert again.lm_head.weight is again.model.embed_tokens.weight


@pytest.mark.needs("rope", "attention")
def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(2)
    ours = Transformer(preset("tiny", vocab_size=211, tie_word_embeddings=False))
    ours.save_pretrained(str(tmp_path / "sharded"), max_shard_bytes=60_000)
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert "model.safetensors.index.json" in files and "model-00001-of-" in files[1]
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path / "sharded"),
                                                       dtype=torch.float32)
    again = Transformer.from_pretrained(str(tmp_path / "sharded"))
    x = torch.randint(0, 211, (1, 9))
    with torch.no_grad():
        assert torch.equal(again(x), ours(x))
        assert (hf(x).logits - ours(x)).abs().max() < TOL


def test_config_reads_old_top_level_rope_theta_and_new_rope_parameters():
    base = dict(model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    old = ModelConfig.from_hf({**base, "rope_theta": 12345.0, "torch_dtype": "bfloat16"})
    rope = {"rope_theta": 54321.0, "rope_type": "default"}
    new = ModelConfig.from_hf({**base, "rope_parameters": rope})
    assert old.rope_theta == 12345.0 and old.torch_dtype == "bfloat16"
    assert new.rope_theta == 54321.0
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 1.0, "rope_type": "yarn"}})


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(3)
    m = Transformer(preset("tiny", vocab_size=50, tie_word_embeddings=False))
    m.save_pretrained(str(tmp_path / "ckpt"))
    return tmp_path / "ckpt"


def test_missing_file_names_the_file(tmp_path, saved):
    os.remove(saved / "model.safetensors")
    with pytest.raises(UserError, match="model.safetensors"):
        Transformer.from_pretrained(str(saved))
    with pytest.raises(UserError, match="config.json"):
        Transformer.from_pretrained(str(tmp_path / "nowhere"))


def _rewrite(saved, edit):
    from safetensors.torch import load_file
    sd = load_file(saved / "model.safetensors")
    edit(sd)
    save_file(sd, saved / "model.safetensors", metadata={"format": "pt"})


def test_missing_key_is_named(saved):
    _rewrite(saved, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        Transformer.from_pretrained(str(saved))


def test_unexpected_key_is_named_with_its_file(saved):
    _rewrite(saved, lambda sd: sd.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected key "
                                         r"'model\.layers\.9\.extra\.weight'"):
        Transformer.from_pretrained(str(saved))


def test_shape_mismatch_is_named(saved):
    _rewrite(saved, lambda sd: sd.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(3,\)"):
        Transformer.from_pretrained(str(saved))


def test_bad_config_json_is_named(saved):
    (saved / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        Transformer.from_pretrained(str(saved))


@pytest.mark.parametrize("content, message", [
    (b"[]", "config.json: the top level must be a JSON object ({...}), got a list"),
    (b'{"model_type": "qwen2\xff"}', "config.json: not valid JSON, truncated or corrupt (a "
                                     "partial copy?): 'utf-8' codec can't decode byte 0xff"),
    (b'{"model_type": ["qwen2"]}', "config.json: model_type is ['qwen2']"),
    (b'{"layer_types": 3}', "config.json: layer_types must be a list, got 3"),
], ids=["list", "not-utf8", "model-type-list", "layer-types-number"])
def test_a_config_json_of_the_wrong_shape_is_named(saved, content, message):
    # before: AttributeError, UnicodeDecodeError or TypeError tracebacks
    (saved / "config.json").write_bytes(content)
    with pytest.raises(ValueError) as e:
        Transformer.from_pretrained(str(saved))
    assert message in str(e.value)


@pytest.mark.needs("rope", "attention")
def test_save_replaces_an_existing_checkpoint_whole(saved):
    torch.manual_seed(4)
    m = Transformer(preset("tiny", vocab_size=50, tie_word_embeddings=True))
    m.save_pretrained(str(saved))
    assert json.loads((saved / "config.json").read_text())["tie_word_embeddings"] is True
    assert not [p for p in os.listdir(saved.parent) if p.startswith((".tmp-ckpt-", "ckpt.old"))]
    with torch.no_grad():
        x = torch.randint(0, 50, (1, 5))
        assert torch.equal(Transformer.from_pretrained(str(saved))(x), m(x))


def test_a_nan_weight_is_refused_naming_the_file_and_tensor(saved):
    _rewrite(saved,
             lambda sd: sd["model.layers.1.mlp.up_proj.weight"].view(-1)[7].fill_(float("nan")))
    with pytest.raises(ValueError, match=r"model\.safetensors: "
                                         r"'model\.layers\.1\.mlp\.up_proj\.weight' holds 1 NaN "
                                         r"and 0 inf value\(s\) among its \d+: refusing to load"):
        Transformer.from_pretrained(str(saved))


def test_weights_with_an_inf_are_never_saved(tmp_path):
    m = Transformer(preset("tiny", vocab_size=50))
    with torch.no_grad():
        m.model.norm.weight[3] = float("inf")
    with pytest.raises(ValueError, match=r"not saving .*'model\.norm\.weight' holds 0 NaN and "
                                         r"1 inf"):
        m.save_pretrained(str(tmp_path / "ckpt"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("field,value,expected", [
    ("hidden_size", "128", r"'hidden_size' must be a positive integer, got \"128\" \(str\)"),
    ("num_hidden_layers", 2.0,
     r"'num_hidden_layers' must be a positive integer, got 2.0 \(float\)"),
    ("num_attention_heads", 0, r"'num_attention_heads' must be a positive integer, got 0"),
    ("rope_theta", "1e6", r"'rope_theta' must be a positive number, got \"1e6\""),
    ("tie_word_embeddings", "false", r"'tie_word_embeddings' must be true or false, got \"false\""),
    ("torch_dtype", "bf16", r"torch_dtype 'bf16' is not a torch dtype"),
])
def test_a_config_field_of_the_wrong_type_is_named_with_its_file(saved, field, value, expected):
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=r"config\.json: " + expected):
        Transformer.from_pretrained(str(saved))


@pytest.mark.parametrize("keep", [5, 1000, -100], ids=["header", "metadata", "data"])
def test_a_truncated_safetensors_file_is_named(saved, keep):
    data = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(data[:keep])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file, "
                                         r"truncated"):
        Transformer.from_pretrained(str(saved))


def test_a_saved_model_is_a_whole_hugging_face_directory(tiny_model_dir, tmp_path, monkeypatch):
    # before: config.json and safetensors only; transformers and vLLM load the tokenizer from
    # beside the weights
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from data import load_tokenizer
    loaded, built = tmp_path / "loaded", tmp_path / "built"
    # the first keeps its source's tokenizer, the second is given one
    Transformer.from_pretrained(tiny_model_dir).save_pretrained(str(loaded))
    Transformer(preset("tiny", vocab_size=50)).save_pretrained(str(built),
                                                               tokenizer_dir=tiny_model_dir)
    ours = load_tokenizer(tiny_model_dir)
    for d in (loaded, built):
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(
            os.listdir(d))
        theirs = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        assert transformers.AutoConfig.from_pretrained(str(d)).model_type == "qwen2"
        messages = [{"role": "user", "content": "1+2+3"}]
        assert theirs.apply_chat_template(messages, add_generation_prompt=True,
                                          tokenize=True, return_dict=False) == \
            ours.apply_chat_template(messages)


@pytest.mark.needs("rope", "attention")
def test_saving_into_a_model_directory_keeps_the_files_it_does_not_own(tmp_path):
    d = tmp_path / "m"
    sharded = Transformer(preset("tiny", vocab_size=50, tie_word_embeddings=False))
    sharded.save_pretrained(str(d), max_shard_bytes=60_000)
    (d / "tokenizer.json").write_text("{}")
    (d / "extra").mkdir()
    (d / "extra" / "notes.txt").write_text("kept")
    m = Transformer(preset("tiny", vocab_size=50))
    m.save_pretrained(str(d))  # one file now: the shards and their index go, the rest stays
    assert sorted(os.listdir(d)) == ["config.json", "extra", "model.safetensors", "tokenizer.json"]
    assert ((d / "tokenizer.json").read_text() == "{}"
            and (d / "extra" / "notes.txt").read_text() == "kept")
    x = torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        assert torch.equal(Transformer.from_pretrained(str(d))(x), m(x))


def test_saved_files_are_readable_by_everyone(tmp_path):
    Transformer(preset("tiny", vocab_size=50)).save_pretrained(str(tmp_path / "m"))
    modes = {name: oct(os.stat(tmp_path / "m" / name).st_mode & 0o777)
             for name in os.listdir(tmp_path / "m")}
    assert modes == {"config.json": oct(0o644 & ~_umask()), "model.safetensors": "0o644"}


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_full_disk_names_the_file_and_leaves_the_directory_as_it_was(saved, monkeypatch):
    import errno
    from infra import hf_io
    before = {name: (saved / name).read_bytes() for name in os.listdir(saved)}

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(hf_io, "save_file", no_space)
    with pytest.raises(UserError, match=r"could not write .*/\.tmp-ckpt-\w+/model\.safetensors: "
                                        r"the disk is full"):
        Transformer(preset("tiny", vocab_size=50)).save_pretrained(str(saved))
    assert {name: (saved / name).read_bytes() for name in os.listdir(saved)} == before
    assert os.listdir(saved.parent) == ["ckpt"]  # no temporary directory left behind


def test_files_and_directory_are_synced_before_the_rename(tmp_path, monkeypatch):
    from infra import files
    events = []
    fsync, replace = files.fsync, os.replace
    monkeypatch.setattr(files, "fsync",
                        lambda p: (events.append(("fsync", os.path.basename(p))), fsync(p)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", os.path.basename(a))),
                                                     replace(a, b)))
    Transformer(preset("tiny", vocab_size=50)).save_pretrained(str(tmp_path / "m"))
    tmp = next(name for kind, name in events if kind == "rename")
    assert events.index(("fsync", "model.safetensors")) < events.index(("fsync", tmp)) < \
        events.index(("rename", tmp)) < events.index(("fsync", tmp_path.name))


def test_from_pretrained_does_not_copy_weights(saved):
    m = Transformer.from_pretrained(str(saved), dtype=torch.float32)
    assert all(p.device.type == "cpu" for p in m.parameters())  # nothing left on the meta device
    assert m.inv_freq.device.type == "cpu"


@pytest.mark.parity
@pytest.mark.needs("rope", "attention")
def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(5)
    m = Transformer(preset("tiny", vocab_size=97)).double()  # recomputed: at most float64 round-off
    x = torch.randint(0, 97, (2, 11))
    grads = []
    for ckpt in (False, True):
        m.zero_grad()
        m.activation_checkpointing = ckpt
        m(x).logsumexp(-1).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert (grads[0] - grads[1]).abs().max() < 1e-12 * grads[0].abs().max()
    assert grads[0].abs().max() > 0


@pytest.mark.parametrize("head", ["the embedding", "another"])
def test_a_tied_model_whose_file_holds_another_head_says_it_is_dropped(tmp_path, capsys, head):
    # before: a tied config's lm_head.weight was skipped silently, even one that differed from
    # the embedding (a model trained untied, with tie_word_embeddings set by mistake)
    from safetensors.torch import load_file
    torch.manual_seed(3)
    tied = Transformer(preset("tiny", vocab_size=211, tie_word_embeddings=True))
    tied.save_pretrained(str(tmp_path))
    file = str(tmp_path / "model.safetensors")
    weights = load_file(file)
    embedding = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embedding.clone() if head == "the embedding" else \
        torch.randn_like(embedding)
    save_file(weights, file)
    Transformer.from_pretrained(str(tmp_path))
    out = capsys.readouterr().out
    if head == "the embedding":
        assert out == ""
    else:
        assert out == (f"warning: {file} holds an lm_head.weight that differs from "
                       "model.embed_tokens.weight, and config.json's tie_word_embeddings is "
                       "true: the head is the embedding, that lm_head.weight is not used\n")
