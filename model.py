"""
A Qwen2 / Qwen2.5 decoder in plain PyTorch that also runs Llama and Qwen3, the families built the
same way: the same numbers as transformers' Qwen2ForCausalLM, LlamaForCausalLM and
Qwen3ForCausalLM.

Per layer: RMSNorm -> attention (grouped-query, RoPE) -> residual -> RMSNorm -> SwiGLU MLP ->
residual. The families differ in the attention alone (ModelConfig.model_type): Qwen2 has biases on
q, k and v; Llama none (and Llama 3.x rescales RoPE's slow frequencies); Qwen3 none, but an RMSNorm
over each head of q and k. Parameter names are the Hugging Face keys, so checkpoints load and save
in the HF safetensors layout (from_pretrained / save_pretrained, through infra/hf_io.py) with no key
mapping, and move freely between this file, transformers and vLLM. The policy's log-probs of
sampled responses, which the RL loss reads, are computed beside it (logprobs.py).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from infra import hf_io
from infra.errors import UserError
from infra.files import need_file


@dataclass
class ModelConfig:
    model_type: str = "qwen2"  # the family: "qwen2" (Qwen2, Qwen2.5), "llama" or "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads (Qwen3 sets its own)
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    # Llama 3.x: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None: plain RoPE
    rope_scaling: dict | None = None
    attention_bias: bool = False  # Llama, Qwen3: biases on q, k, v and o (Qwen2: q, k, v always)
    tie_word_embeddings: bool = True
    torch_dtype: str = "bfloat16"  # the dtype the weights are stored in
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        if self.model_type not in hf_io.ARCHITECTURES:
            raise UserError(f"model_type {self.model_type!r} is none of "
                            f"{', '.join(hf_io.ARCHITECTURES)}")
        if self.rope_scaling and self.rope_scaling.get("rope_type") != "llama3":
            raise UserError(f"rope_scaling {self.rope_scaling} is not Llama 3's (rope_type "
                            "'llama3'), the only one implemented")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def qkv_bias(self) -> bool:  # the switches of Attention, from the family
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type != "qwen2" and self.attention_bias

    @property
    def qk_norm(self) -> bool:  # Qwen3: RMSNorm over each head of q and k
        return self.model_type == "qwen3"

    # config.json, read and written in infra/hf_io.py (checked there: model_type, RoPE, types)
    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        return hf_io.config_from_hf(cls, hf, source)

    @classmethod
    def from_json(cls, path: str) -> "ModelConfig":
        return hf_io.config_from_json(cls, path)

    def to_hf(self) -> dict:
        return hf_io.config_to_hf(self)


# Small named shapes. The toy ones take their vocab from their tokenizer.
_TOY = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, torch_dtype="float32")
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, **_TOY),
    "demo": dict(hidden_size=128, intermediate_size=384, **_TOY),
    "qwen2.5-0.5b": {},  # ModelConfig's defaults
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False),
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        tie_word_embeddings=False),
}


def preset(name: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**PRESETS[name], **overrides})


# --------------------------------------------------------------------------------------------------
# The network

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # in fp32 (float64 stays float64): a bf16 mean of squares loses too much precision. Cast
        # back before the weight, as transformers does: the order of the cast changes the bits
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, device=None):
    """The angle each pair of dimensions turns by per position: theta^(-2i / head_dim), i <
    head_dim / 2, in fp32 as transformers; Llama 3.x slows the slow ones down (llama3_rope)."""
    d = cfg.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.float, device=device) / d  # (d/2,)
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    return llama3_rope(inv_freq, cfg.rope_scaling) if cfg.rope_scaling else inv_freq


def llama3_rope(inv_freq, scaling: dict):
    """Llama 3.x's long context: a pair whose wavelength (positions per turn) is longer than the
    pre-training context / low_freq_factor turns `factor` times slower; one shorter than
    context / high_freq_factor keeps its speed; in between, a blend of the two, linear in
    context / wavelength (transformers' _compute_llama3_parameters)."""
    context = scaling["original_max_position_embeddings"]  # of pre-training
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    wavelength = 2 * math.pi / inv_freq  # (d/2,)
    smooth = (context / wavelength - low) / (high - low)  # 0 -> 1 across the band between
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    slow, fast = wavelength > context / low, wavelength < context / high
    return torch.where(slow, inv_freq / factor, torch.where(fast, inv_freq, blended))


def rope_cos_sin(positions, inv_freq, dtype):
    """positions (B, T) -> cos, sin (B, 1, T, head_dim), in fp32 then cast like transformers."""
    # exercise: rope
    freqs = positions[..., None].float() * inv_freq  # (B, T, head_dim/2)
    # (B, T, head_dim): the "rotate half" layout pairs i with i + head_dim/2
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    # end exercise


def apply_rope(x, cos, sin):
    """x (B, H, T, D). Rotate-half RoPE: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), x1/x2 the
    two halves of D."""
    # exercise: rope
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    # end exercise


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = H, Hkv, D
        self.q_proj = nn.Linear(cfg.hidden_size, H * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=cfg.o_bias)
        # Qwen3 normalises each head of q and k, which keeps the attention logits bounded
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, mask, kv_cache=None, positions=None, cache_rows=None):
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, T, H, D)).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(self.k_proj(x).view(B, T, Hkv, D)).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # after Qwen3's norms
        if kv_cache is None:
            y = self.attend(q, k, v, mask, decoding=False)
        else:  # store this step's keys/values at their positions, attend over the cached rows
            k, v = kv_cache.update(self.layer_idx, k, v, positions, cache_rows)  # (B, Hkv, S, D)
            y = self.attend(q, k, v, mask, decoding=T == 1)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))

    def attend(self, q, k, v, mask, decoding: bool):
        """q (B, H, T, D), k and v (B, Hkv, S, D), mask (B, 1, T, S) bool or None (None: causal);
        decoding: one new token per row against a cache -> y (B, H, T, D)."""
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        # exercise: attention
        # GQA: each group of n_head / n_kv_head query heads shares one k/v head (enable_gqa: with
        # no repeated copies of k and v)
        if decoding:
            # fold each group's query heads into the query-length dim, so each cached k/v head is
            # read once, not once per query head; the (B, 1, 1, S) mask broadcasts over the fold
            q = q.view(B, Hkv, H // Hkv, D)  # (B, Hkv, H/Hkv, D)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).view(B, H, 1, D)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=Hkv != H)  # (B, H, T, D)
        # end exercise
        return y


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, kv_cache=None, positions=None, cache_rows=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, positions,
                               cache_rows)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class KVCache:
    """Preallocated keys and values, one row per sequence (the sampler's "slots"). A token's index
    in its row is its RoPE position, so rows fill, end and refill independently. One tensor per
    layer, as in gpt-fast: torch.compile writes a whole tensor in place, but a slice of a bigger one
    as copy, write, copy back (!!)."""
    k: list[torch.Tensor]  # per layer (B, Hkv, max_len, D)
    v: list[torch.Tensor]  # per layer (B, Hkv, max_len, D)
    length: int = 0  # the positions a step reads; 0 = max_len

    def upto(self, n: int) -> "KVCache":
        """The same cache, read up to position n: a step whose tokens sit below n costs n, not
        max_len."""
        return KVCache(self.k, self.v, n)

    def update(self, layer, k, v, positions, rows=None):
        """k, v (n, Hkv, T, D) of tokens at positions (n, T) in cache rows `rows` (n,) (None: rows
        0..n-1) -> those rows' keys and values, (n, Hkv, S, D) each, S = self.length."""
        # exercise: kv_cache
        n = k.shape[0]
        index = torch.arange(n, device=k.device) if rows is None else rows  # (n,)
        # index[:, None] and positions index dims 0 and 2 together: the target is (n, T, Hkv, D)
        # in the cache's dtype: under autocast, RoPE's fp32 tables make k fp32, the cache is bf16
        self.k[layer][index[:, None], :, positions] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][index[:, None], :, positions] = v.transpose(1, 2).to(self.v[layer].dtype)
        S = self.length or self.k[layer].shape[2]
        # The first n rows, in order (a decode step's are all of them): views of the cache, no copy.
        if rows is None:
            return self.k[layer][:n, :, :S], self.v[layer][:n, :, :S]
        # a prefill into some rows: a gather
        return self.k[layer][rows, :, :S], self.v[layer][rows, :, :S]
        # end exercise


def attention_mask_4d(q_index, S, key_mask=None):
    """q_index (B, T): the key index each query sits at (its column without a cache, its position
    with one); key_mask (B, S) bool or None: False on padding keys -> (B, 1, T, S) bool: a query
    sees key j iff j <= its own index and j is no padding. A padding query also sees itself: an
    all-False row gives NaN on some SDPA backends, which 0 * NaN leaks into any masked loss."""
    k_index = torch.arange(S, device=q_index.device)  # (S,)
    mask = k_index <= q_index[..., None]  # (B, T, S)
    if key_mask is not None:
        mask = (mask & key_mask[:, None, :].bool()) | (k_index == q_index[..., None])
    return mask[:, None]


class Transformer(nn.Module):
    """The decoder of every family: embeddings, blocks, final norm, head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.activation_checkpointing = False
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        ))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.compiled_blocks = None  # compile_blocks(): the blocks of the forwards without a cache
        self.loaded_from = None  # from_pretrained's directory: save_pretrained's tokenizer files
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if self.inv_freq.device.type != "meta":
            self.apply(self._init_weights)

    def tie_weights(self):
        # Qwen2.5-0.5B/1.5B/3B share the input and output embeddings
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # transformers' init: N(0, 0.02) for matrices, zero biases (RMSNorm weights start at 1)
    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def compile_blocks(self):
        """torch.compile each decoder block (norms, RoPE and SwiGLU fused; dynamic shapes) for the
        forwards without a KV cache (the training forward, pi_old's): one graph per block keeps
        FSDP2's per-block hooks outside the graphs. The weights and their names stay the model's."""
        self.compiled_blocks = [torch.compile(block, dynamic=True) for block in self.model.layers]

    def new_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        w = self.model.embed_tokens.weight
        on = w.device.type
        # under autocast, keys and values come out in the autocast dtype
        dtype = torch.get_autocast_dtype(on) if torch.is_autocast_enabled(on) else w.dtype
        shape = (batch_size, self.config.num_key_value_heads, max_len, self.config.head_dim)
        layers = range(self.config.num_hidden_layers)
        return KVCache([torch.zeros(shape, dtype=dtype, device=w.device) for _ in layers],
                       [torch.zeros(shape, dtype=dtype, device=w.device) for _ in layers])

    def forward(self, input_ids, positions=None, attention_mask=None, kv_cache=None,
                cache_rows=None, head=None):
        """input_ids (B, T); positions (B, T), RoPE's, default arange(T); attention_mask (B, T)
        bool, True on real tokens. With kv_cache (a KVCache, or kv_cache.upto(S)): this step's keys
        and values go to index `positions` of rows `cache_rows` (B,) (default 0..B-1), and each
        query attends to its row's keys up to its position (attention_mask is then over those S).
        -> logits (B, T, V) in fp32, or head(hidden, lm_head_weight): the output layer applied by
        the caller inside the forward (under FSDP, while the root's weights are gathered)."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        if kv_cache is not None:  # keys are cache indices, and a token's index is its position
            S = kv_cache.length or kv_cache.k[0].shape[2]
            mask = attention_mask_4d(positions, S, attention_mask)
        elif attention_mask is not None:  # keys are this call's columns
            columns = torch.arange(T, device=input_ids.device).expand(B, T)
            mask = attention_mask_4d(columns, T, attention_mask)
        else:
            mask = None  # full causal (is_causal)
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)  # shared by all layers
        # forwards with a cache (the rollout's) run the plain blocks: the sampler compiles its own
        use_compiled = self.compiled_blocks and kv_cache is None
        blocks = self.compiled_blocks if use_compiled else self.model.layers
        for block in blocks:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                # keep each block's input only and recompute its activations in the backward
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, kv_cache, positions, cache_rows)
        x = self.model.norm(x)  # (B, T, C)
        if head is not None:
            return head(x, self.lm_head.weight)
        logits = self.lm_head(x)  # (B, T, V)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or float64

    # ----------------------------------------------------------------------------------------------
    # Hugging Face checkpoints

    @classmethod
    def from_pretrained(cls, path: str, dtype=None, device="cpu") -> "Transformer":
        """Load a Hugging Face Qwen2, Llama or Qwen3 directory (model.safetensors, or sharded
        files + model.safetensors.index.json), dtype by default the config's torch_dtype. Built on
        the meta device, the model takes the loaded tensors in place: no second copy in memory."""
        cfg = ModelConfig.from_json(need_file(path, "config.json"))
        dtype = dtype or getattr(torch, cfg.torch_dtype)
        with torch.device("meta"):
            model = cls(cfg)
        tied = hf_io.tied_keys(cfg)
        expected = {k: v.shape for k, v in model.state_dict().items() if k not in tied}
        state = hf_io.load_state_dict(path, expected, dtype, device, skip=tied)
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()  # assign=True replaced the Parameter objects: tie them again
        model.inv_freq = rope_inv_freq(cfg, device)
        model.loaded_from = path
        return model

    def save_pretrained(self, path: str, max_shard_bytes: int = 5 * 2**30,
                        tokenizer_dir: str | None = None):
        """config.json and safetensors, with the tokenizer files of tokenizer_dir (by default the
        directory from_pretrained read) beside them: a Hugging Face directory that transformers and
        vLLM load whole (a model built from a config alone has no tokenizer files)."""
        hf_io.save_hf_checkpoint(self.state_dict(), self.config, path, max_shard_bytes,
                                 tokenizer_dir=tokenizer_dir or self.loaded_from)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once
