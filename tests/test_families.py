"""The families model.py runs besides Qwen2 (Llama, Llama 3.x's RoPE, Qwen3) against transformers'
own classes on the same random weights, their config.json both ways, and the configurations
refused (no downloads). Shapes are small but keep a real model's ratios."""
import json

import pytest
import torch

from infra import memory
from model import ModelConfig, Transformer, num_params, rope_inv_freq
from test_model import cached_decode, ours_from, randomise_biases_and_norms

transformers = pytest.importorskip("transformers")

# fp32 logits of size ~1, the same arithmetic as transformers in (nearly) the same order, as in
# tests/test_model.py: 64 ulps of 1 leave room for a reduction summed in another order. (float64
# would be no stricter: transformers' RMSNorm computes in fp32 whatever the model's dtype.)
TOL = 64 * torch.finfo(torch.float32).eps  # 7.6e-6
VOCAB = 301
# Llama 3.2-1B's (32 heads x 64, 8 KV heads, tied, llama3 RoPE: factor 32, low 1, high 4 over
# 8192 positions), scaled down: head_dim 16 at theta 5e5 has wavelengths 6.3, 32, 167... positions,
# so a pre-training context of 64 puts one pair in each band (kept, blended, slowed)
LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
CASES = {
    "llama3": ("Llama", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                             tie_word_embeddings=True,
                             rope_parameters=dict(rope_theta=5e5, **LLAMA3_ROPE))),
    # SmolLM2-135M's 9 heads on 3 KV heads, theta 1e5; untied, with attention_bias
    "llama-bias": ("Llama", dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                                 tie_word_embeddings=False, attention_bias=True,
                                 rope_parameters=dict(rope_type="default", rope_theta=1e5))),
    # Qwen3-0.6B's (hidden 1024, 16 heads x 128: head_dim is not hidden / heads, 8 KV heads, tied)
    "qwen3": ("Qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, tie_word_embeddings=True)),
    "qwen3-untied": ("Qwen3", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=1,
                                   head_dim=16, tie_word_embeddings=False)),
    "qwen2": ("Qwen2", dict(hidden_size=56, num_attention_heads=7, num_key_value_heads=1,
                            tie_word_embeddings=False)),
}


def hf_config(case):
    family, shape = CASES[case]
    return getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, intermediate_size=2 * shape["hidden_size"] + 8, num_hidden_layers=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, **shape)


def hf_model(case, seed=0):
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(hf_config(case))
    return randomise_biases_and_norms(m.float().eval())


@pytest.mark.parity
@pytest.mark.needs("rope", "attention")
@pytest.mark.parametrize("case", list(CASES))
def test_a_directory_transformers_saved_gives_its_logits(tmp_path, case):
    hf = hf_model(case)
    ours = ours_from(hf, tmp_path)
    assert ours.config.model_type == hf.config.model_type
    assert ours.config.head_dim == getattr(hf.config, "head_dim", 8)  # Qwen2's: hidden / heads
    x = torch.randint(0, VOCAB, (2, 150))  # past 64 positions: where llama3's rescale shows
    with torch.no_grad():
        ref, got = hf(x).logits, ours(x)
    assert got.shape == ref.shape == (2, 150, VOCAB)
    assert (got - ref).abs().max() < TOL


@pytest.mark.parity
def test_llama3_inverse_frequencies_are_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = hf_config("llama3")
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    got = rope_inv_freq(ModelConfig.from_hf(hf.to_dict()))
    plain = rope_inv_freq(ModelConfig(hidden_size=128, num_attention_heads=8,
                                      num_key_value_heads=2, rope_theta=5e5))
    assert torch.equal(got, ref)
    # fast pairs kept, slow ones 32 times slower, the one between blended
    assert got[0] == plain[0] and torch.equal(got[2:], plain[2:] / 32)
    assert plain[1] / 32 < got[1] < plain[1]


@pytest.mark.parity
@pytest.mark.needs("rope", "attention", "kv_cache")
@pytest.mark.parametrize("case", ["llama3", "qwen3"])
def test_cached_decode_matches_full_forward(tmp_path, case):
    ours = ours_from(hf_model(case), tmp_path)
    x = torch.randint(0, VOCAB, (2, 90))
    with torch.no_grad():
        assert (cached_decode(ours, x, prefill=70) - ours(x)).abs().max() < TOL


FAMILY_CONFIGS = {
    "llama3": dict(model_type="llama", hidden_size=64, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=True, rope_theta=5e5,
                   rope_scaling=LLAMA3_ROPE),
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
}


@pytest.mark.parity
@pytest.mark.needs("rope", "attention")
@pytest.mark.parametrize("case", list(FAMILY_CONFIGS))
def test_our_checkpoint_loads_in_transformers_as_its_class(tmp_path, case):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=VOCAB, intermediate_size=136, num_hidden_layers=2,
                      max_position_embeddings=512, torch_dtype="float32",
                      **FAMILY_CONFIGS[case])
    ours = Transformer(cfg).eval()
    with torch.no_grad():  # norms start at 1: randomise so that a misplaced one shows
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ours.save_pretrained(str(tmp_path / "ours"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"),
                                                           dtype=torch.float32).eval()
    family = {"llama": "Llama", "qwen3": "Qwen3"}[cfg.model_type]
    assert type(hf).__name__ == f"{family}ForCausalLM"
    x = torch.randint(0, VOCAB, (2, 100))
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max() < TOL
    again = Transformer.from_pretrained(str(tmp_path / "ours"))
    assert again.config == ours.config
    with torch.no_grad():
        assert torch.equal(again(x), ours(x))  # our round trip is bit-exact


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tied", [True, False])
def test_the_memory_plan_counts_each_familys_parameters(case, tied):
    cfg = ModelConfig.from_hf({**hf_config(case).to_dict(), "tie_word_embeddings": tied})
    assert memory.parameter_count(cfg) == num_params(Transformer(cfg))


BASE = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("edit,field", [
    (dict(model_type="llama", rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)),
     r"rope_parameters has rope type 'yarn'"),
    (dict(model_type="llama", rope_scaling=dict(type="linear", factor=2.0)),
     r"rope_scaling has rope type 'linear'"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=4096),
     r"use_sliding_window=true"),
    (dict(model_type="qwen2", layer_types=["full_attention", "sliding_attention"]),
     r"layer_types holds 'sliding_attention'"),
    (dict(model_type="llama", mlp_bias=True), r"mlp_bias=true"),
    (dict(model_type="qwen3_moe", num_experts=8), r"model_type is 'qwen3_moe'"),
    (dict(model_type="mixtral"), r"model_type is 'mixtral'"),
    (dict(model_type="llama", rope_scaling=dict(rope_type="llama3", factor=8.0)),
     r"rope_scaling: llama3 RoPE needs 'low_freq_factor'"),
    (dict(model_type="llama", hidden_act="gelu"), r"hidden_act 'gelu'"),
    (dict(model_type="qwen3", rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                   partial_rotary_factor=0.5)),
     r"partial_rotary_factor"),
])
def test_what_is_not_computed_is_refused_in_one_line_naming_the_file(tmp_path, edit, field):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **edit}))
    with pytest.raises(ValueError, match=r"config\.json: " + field) as refused:
        Transformer.from_pretrained(str(tmp_path))
    assert str(tmp_path) in str(refused.value) and "\n" not in str(refused.value)
