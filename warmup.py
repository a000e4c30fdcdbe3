"""
The demo's "base model": a tiny Qwen2 given a brief supervised warm-up on the toy task, in the open.

DAPO starts from a pretrained base model that already writes in the expected format and sometimes gets the answer
right (Qwen2.5-32B base: ~0 on AIME with greedy answers, but right now and then when sampled). A randomly initialised
model never emits "Answer: ..." at all, so every reward would be -1 and RL would have nothing to learn from. So, like
pretraining, we fit the tiny model by next-token prediction to noisy worked solutions (data.toy_warmup_pairs: correct
format, arithmetic slips in some of them, some rambling). The result samples the right answer only some of the time;
the RL phase in dapo.py is what makes it reliable. The warm-up is cached (like a downloaded checkpoint), keyed by its
settings, so repeated demo runs skip it.
"""
import json
import math
import os
import time
import zlib

import torch
import torch.nn.functional as F

from data import toy_warmup_pairs
from model import Qwen2, preset

WARMUP = dict(steps=400, batch_size=64, lr=5e-3, preset="demo")  # measured: loss ~0.17, held-out acc ~0.3


def demo_base_model(tok, device="cpu", seed=0, cache_root="runs/demo-base") -> Qwen2:
    sample = json.dumps(toy_warmup_pairs(64, seed=seed))  # a change to the toy task's data invalidates the cache
    key = dict(WARMUP, seed=seed, vocab=tok.vocab_size, data=zlib.crc32(sample.encode()))
    cache = os.path.join(cache_root, "_".join(f"{k}{v}" for k, v in key.items()))
    if os.path.isfile(os.path.join(cache, "warmup.json")):
        return Qwen2.from_pretrained(cache, dtype=torch.float32, device=device)
    torch.manual_seed(seed)
    model = Qwen2(preset(WARMUP["preset"], vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_ids)).to(device)
    steps, batch = WARMUP["steps"], WARMUP["batch_size"]
    examples = [(tok.apply_chat_template(messages), tok.encode(response) + [tok.eos_token_ids[0]])
                for messages, response in toy_warmup_pairs(steps * batch, seed=seed)]  # each example seen once
    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:  # 20 steps of linear warm-up, then cosine decay to 10%
            group["lr"] = WARMUP["lr"] * min(1, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        loss = sft_loss(model, examples[step * batch:(step + 1) * batch], tok.pad_token_id, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"warm-up {step:4d}/{steps}  loss {loss.item():.3f}  ({time.time() - t0:.0f}s)", flush=True)
    model.save_pretrained(cache)
    with open(os.path.join(cache, "warmup.json"), "w") as f:  # written last: its presence marks a complete cache
        json.dump(key, f)
    return model


def sft_loss(model, examples, pad_id, device):
    """Next-token cross-entropy on the response tokens only (the prompt is given, not learned)."""
    T = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), T), -100, dtype=torch.long)
    for i, (p, r) in enumerate(examples):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p):len(p) + len(r)] = torch.tensor(r)
    ids, labels = ids.to(device), labels.to(device)
    logits = model(ids[:, :-1])  # right padding and a causal mask: the pads after a sequence never affect it
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
