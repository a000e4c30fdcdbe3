"""
Sums of two small numbers ("What is 7 + 12?"), the task on which `make real` trains
SmolLM2-135M-Instruct with DAPO. Written as plain dapo.py rows, a training file and a held-out one:

    python -m examples.sums --out-dir runs/real/data     # train.jsonl, val.jsonl
    python dapo.py --train-data runs/real/data/train.jsonl --val-data runs/real/data/val.jsonl \\
        --reward-fn examples/sums.py:score --model runs/models/SmolLM2-135M-Instruct ...

Why this task: the base model knows the sums but at temperature 1 it mostly rambles (about a
quarter of its answers end on the right number; sums of two-digit numbers, or of three digits,
were right under 5% of the time, too rare for a group of 8 to hold a right one). So RL has
something to find and it is not done yet.

score() is the verifier (--reward-fn's FILE.py:NAME): +1 when the last integer in the response is
the sum, -1 otherwise. The model's own style ("7 + 12 = 19.") counts; no answer format is asked.

The split is by unordered pair: "5 + 3" and "3 + 5" fall on the same side, so no validation
problem is a training problem with its terms swapped.
"""
import argparse
import json
import os
import random
import re

INTEGER = re.compile(r"-?\d+")
TAIL = 300  # characters read from the end of a response, as math_dapo reads


def score(response_text: str, ground_truth: str) -> dict:
    """+1 (acc) when the last integer of the response's last 300 characters equals ground_truth,
    else -1. Thousands separators are dropped first ("1,000" is 1000)."""
    found = INTEGER.findall(response_text[-TAIL:].replace(",", ""))
    acc = bool(found) and int(found[-1]) == int(ground_truth)
    return {"score": 1.0 if acc else -1.0, "acc": acc}


def split_pairs(max_number: int, val_problems: int, seed: int) -> tuple[list, list]:
    """Every ordered (a, b) with 0 <= a, b <= max_number, split by unordered pair: shuffled pairs
    go to validation until it holds at least val_problems problems, the rest to training.
    Returns (train, val), each a list of (a, b)."""
    pairs = [(a, b) for a in range(max_number + 1) for b in range(a, max_number + 1)]
    random.Random(seed).shuffle(pairs)
    train, val = [], []
    for a, b in pairs:
        problems = [(a, b)] if a == b else [(a, b), (b, a)]
        (val if len(val) < val_problems else train).extend(problems)
    if not train:
        raise ValueError(f"numbers up to {max_number} make {len(val)} problems: none left to "
                         f"train on after {val_problems} held out")
    return train, val


def row(a: int, b: int) -> dict:
    """A plain dapo.py row: the question as the user's message, the sum as the ground truth."""
    return {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}


def write_rows(path: str, problems: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for a, b in problems:
            f.write(json.dumps(row(a, b)) + "\n")


def write_task(out_dir: str, max_number: int = 12, val_problems: int = 64,
               seed: int = 0) -> tuple[str, str]:
    """train.jsonl and val.jsonl in out_dir; returns their paths."""
    train, val = split_pairs(max_number, val_problems, seed)
    os.makedirs(out_dir, exist_ok=True)
    paths = os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "val.jsonl")
    for path, problems in zip(paths, (train, val)):
        write_rows(path, problems)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="runs/real/data",
                        help="train.jsonl and val.jsonl go here (default: %(default)s)")
    parser.add_argument("--max-number", type=int, default=12,
                        help="the largest term (default: %(default)s)")
    parser.add_argument("--val-problems", type=int, default=64,
                        help="held-out problems, at least (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the split (default: %(default)s)")
    args = parser.parse_args(argv)
    paths = write_task(args.out_dir, args.max_number, args.val_problems, args.seed)
    for path in paths:
        with open(path) as f:
            print(f"{path}: {sum(1 for _ in f)} problems")


if __name__ == "__main__":
    main()
