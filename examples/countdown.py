"""
Countdown, the task of TinyZero and nano-aha-moment: reach a target from given numbers with
+ - * / and parentheses, each number used exactly once. A second task for dapo.py, generated here:

    python -m examples.countdown --rows 2000 --out countdown.jsonl     # plain {"prompt", "answer"}
    python dapo.py --train-data countdown.jsonl --val-data countdown.jsonl \\
        --reward-fn examples/countdown.py:score

score() is the verifier (--reward-fn's FILE.py:NAME): +1 for an equation that uses the numbers
exactly once and evaluates to the target, -1 otherwise. The model's text is never executed: the
equation is parsed with ast and evaluated with exact fractions.
"""
import argparse
import ast
import json
import operator
import random
import re
from collections import Counter
from fractions import Fraction

ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv}
MAX_CHARS = 200  # an equation longer than this is wrong (and cheap to refuse)


def _evaluate(node, used: list[int]) -> Fraction:
    """An expression of integer literals and + - * / as an exact Fraction; the literals appended
    to used. ValueError on anything else (names, calls, powers, floats)."""
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return OPS[type(node.op)](left, right)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError(f"not allowed in an equation: {ast.dump(node)[:40]}")


def score(response_text: str, ground_truth: str) -> dict:
    """+1 if the last "Answer: ..." line is an equation of exactly the ground truth's numbers that
    equals its target; -1 otherwise. ground_truth is JSON: {"numbers": [...], "target": int}."""
    truth = json.loads(ground_truth)
    found = ANSWER_RE.findall(response_text[-1000:])
    equation = found[-1].strip().rstrip(".") if found else ""
    equation = equation.split("=")[0]  # "3 + 4 = 7" -> "3 + 4"
    used: list[int] = []
    try:
        if not equation or len(equation) > MAX_CHARS:
            raise ValueError("no equation")
        value = _evaluate(ast.parse(equation, mode="eval").body, used)
        acc = value == truth["target"] and Counter(used) == Counter(truth["numbers"])
    except (SyntaxError, ValueError, RecursionError):
        acc = False
    return {"score": 1.0 if acc else -1.0, "acc": acc}


def make_problem(rng: random.Random, count: int, max_number: int) -> tuple[list[int], str, int]:
    """A solvable problem: numbers drawn at random, the target the value of a random equation of
    them (a positive integer up to 1000). Returns (numbers, the equation, target)."""
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        order = rng.sample(numbers, count)
        expression = str(order[0])
        for n in order[1:]:
            expression = f"({expression} {rng.choice('+-*/')} {n})"
        value = _evaluate(ast.parse(expression, mode="eval").body, [])
        if value.denominator == 1 and 0 < value <= 1000:
            return numbers, expression, int(value)


def make_row(rng: random.Random, count: int, max_number: int) -> dict:
    """A plain dapo.py row: {"prompt": the question, "answer": JSON numbers and target}."""
    numbers, _, value = make_problem(rng, count, max_number)
    prompt = (f"Using the numbers {numbers}, each exactly once, and + - * / with parentheses, "
              f"write an equation that equals {value}. End with a line 'Answer: <equation>'.")
    return {"prompt": prompt,
            "answer": json.dumps({"numbers": numbers, "target": value})}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--numbers", type=int, default=3, help="numbers per problem")
    parser.add_argument("--max-number", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="countdown.jsonl")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for _ in range(args.rows):
            f.write(json.dumps(make_row(rng, args.numbers, args.max_number)) + "\n")
    print(f"{args.out}: {args.rows} Countdown rows")


if __name__ == "__main__":
    main()
