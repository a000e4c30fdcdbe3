"""
A GGUF file (llama.cpp's one-file format: weights, hyperparameters and tokenizer together) turned
into the Hugging Face model directory the rest of this project reads:

    convert(gguf_file, out_dir)   writes model.safetensors, config.json, tokenizer.json,
                                  tokenizer_config.json and generation_config.json

What the conversion undoes:
- quantization: each tensor is dequantized by PyPI's `gguf` (ggml's own reader) and stored in
  fp32. A Q4_1 weight is d * q + m with fp16 d and m and a 4-bit q: fp32 holds gguf's values
  exactly (so a test can ask for equality), bf16 would round them a second time.
- llama.cpp's RoPE layout: its converter reorders the rows of each head of q_proj and k_proj so
  that the pairs its RoPE rotates, (x0, x1), (x2, x3)..., are adjacent; transformers' (and our)
  RoPE rotates (x_i, x_{i + d/2}). `unpermute` puts the rows back; without it the logits differ.
- the tokenizer's shape: a GGUF stores the vocabulary, the merges and each token's type, not a
  tokenizer.json; the pre-tokenizer is named (`tokenizer.ggml.pre`), and built here as that
  model's tokenizer.json has it.

Only Llamas (general.architecture "llama") with a byte-level BPE tokenizer are converted; anything
else is an error naming the file. Beside its one user, examples/smollm2.py (`make real`'s model).
"""
import os
import tempfile
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from infra import files, hf_io
from infra.errors import UserError

# the GGUF tensor names of a Llama and the Hugging Face keys they become
GLOBAL_KEYS = {"token_embd.weight": "model.embed_tokens.weight",
               "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
LAYER_KEYS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types: special tokens, plain added tokens
OUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json")


@dataclass
class HFConfig:
    """A Llama's config.json, in the shape hf_io.save_hf_checkpoint takes a config."""
    hf: dict
    tie_word_embeddings: bool
    torch_dtype: str = "float32"

    def to_hf(self) -> dict:
        return dict(self.hf)


@dataclass
class Converted:
    """What a GGUF file holds, in Hugging Face terms."""
    config: HFConfig
    state_dict: dict  # HF key -> fp32 tensor
    tokenizer: Tokenizer
    tokenizer_config: dict
    generation_config: dict


def convert(gguf_file: str, out_dir: str, progress=None) -> str:
    """Write the Hugging Face directory of gguf_file to out_dir (replaced whole, atomically: a
    crash leaves the old directory or the new one). progress wraps the tensor loop (tqdm)."""
    converted = read(gguf_file, progress)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        write_tokenizer(converted, tokenizer_dir)
        hf_io.save_hf_checkpoint(converted.state_dict, converted.config, out_dir,
                                 tokenizer_dir=tokenizer_dir)
    return out_dir


def is_converted(out_dir: str) -> bool:
    """A directory convert() finished: it renames the whole directory into place at the end."""
    return all(os.path.isfile(os.path.join(out_dir, name)) for name in OUT_FILES)


def read(gguf_file: str, progress=None) -> Converted:
    reader = open_gguf(gguf_file)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    if meta.get("general.architecture") != "llama":
        raise UserError(f"{gguf_file}: architecture {meta.get('general.architecture')!r}; only "
                        "'llama' is converted")
    tensors = {t.name: t for t in reader.tensors}
    # the metadata first: a file that cannot be converted fails before the long part
    config = llama_config(meta, tensors, gguf_file)
    tokenizer = build_tokenizer(meta, gguf_file)
    tokenizer_config, generation_config = token_configs(meta, config.hf)
    state = {}
    for name, tensor in (progress or iter)(tensors.items()):
        state[hf_key(name, gguf_file)] = hf_weight(tensor, config.hf, gguf_file)
    return Converted(config, state, tokenizer, tokenizer_config, generation_config)


def open_gguf(gguf_file: str) -> gguf.GGUFReader:
    if not os.path.isfile(gguf_file):
        raise UserError(f"{gguf_file}: not found")
    with open(gguf_file, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{gguf_file}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return gguf.GGUFReader(gguf_file)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise UserError(f"{gguf_file}: a truncated or corrupt GGUF file "
                        f"({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------------------------------
# weights

def llama_config(meta: dict, tensors: dict, source: str) -> HFConfig:
    """config.json of a LlamaForCausalLM from the `llama.*` metadata."""
    def need(key):
        if f"llama.{key}" not in meta:
            raise UserError(f"{source}: metadata lacks 'llama.{key}'")
        return meta[f"llama.{key}"]

    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise UserError(f"{source}: RoPE scaling {scaling!r} is not converted (plain RoPE only)")
    if "token_embd.weight" not in tensors:
        raise UserError(f"{source}: no token_embd.weight tensor (not a complete model)")
    hidden, heads = need("embedding_length"), need("attention.head_count")
    embed_rows = tensors["token_embd.weight"].shape[1]  # GGUF lists dims innermost first
    tied = "output.weight" not in tensors
    hf = dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
        vocab_size=int(meta.get("llama.vocab_size", embed_rows)), hidden_size=hidden,
        intermediate_size=need("feed_forward_length"), num_hidden_layers=need("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", heads),
        head_dim=meta.get("llama.rope.dimension_count", hidden // heads),
        max_position_embeddings=need("context_length"),
        # stored as float32: 1e-5 reads back as 9.999999747378752e-06; the float32's shortest
        # decimal is the value the model was written with
        rms_norm_eps=float(str(np.float32(need("attention.layer_norm_rms_epsilon")))),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        tie_word_embeddings=tied, attention_bias=False, mlp_bias=False,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
    return HFConfig({k: v for k, v in hf.items() if v is not None}, tied)


def hf_key(name: str, source: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight"""
    if name in GLOBAL_KEYS:
        return GLOBAL_KEYS[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_KEYS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{LAYER_KEYS[parts[2]]}.weight"
    raise UserError(f"{source}: tensor {name!r} is not part of a Llama this converts")


# The tensor types gguf's numpy code dequantizes (gguf 0.19: the float types, the legacy and the
# k-quants); any other is refused, naming the tensor
DEQUANTIZED_NAMES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                     "Q4_K", "Q5_K", "Q6_K")
DEQUANTIZED = frozenset(gguf.GGMLQuantizationType[name] for name in DEQUANTIZED_NAMES)


def hf_weight(tensor, hf: dict, source: str) -> torch.Tensor:
    """One tensor, dequantized to fp32 in the Hugging Face layout (out_features, in_features)."""
    if tensor.tensor_type not in DEQUANTIZED:
        raise UserError(f"{source}: tensor {tensor.name!r} is {tensor.tensor_type.name}, which "
                        "this conversion does not dequantize (it takes "
                        f"{', '.join(DEQUANTIZED_NAMES)})")
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    weight = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
    if ".attn_q." in tensor.name:
        weight = unpermute(weight, hf["num_attention_heads"])
    elif ".attn_k." in tensor.name:
        weight = unpermute(weight, hf["num_key_value_heads"])
    return weight


def unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of a q/k projection's rows. Within each head it stored rows
    [0, d/2, 1, d/2 + 1, ...]: row 2i is the HF row i, row 2i + 1 the HF row d/2 + i."""
    out_features, in_features = weight.shape
    head_dim = out_features // n_heads
    w = weight.reshape(n_heads, head_dim // 2, 2, in_features)  # stored pairs (i, d/2 + i)
    return w.transpose(1, 2).reshape(out_features, in_features).contiguous()


# --------------------------------------------------------------------------------------------------
# tokenizer

def byte_level() -> pre_tokenizers.PreTokenizer:
    """GPT-2's split (contractions, letters, numbers, punctuation, spaces) over bytes as text."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre -> the pre-tokenizer of that model's tokenizer.json
PRE_TOKENIZERS = {
    "gpt2": byte_level,
    # SmolLM (and StarCoder's family): every digit its own piece, then GPT-2's split
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               byte_level()]),
}


def build_tokenizer(meta: dict, source: str) -> Tokenizer:
    """The byte-level BPE the metadata describes: vocabulary, merges, pre-tokenizer, and the
    tokens typed CONTROL (<|im_end|>) or USER_DEFINED as added tokens, matched whole."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise UserError(f"{source}: tokenizer {kind!r} is not byte-level BPE ('gpt2'), the only "
                        "kind converted")
    if pre not in PRE_TOKENIZERS:
        raise UserError(f"{source}: pre-tokenizer {pre!r} is not one of {sorted(PRE_TOKENIZERS)}")
    if meta.get("tokenizer.ggml.add_bos_token", False):
        raise UserError(f"{source}: tokenizer.ggml.add_bos_token is true: a tokenizer that adds "
                        "BOS is not converted")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad:
        raise UserError(f"{source}: merge {' '.join(bad)!r} is not two tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    # a merge's two tokens and their concatenation must be tokens: the tokenizers library's own
    # error ("Token `x` out of vocabulary") names no file and no merge
    for left, right in merges:
        missing = next((t for t in (left, right, left + right) if t not in vocab), None)
        if missing is not None:
            raise UserError(f"{source}: merge {left + ' ' + right!r} needs the token {missing!r}, "
                            "which is not in tokenizer.ggml.tokens: a corrupt or mismatched "
                            "tokenizer")
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return tok


def token_configs(meta: dict, hf: dict) -> tuple[dict, dict]:
    """tokenizer_config.json (chat template, special tokens) and generation_config.json."""
    tokens = meta["tokenizer.ggml.tokens"]
    special = {name: tokens[meta[f"tokenizer.ggml.{key}_token_id"]]
               for name, key in (("bos_token", "bos"), ("eos_token", "eos"),
                                 ("unk_token", "unknown"), ("pad_token", "padding"))
               if f"tokenizer.ggml.{key}_token_id" in meta}
    tokenizer_config = dict(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False,
                            add_eos_token=False, model_max_length=hf["max_position_embeddings"],
                            clean_up_tokenization_spaces=False, **special)
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    # llama.cpp stops at EOS and at the end-of-turn / end-of-message tokens a file names
    eos = [meta[f"tokenizer.ggml.{key}_token_id"] for key in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{key}_token_id" in meta]
    generation_config = {"eos_token_id": list(dict.fromkeys(eos))}
    for key in ("bos_token_id", "pad_token_id"):
        if key in hf:
            generation_config[key] = hf[key]
    return tokenizer_config, generation_config


def write_tokenizer(converted: Converted, out_dir: str):
    tokenizer_file = os.path.join(out_dir, "tokenizer.json")
    with files.writing(tokenizer_file):
        converted.tokenizer.save(tokenizer_file)
    files.write_json(os.path.join(out_dir, "tokenizer_config.json"), converted.tokenizer_config)
    files.write_json(os.path.join(out_dir, "generation_config.json"),
                     converted.generation_config)

