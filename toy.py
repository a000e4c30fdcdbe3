"""
The toy task of the CPU demo, and the demo's "base model" trained on it.

The task: sums of 2-3 digits from 0 to 5 ("3+5+2"), answered with the sum in the `Answer: ...`
format that the real math_dapo verifier reads. Rows follow the DAPO schema, so the loop cannot tell
them from DAPO-Math-17k. Held-out problems (a hash of the problem text) are never seen in warm-up or
RL, but each of their steps (running sum + next term) is a step of some training problem.

The base model: DAPO starts from a pretrained model that already writes in the expected format and
is right now and then; a randomly initialised one never writes "Answer: ...", so every reward would
be -1 and RL would have nothing to learn. So demo_base_model() fits a tiny Qwen2 by next-token
prediction to noisy responses (toy_warmup_pairs()) of two kinds:
- worked: a running sum, then the answer ("3+5=8, 8+2=10.\nAnswer: 10"), right unless a step slips
  (probability TOY_STEP_ERROR); a fraction TOY_WORK_PROB (half) of the responses;
- direct: "Answer: 12", a guess, right about 1 time in 16.
So the base model can solve most problems but half the time does not bother: held-out accuracy
starts near 0.3 while pass@4 is 0.65-0.85. That is what RL on a real base model works with at
scale: the reward teaches the model to use the reasoning it already has (more warm-up would only
teach the same mixture). A fraction TOY_RAMBLE of the responses repeat a filler sentence before the
answer, so some run past TOY_MAX_RESPONSE_LEN and lose their Answer line: overlong shaping and the
token-level loss have something to act on (paper Sec. 3.3-3.4). The warm-up is cached like a
downloaded checkpoint, keyed by its settings.
"""
import functools
import itertools
import json
import math
import os
import random
import time
import zlib

import torch
import torch.nn.functional as F
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

import reward
from data import Tokenizer, load_tokenizer
from infra import distributed
from infra.errors import UserError
from model import ModelConfig, Transformer, preset

TOY_DATA_SOURCE = reward.TOY_DATA_SOURCE
TOY_MIN_TERMS, TOY_MAX_TERMS = 2, 3  # terms per problem...
# ...each in [0, TOY_MAX_DIGIT]: few enough addition facts for a 2-minute warm-up to learn
TOY_MAX_DIGIT = 5
# chance that a warm-up response works the sum out step by step... (with fewer worked examples,
# some seeds give a base model that miscopies the terms, which RL keeps)
TOY_WORK_PROB = 0.5
TOY_GUESS_MAX = 15  # ...otherwise it states a guess, uniform in [0, TOY_GUESS_MAX]
TOY_STEP_ERROR = 0.05  # chance that a step of the working slips...
TOY_SLIPS = (-2, -1, 1, 2)  # ...by one of these, equally likely
TOY_RAMBLE = 0.4  # chance that a warm-up response repeats filler before its answer...
TOY_RAMBLE_REPEATS = (1, 8)  # ...this many times (inclusive range)
TOY_FILLER = "Let me check."
# 1 problem in 5 (by a hash of its text) is held out for evaluation, less those that take a step
# no training problem takes (see held_out_problems): 49 of the 252
TOY_TEST_BUCKETS = 5
# one token each; digits stay single
TOY_WORDS = ["user", "assistant", "Answer", "Let", " Let", " me", " check"]
# suggested demo limits: no plain response is penalised
TOY_MAX_RESPONSE_LEN, TOY_OVERLONG_BUFFER = 40, 16
TOY_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                     "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2's pre-tokenizer regex: letters group into words, every digit is its own piece
QWEN_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of every byte-level BPE (space is "Ġ",
    newline "Ċ")."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), 256)))
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _toy_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The toy tokenizer's BPE vocabulary (the 256 bytes, then TOY_WORDS) and merges."""
    byte_char = _bytes_to_unicode()
    vocab = {byte_char[b]: b for b in range(256)}
    merges = []
    for word in TOY_WORDS:  # build each word left to right: ("Ġ", "m"), ("Ġm", "e"), ...
        pieces = [byte_char[b] for b in word.encode()]
        for piece in pieces[1:]:
            merges.append((pieces[0], piece))
            pieces[0] += piece
            vocab.setdefault(pieces[0], len(vocab))
    return vocab, merges


TOY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # after the BPE vocabulary


def demo_model_config() -> ModelConfig:
    """The demo's base model's shape (its vocabulary is the toy tokenizer's), built from nothing."""
    return preset(WARMUP["preset"], vocab_size=len(_toy_vocab()[0]) + len(TOY_SPECIAL_TOKENS))


def make_toy_tokenizer(out_dir: str) -> Tokenizer:
    """Write a Qwen-style tokenizer for the toy task into out_dir (tokenizer.json,
    tokenizer_config.json with the chat template, generation_config.json) and load it back through
    load_tokenizer, the path a real checkpoint takes. Byte-level BPE with Qwen2's normaliser,
    pre-tokenizer and decoder: the 256 bytes, a few whole-word tokens, and <|endoftext|>,
    <|im_start|>, <|im_end|>. Any text round-trips exactly."""
    vocab, merges = _toy_vocab()
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in TOY_SPECIAL_TOKENS])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in TOY_SPECIAL_TOKENS}
    config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 1024,
              "chat_template": TOY_CHAT_TEMPLATE}
    generation = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                  "pad_token_id": ids["<|endoftext|>"]}
    for name, content in (("tokenizer_config.json", config),
                          ("generation_config.json", generation)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
    return load_tokenizer(out_dir)


def toy_steps(terms) -> list[tuple[int, int]]:
    """The steps of a worked answer: (running sum, next term), e.g. 4+5+4 -> (4, 5), (9, 4)."""
    return [(sum(terms[:i]), t) for i, t in enumerate(terms) if i > 0]


def held_out_problems() -> frozenset[str]:
    """The test split: the problems whose hash falls in bucket 0, less those with a step that no
    training problem takes (10+t occurs only in 5+5+t: held out, it is an addition training never
    shows, which a 2-layer model can only guess). Held-out problems are new combinations of steps
    that training shows, the generalisation the demo is about."""
    return _held_out(*_task())[1]


def _task() -> tuple[int, int, int, int]:
    return TOY_MIN_TERMS, TOY_MAX_TERMS, TOY_MAX_DIGIT, TOY_TEST_BUCKETS


@functools.cache  # keyed by the task's constants, so a changed constant gets its own split
def _held_out(min_terms: int, max_terms: int, max_digit: int,
              buckets: int) -> tuple[list[tuple[int, ...]], frozenset[str]]:
    """The test split: its problems as term tuples (sorted), and as texts."""
    problems = [p for n in range(min_terms, max_terms + 1)
                for p in itertools.product(range(max_digit + 1), repeat=n)]  # term tuples
    bucket_0 = {p for p in problems if zlib.crc32(_text(p).encode()) % buckets == 0}
    training_steps = {step for p in problems if p not in bucket_0 for step in toy_steps(p)}
    held = sorted(p for p in bucket_0 if all(step in training_steps for step in toy_steps(p)))
    return held, frozenset(map(_text, held))


def _text(terms) -> str:
    return "+".join(map(str, terms))


def _toy_problems(n: int, seed: int, split: str, stream: str):
    """n problems (lists of digits) of one split, and the split's generator. Training problems are
    drawn i.i.d.: a uniform number of terms, uniform digits. Held-out ones come in passes over the
    49, each in a new order, so that each weighs the same in val/acc (drawn like the training ones,
    the 7 two-term problems would make half the test rows). Each stream ("rows", "warmup") has its
    own random sequence, so warm-up and RL problems are independent draws."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"toy-{stream}-{split}-{seed}")
    problems = []
    if split == "test":
        while len(problems) < n:
            one_pass = [list(p) for p in _held_out(*_task())[0]]
            rng.shuffle(one_pass)
            problems += one_pass
        return problems[:n], rng
    while len(problems) < n:
        terms = [rng.randrange(TOY_MAX_DIGIT + 1)
                 for _ in range(rng.randint(TOY_MIN_TERMS, TOY_MAX_TERMS))]
        if _text(terms) not in held_out_problems():
            problems.append(terms)
    return problems, rng


def toy_rows(n: int, seed: int, split: str = "train") -> list[dict]:
    """n toy rows in the DAPO row schema, data_source TOY_DATA_SOURCE. The splits never share
    a problem."""
    problems, _ = _toy_problems(n, seed, split, "rows")
    return [{"data_source": TOY_DATA_SOURCE,
             "prompt": [{"role": "user", "content": _text(terms)}],
             "ability": "arithmetic",
             "reward_model": {"ground_truth": str(sum(terms)), "style": "rule"},
             "extra_info": {"split": split, "index": i}} for i, terms in enumerate(problems)]


def toy_response(terms: list[int], rng: random.Random) -> str:
    """One "base model" response: worked (a running sum, rarely slipping) or a direct guess, maybe
    filler, then the Answer line."""
    lines = []
    if rng.random() < TOY_WORK_PROB:
        total, steps = terms[0], []
        for t in terms[1:]:
            s = total + t
            if rng.random() < TOY_STEP_ERROR:
                s += rng.choice(TOY_SLIPS)
            steps.append(f"{total}+{t}={s}")
            total = s  # a slip carries forward, as a real mistake would
        lines.append(", ".join(steps) + ".")
    else:
        total = rng.randint(0, TOY_GUESS_MAX)
    if rng.random() < TOY_RAMBLE:
        lines.append(" ".join([TOY_FILLER] * rng.randint(*TOY_RAMBLE_REPEATS)))
    return "\n".join(lines + [f"Answer: {total}"])


def toy_warmup_pairs(n: int, seed: int) -> list[tuple[list[dict], str]]:
    """n (prompt messages, response text) pairs from the train split: the supervised warm-up that
    makes the demo's base model. About half of the answers are right (the module docstring says
    why)."""
    problems, rng = _toy_problems(n, seed, "train", "warmup")
    return [([{"role": "user", "content": _text(terms)}], toy_response(terms, rng))
            for terms in problems]


# --------------------------------------------------------------------------------------------------
# The demo's base model: a brief supervised warm-up, in the open

# expect a last-batch loss near 0.2 and a held-out val/acc of 0.27-0.39 (docs/demo.md)
WARMUP = dict(steps=400, batch_size=64, micro_batches=4, lr=5e-3, preset="demo")


def demo_policy(out_dir: str, device: str, seed: int) -> tuple[str, Transformer]:
    """The embedded demo's policy: the toy tokenizer (written into out_dir/tokenizer) and the
    base model below -> (the tokenizer's directory, the model). Rank 0 trains the base model once
    and caches it; the other ranks then load the cache."""
    tok_dir = os.path.join(out_dir, "tokenizer")
    if distributed.rank() == 0:
        make_toy_tokenizer(tok_dir)
        model = demo_base_model(load_tokenizer(tok_dir), device, seed=seed)
    distributed.barrier()
    if distributed.rank() != 0:
        model = demo_base_model(load_tokenizer(tok_dir), device, seed=seed)
    return tok_dir, model


def demo_base_model(tok, device="cpu", seed=0, cache_root="runs/demo-base") -> Transformer:
    # a change to the toy task's data invalidates the cache
    sample = json.dumps(toy_warmup_pairs(64, seed=seed))
    key = dict(WARMUP, seed=seed, vocab=tok.vocab_size, data=zlib.crc32(sample.encode()))
    return warmed_up_model(tok, key, lambda n: toy_warmup_pairs(n, seed=seed), device=device,
                           cache_root=cache_root)


def kernel_set(device) -> str:
    """The kernels a warm-up on `device` runs: the CPU's (torch's dispatch level, e.g. AVX2, or
    DEFAULT under ATEN_CPU_CAPABILITY=default), or the accelerator's type ("cuda")."""
    device = torch.device(device)
    return torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else device.type


def warmed_up_model(tok, key: dict, make_pairs, device="cpu", cache_root="runs/demo-base",
                    label="warm-up", log_every=50) -> Transformer:
    """A Transformer of preset key["preset"] fitted by next-token prediction to make_pairs(n), n =
    steps x batch_size (prompt messages, response text) pairs seen once each, with AdamW at
    key["lr"], each batch in key["micro_batches"] (default 1; sft_backward); cached under
    cache_root in a directory named by the key (its settings, seed and a checksum of its data)
    and loaded from there next time. The key names the kernels too: another
    kernel set (ATEN_CPU_CAPABILITY=default, a GPU) rounds the warm-up differently."""
    key = dict(key, kernels=kernel_set(device))
    cache = os.path.join(cache_root, "_".join(f"{k}{v}" for k, v in key.items()))
    if os.path.isfile(os.path.join(cache, "warmup.json")):
        try:
            return Transformer.from_pretrained(cache, dtype=torch.float32, device=device)
        except (OSError, ValueError) as e:  # a cut copy, a full disk when it was written
            raise UserError(f"{e}. This is the demo's cached base model, not a download: delete "
                            f"{cache} and the next run warms it up again") from None
    torch.manual_seed(key["seed"])
    config = preset(key["preset"], vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_ids)
    model = Transformer(config).to(device)
    steps, batch = key["steps"], key["batch_size"]
    examples = [(tok.apply_chat_template(messages), tok.encode(response) + [tok.eos_token_ids[0]])
                for messages, response in make_pairs(steps * batch)]
    opt = torch.optim.AdamW(model.parameters(), lr=key["lr"], betas=(0.9, 0.95),
                            weight_decay=0.0)
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:  # 20 steps of linear warm-up, then cosine decay to 10%
            group["lr"] = (key["lr"] * min(1, (step + 1) / 20)
                           * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps))))
        loss = sft_backward(model, examples[step * batch:(step + 1) * batch], tok.pad_token_id,
                            device, key.get("micro_batches", 1))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            print(f"{label} {step:4d}/{steps}  loss {loss:.3f}  "
                  f"({time.time() - t0:.0f}s)", flush=True)
    model.save_pretrained(cache, tokenizer_dir=tok.name or None)  # a complete model directory
    # written last: its presence marks a complete cache
    with open(os.path.join(cache, "warmup.json"), "w") as f:
        json.dump(key, f)
    return model


def sft_backward(model, examples, pad_id, device, micro_batches=1) -> float:
    """Back-propagates the batch's next-token cross-entropy, the mean over all its response
    tokens, in micro-batches of examples sorted by length, each padded to its own longest: the
    gradient of the whole batch at once, up to summation order, with less padding (a rambling
    response is 2-3x the length of the others). Returns the loss."""
    ordered = sorted(examples, key=lambda example: len(example[0]) + len(example[1]))
    n_tokens = sum(len(response) for _, response in examples)
    size = math.ceil(len(ordered) / micro_batches)
    total = 0.0
    for i in range(0, len(ordered), size):
        loss = sft_loss(model, ordered[i:i + size], pad_id, device, reduction="sum") / n_tokens
        loss.backward()
        total += loss.item()
    return total


def sft_loss(model, examples, pad_id, device, reduction="mean"):
    """Next-token cross-entropy on the response tokens only (the prompt is given, not learned)."""
    T = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), T), -100, dtype=torch.long)
    for i, (p, r) in enumerate(examples):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p):len(p) + len(r)] = torch.tensor(r)
    ids, labels = ids.to(device), labels.to(device)
    # right padding and a causal mask: the pads after a sequence never affect it
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                           reduction=reduction)
