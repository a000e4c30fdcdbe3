"""
GPU check: a checkpoint that transformers wrote, in bf16, read by model.py. transformers'
Qwen2ForCausalLM of a Qwen2.5-0.5B-shaped config, random (its biases and norms too, so that they
count), saved with save_pretrained in bf16 (the dtype Qwen2.5's checkpoints ship in); both models
load it and compute the logits of the same left-padded batch, in bf16 (the weights as stored) and
in fp32 (the same weights, widened exactly). Not part of `make bench` (no GPU there).

    python -m checks.gpu_parity                         # one GPU, ~30 s
    python -m checks.gpu_parity --device cpu --preset tiny   # smoke

What it checks (exit 1 if one fails), over the real tokens' logits z:
- our loader takes the checkpoint's dtype (bf16) from its config.json;
- fp32 against fp32: the same arithmetic in another order. max |dz| <= 64 eps_fp32 x layers x
  max |z| (64 ulps of the logits' size per layer);
- bf16 against bf16: both round every activation to bf16 (u = 2^-8); where the two codes round
  at other places (another attention kernel, another fusion), they differ by about sqrt(2) x
  bf16's own error, which grows like sqrt(layers) (a sum of independent roundings): allowed
  rms(dz) <= 4 u sqrt(layers) rms(z) (0.078 rms(z) at 24 layers). Measured on CPU at this shape:
  ours and transformers' bit for bit the same in bf16 and in fp32, and bf16's own error (either
  against fp32) 0.9 u sqrt(layers) rms(z). A wrong layout, a missing bias, a norm or a RoPE
  table read wrong is O(rms(z)). Each bf16 path against fp32 is printed beside it.
- the training forward (response_logprobs and its backward, on left-padded prompts and
  right-padded responses) runs with SDPA restricted to FlashAttention: no explicit mask, so no
  fall back to the math kernel, which holds (rows, heads, T, T) scores. (On CPU, SDPA's flash
  kernel takes masks too: the smoke run cannot tell.)
"""
import argparse
import sys
import tempfile

import torch

from benchmarks.common import randomise_biases_and_norms
from infra.precision import BF16_UNIT_ROUNDOFF as U
from model import Transformer, preset

EPS = torch.finfo(torch.float32).eps


def hf_checkpoint(cfg, path):
    """transformers' random Qwen2 of our config's shape, saved in bf16 by save_pretrained."""
    import transformers
    hf_cfg = transformers.Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings)
    torch.manual_seed(0)
    hf = randomise_biases_and_norms(transformers.Qwen2ForCausalLM(hf_cfg))
    hf.to(torch.bfloat16).save_pretrained(path)


def batch(vocab, n, length, device):
    """n left-padded rows of random tokens, lengths from length/2 to length -> ids, mask,
    positions (B, T) (each row's first real token at position 0)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    starts = torch.randint(0, length // 2 + 1, (n,), generator=g)
    mask = torch.arange(length) >= starts[:, None]  # (B, T)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return ids.masked_fill(~mask, 0).to(device), mask.to(device), positions.to(device)


@torch.no_grad()
def logits_of(path, dtype, device, inputs) -> dict:
    """{"ours", "hf"}: each model's fp32 copy of its logits at the real tokens, (tokens, V);
    "dtype": the one our model loaded in (dtype None: the checkpoint's, from its config.json)."""
    import transformers
    ids, mask, positions = inputs
    ours = Transformer.from_pretrained(path, dtype=dtype, device=device).eval()
    out = {"ours": ours(ids, positions=positions, attention_mask=mask)[mask].float(),
           "dtype": ours.model.embed_tokens.weight.dtype}
    del ours
    hf = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=dtype or torch.bfloat16,
                                                       attn_implementation="sdpa").to(device)
    out["hf"] = hf(input_ids=ids, attention_mask=mask.long(),
                   position_ids=positions).logits[mask].float()
    return out


def flash_trains(path, device) -> str:
    """'' if a training forward and backward of our bf16 model run on FlashAttention alone, else
    the error SDPA raised."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from logprobs import response_logprobs
    model = Transformer.from_pretrained(path, device=device)
    g = torch.Generator().manual_seed(1)
    prompt_len, response_len = torch.randint(8, 33, (4,), generator=g), \
        torch.randint(4, 65, (4,), generator=g)
    prompt_mask = torch.arange(32) >= (32 - prompt_len)[:, None]  # left-padded
    response_mask = torch.arange(64) < response_len[:, None]  # right-padded
    batch = SimpleNamespace(
        prompt_ids=(torch.randint(0, 500, (4, 32), generator=g) * prompt_mask).to(device),
        prompt_mask=prompt_mask.to(device), response_mask=response_mask.to(device),
        response_ids=(torch.randint(0, 500, (4, 64), generator=g) * response_mask).to(device))
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            logp, _ = response_logprobs(model, batch, 1.0)
            logp.sum().backward()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return ""


def rms(x):
    return float(x.double().square().mean().sqrt())


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda",
                   help="cpu runs the same script as a smoke test (--preset tiny)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--length", type=int, default=256, help="tokens per row, padding included")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_parity.py needs a CUDA GPU (none found); on CPU: "
                         "tests/test_model.py, or this script with --device cpu --preset tiny")
    transformers = __import__("transformers")
    transformers.utils.logging.disable_progress_bar()
    cfg = preset(args.preset, **({"vocab_size": 512} if args.preset == "tiny" else {}))
    L = cfg.num_hidden_layers
    with tempfile.TemporaryDirectory() as d:
        hf_checkpoint(cfg, d)
        inputs = batch(cfg.vocab_size, args.rows, args.length, args.device)
        bf16 = logits_of(d, None, args.device, inputs)
        fp32 = logits_of(d, torch.float32, args.device, inputs)
        flash_error = flash_trains(d, args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.preset} saved by transformers {transformers.__version__} in bf16; "
          f"{len(fp32['ours'])} tokens on {where}")
    z32, z16 = fp32["hf"], bf16["hf"]
    fp32_gap = float((fp32["ours"] - z32).abs().max())
    fp32_bound = 64 * EPS * L * float(z32.abs().max())
    bf16_gap, bf16_bound = rms(bf16["ours"] - z16), 4 * U * L**0.5 * rms(z16)
    checks = [
        ("our loader's dtype, from config.json (bf16)", str(bf16["dtype"])[6:], "bfloat16",
         bf16["dtype"] == torch.bfloat16),
        ("fp32: max |ours - transformers|", fp32_gap, fp32_bound, fp32_gap <= fp32_bound),
        ("bf16: rms(ours - transformers)", bf16_gap, bf16_bound, bf16_gap <= bf16_bound),
        ("training forward on FlashAttention alone", flash_error or "ran", "ran",
         not flash_error),
        ("  (information) bf16: max |ours - transformers|",
         float((bf16["ours"] - z16).abs().max()), None, True),
        ("  (information) rms(ours bf16 - fp32)", rms(bf16["ours"] - z32), None, True),
        ("  (information) rms(transformers bf16 - fp32)", rms(z16 - z32), None, True),
        ("  (information) rms of the fp32 logits", rms(z32), None, True),
    ]
    print(f"{'check':<52} {'measured':>12} {'bound':>10}  result")
    for what, measured, bound, passed in checks:
        value = f"{measured:12.4g}" if isinstance(measured, float) else f"{measured:>12}"
        limit = "" if bound is None else f"{bound:10.3g}" if isinstance(bound, float) else bound
        print(f"{what:<52} {value} {limit:>10}  {'ok' if passed else 'FAILED'}")
    sys.exit(0 if all(passed for *_, passed in checks) else 1)


if __name__ == "__main__":
    main()
