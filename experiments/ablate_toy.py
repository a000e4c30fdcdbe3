"""
The ablation's toy task and base model: a task where each DAPO technique has a failure to fix.

The demo's task (toy.py) is too easy to tell the techniques apart: every variant learns it in a few
steps. Here the problems are additions "a+k" (a in 0-59, k in 1-9), which the base model answers in
two ways:
- direct, "in its head": "Answer: 43". It recalls the sums of small k and guesses at large k:
  problems of mixed difficulty, so easy groups are all right and hard ones all wrong, and neither
  carries a gradient (dynamic sampling, paper Sec. 3.2);
- counting on, rarely (ABL_WORK_PROB): one line per unit moved across, "= 35+8", "= 36+7", ...
  "= 43", nearly always right. RL has to raise this low-probability choice (clip-higher, Sec. 3.1).
Most of the time it also rambles, repeating "Let me check." up to ABL_RAMBLE_REPEATS times before
the answer, so lengths range from 5 to 96 tokens and rambling is cheap (the token-level loss,
Sec. 3.3). Counting on for k = 9 takes 69 tokens, under ABL_MAX_RESPONSE_LEN - ABL_OVERLONG_BUFFER,
but not with much rambling after it: truncation then cuts off a sound working with its Answer line,
and the response scores -1 (overlong shaping, Sec. 3.4).
Each line of the working follows from the line above (add one, take one away), which a 2-layer model
learns in a two-minute warm-up; looking up the i-th term of a longer prompt, it does not.
Rows follow the DAPO schema with data_source "toy_sum" (reward.py's math_dapo check), written to
JSONL files that dapo.py loads with --train-data / --val-data; the tokenizer is the demo's
(toy.make_toy_tokenizer).
"""
import json
import random
import zlib

from model import Transformer
from toy import TOY_DATA_SOURCE, TOY_FILLER, TOY_TEST_BUCKETS, warmed_up_model

# "a+k": 540 problems, 1 in 5 held out (by a hash of the text)
ABL_A, ABL_K = range(0, 60), range(1, 10)
ABL_WORK_PROB = 0.1  # a warm-up response counts on...
ABL_STEP_ERROR = 0.02  # ...and a line of the counting slips by +-1 with this chance
# how often a direct answer is exact, by k
DIRECT_EXACT = (0.97, 0.95, 0.9, 0.8, 0.1, 0.05, 0.02, 0.02, 0.02)
ABL_RAMBLE_PROB = 0.6  # a warm-up response repeats the filler before its answer...
ABL_RAMBLE_REPEATS = (1, 20)  # ...this many times (5 tokens each)
ABL_MAX_RESPONSE_LEN, ABL_OVERLONG_BUFFER = 96, 16


def problem_text(a, k) -> str:
    return f"{a}+{k}"


def split_of(a, k) -> str:
    return "test" if zlib.crc32(problem_text(a, k).encode()) % TOY_TEST_BUCKETS == 0 else "train"


def ablation_problems(split: str) -> list[tuple[int, int]]:
    return [(a, k) for a in ABL_A for k in ABL_K if split_of(a, k) == split]


def ablation_rows(split: str = "train") -> list[dict]:
    """Every problem of the split once, in the DAPO row schema (dapo.py's data iterator shuffles
    them)."""
    return [{"data_source": TOY_DATA_SOURCE,
             "prompt": [{"role": "user", "content": problem_text(a, k)}], "ability": "arithmetic",
             "reward_model": {"ground_truth": str(a + k), "style": "rule"},
             "extra_info": {"split": split, "index": i, "k": k}}
            for i, (a, k) in enumerate(ablation_problems(split))]


def write_rows(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def counting_on(a, k, rng: random.Random) -> tuple[str, int]:
    """Move one across per line: "= 35+8", "= 36+7", ..., "= 43"; a line slips by +-1 with
    ABL_STEP_ERROR."""
    lines = []
    while k > 0:
        a, k = a + 1 + (rng.choice((-1, 1)) if rng.random() < ABL_STEP_ERROR else 0), k - 1
        lines.append(f"= {a}+{k}" if k else f"= {a}")
    return "\n".join(lines), a


def ablation_response(a, k, rng: random.Random, work_prob=ABL_WORK_PROB) -> str:
    """One warm-up response: counted on or direct, maybe filler, then the Answer line."""
    lines = []
    if rng.random() < work_prob:
        text, answer = counting_on(a, k, rng)
        lines.append(text)
    else:
        answer = a + k
        if rng.random() >= DIRECT_EXACT[k - 1]:  # a miscount: off by one twice as often as by two
            answer = max(0, answer + rng.choice((-1, 1, -2, -1, 1, 2)))
    if rng.random() < ABL_RAMBLE_PROB:
        lines.append(" ".join([TOY_FILLER] * rng.randint(*ABL_RAMBLE_REPEATS)))
    return "\n".join(lines + [f"Answer: {answer}"])


def ablation_warmup_pairs(n: int, seed: int, skill: int = 0) -> list[tuple[list[dict], str]]:
    """n (prompt messages, response) pairs on training problems: the base model's supervised
    warm-up. The first `skill` of them count on half the time (the skill is learned), the rest
    ABL_WORK_PROB of the time (how often the base model uses it), as a base model can reason but
    mostly does not."""
    rng = random.Random(f"ablate-warmup-{seed}")
    problems = ablation_problems("train")
    pairs = []
    for i in range(n):
        a, k = rng.choice(problems)
        response = ablation_response(a, k, rng, 0.5 if i < skill else ABL_WORK_PROB)
        pairs.append(([{"role": "user", "content": problem_text(a, k)}], response))
    return pairs


def is_worked(response: str) -> bool:
    """The response counts on (it starts with the first line of the working, "= ...")."""
    return response.startswith("= ")


def filler_repeats(response: str) -> int:
    return response.count(TOY_FILLER)


# ------------------------------------------------------------------------------------------------
# The base model: a supervised warm-up, in the open, as toy.demo_base_model's

ABL_WARMUP = dict(steps=800, skill_steps=600, batch_size=64, lr=5e-3, preset="tiny")


def ablation_base_model(tok, device="cpu", seed=0, cache_root="runs/ablate-base") -> Transformer:
    """A tiny Qwen2 fitted to ablation_warmup_pairs() by next-token prediction; cached, keyed by its
    settings and a sample of its data (measured: ~2 min on one thread of an idle machine, ~6 min on
    a busy one)."""
    sample = json.dumps(ablation_warmup_pairs(64, seed=seed))
    key = dict(ABL_WARMUP, seed=seed, vocab=tok.vocab_size, data=zlib.crc32(sample.encode()))
    skill = ABL_WARMUP["skill_steps"] * ABL_WARMUP["batch_size"]
    return warmed_up_model(tok, key, lambda n: ablation_warmup_pairs(n, seed, skill=skill),
                           device=device, cache_root=cache_root, label="ablation warm-up",
                           log_every=100)
