"""
The reward of a response: is its final answer right (+1 / -1), plus DAPO's overlong shaping
(paper Eq. 13).

The answer check is math_dapo, the verifier of the DAPO run (verl
`verl/utils/reward_score/math_dapo.py`, itself adapted from Minerva / lm-evaluation-harness). It
reads the LAST line of the form "Answer: ..." in the last 300 characters of the response, normalises
that text and the ground truth with the same fixed list of string edits, and compares the two as
strings. No symbolic maths: "1/2" and "0.5" differ, "\\frac12" and "\\frac{1}{2}" agree.

The edits below are data, applied in math_dapo's order, which is part of the semantics (removing
"\\text{}" before "\\text{}^2" would leave a stray "^2"); tests/test_reward.py pins the edge cases.

Model output is untrusted: nothing here executes or evaluates it, and only its last 300 characters
are read, so every call is fast whatever the response.

A run's Verifier scores each row with the verifier of its data_source (SCORERS: math_dapo, and
verl's GSM8K and MATH ones from infra/scorers.py) or with your --reward-fn FILE.py:NAME, which
infra/reward_fn.py loads and calls safely.
"""
import functools
import re
from dataclasses import dataclass

from infra import scorers
from infra.errors import UserError
from infra.reward_fn import RewardFn

WINDOW = 300  # characters read from the end of a response (the longest MATH-500 answer has 159)
ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # the rest of the line after "Answer:"
NO_ANSWER = "[INVALID]"  # the prediction when no "Answer:" line is found (normalised too)

# --- normalisation, step 1: literal replacements (old, new), in order -----------------------------
REPLACEMENTS = [
    ("an ", ""),  # "an integer" -> "integer" (and, as a side effect, "Logan " -> "Log")
    ("a ", ""),
    (".$", "$"),  # a sentence's full stop inside the closing dollar
    ("\\$", ""),  # an escaped dollar sign: "\$5" -> "5"
    ("\\ ", ""),  # a LaTeX forced space
    (" ", ""),  # every remaining space
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),  # metres; the empty \text{} is removed in step 2
]

# --- step 2: substrings deleted, in order (unit words, then LaTeX leftovers) ----------------------
REMOVED = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples",
    # "\n": a newline
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
]

# --- step 3: regex rewrites (pattern, replacement), in order --------------------------------------
# Each does what math_dapo's re.sub quoted above it does (`.` stops at a newline, as upstream), in
# linear time: upstream's patterns scan from every start position to the end of the line where no
# "$" or "}" closes it, quadratic in C where no timer reaches (a 16 KB ground truth took 1.5 s, 4x
# that at each doubling). tests/test_reward.py checks each against upstream's.

def _inside_or_kept(match: re.Match) -> str:
    """X of an opener's "{X}", or the rest of the line as it was when no "}" closes the opener
    (upstream leaves it, and every later opener of the line, unmatched)."""
    return match[0] if match[1] is None else match[1]


REWRITES = [
    # keep only the first $...$ span of a line holding two "$": (.*?)(\$)(.*?)(\$)(.*) -> $\3$
    (re.compile(r"^[^$\n]*\$([^$\n]*)\$.*", re.MULTILINE), r"$\1$"),
    # \text{X} -> X, X stopping at the first "}": (\\text\{)(.*?)(\}) -> \2
    (re.compile(r"\\text\{(?:([^}\n]*)\}|.*)"), _inside_or_kept),
    (re.compile(r"\\textbf\{(?:([^}\n]*)\}|.*)"), _inside_or_kept),
    (re.compile(r"\\overline\{(?:([^}\n]*)\}|.*)"), _inside_or_kept),
    # \boxed{X} -> X, X running to the last "}" of the line (greedy): (\\boxed\{)(.*)(\}) -> \2
    (re.compile(r"\\boxed\{(?:(.*)\}|.*)"), _inside_or_kept),
    # \frac12 -> \frac{1}{2}, \frac123 -> \frac{1}{2}3
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),  # \sqrt2 -> \sqrt{2}
]


def normalize(answer: str) -> str:
    """math_dapo's normalize_final_answer: the text after the last "=", then the three steps above,
    then "$" removed, commas dropped from a plain number ("1,000" -> "1000"), surrounding whitespace
    stripped."""
    # exercise: normalize
    s = answer.rpartition("=")[2]  # "x = 3" -> " 3"; no "=" keeps everything
    for old, new in REPLACEMENTS:
        s = s.replace(old, new)
    for junk in REMOVED:
        s = s.replace(junk, "")
    for pattern, repl in REWRITES:
        s = pattern.sub(repl, s)
    s = s.replace("$", "")
    # NOTE: str.isdigit, so "²" and "٣" count as digits, exactly as upstream
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()
    # end exercise


def extract_answer(response: str) -> str:
    """The text after the last "Answer:" in the last WINDOW characters, or NO_ANSWER. "Last" means
    the last match of a left-to-right scan: a match takes the rest of its line, so
    "Answer: 5 Answer: 6" yields "5 Answer: 6"."""
    # exercise: extract_answer
    found = ANSWER_RE.findall(response[-WINDOW:])
    return found[-1] if found else NO_ANSWER
    # end exercise


def compute_score(solution_str: str, ground_truth: str) -> dict:
    """math_dapo.compute_score on its default (non-strict) path:
    {"score": +1.0 or -1.0, "acc": bool, "pred": str}, pred being the normalised prediction.
    solution_str is the decoded response without special tokens."""
    if not isinstance(solution_str, str) or not isinstance(ground_truth, str):
        raise TypeError(f"compute_score takes two strings, got {type(solution_str).__name__} and "
                        f"{type(ground_truth).__name__} (ground truths are strings, e.g. '34')")
    pred = normalize(extract_answer(solution_str))
    acc = pred == normalized_ground_truth(ground_truth)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def found_answer(result: dict) -> bool:
    """Whether the verifier found an answer in the response it scored (math_dapo's "[INVALID]"
    case: normalize leaves "[INVALID]" as it is; infra/scorers.py's None). A custom verifier's
    responses count as answered: it says only right or wrong."""
    return result.get("pred") not in (NO_ANSWER, None)


@functools.lru_cache(maxsize=2**16)
def normalized_ground_truth(ground_truth: str) -> str:
    """normalize(ground_truth), once per distinct ground truth: a group's G responses share one,
    which may be long (a row's text is not bounded). A prediction needs no cache: it is cut to
    WINDOW characters first."""
    return normalize(ground_truth)


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (paper Eq. 13), times `factor` (1.0 in the DAPO run):

        0                                       if length <= max_len - buffer_len
        ((max_len - buffer_len) - length) / buffer_len   if max_len - buffer_len < length <= max_len
        -1                                      if length > max_len

    length counts the response's tokens including EOS. The penalty is added to the correctness
    reward, so a response cut at max_len that has no answer gets -2."""
    # exercise: overlong_penalty
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    if length > max_len:
        return -1.0 * factor
    return (expected - length) / buffer_len * factor
    # end exercise


# The CPU demo's toy task (toy.py): math_dapo scores it too, so the demo runs the real verifier
TOY_DATA_SOURCE = "toy_sum"
# Which verifier scores a row, by its data_source, as verl's default_compute_score dispatches
SCORERS = {
    "math_dapo": compute_score,  # DAPO-Math-17k
    "math": compute_score,  # verl's other names for math_dapo's rows
    "math_dapo_reasoning": compute_score,
    TOY_DATA_SOURCE: compute_score,
    **scorers.VERL_SCORERS,  # GSM8K and MATH, scored as verl scores them (infra/scorers.py)
}


def scorer_for(data_source: str):
    """The built-in verifier of a data_source, or None. Any data_source starting with "aime" also
    goes to math_dapo, as in verl (the AIME-2024 eval set). A Verifier adds --reward-fn's."""
    if data_source.startswith("aime"):
        return compute_score
    return SCORERS.get(data_source)


def has_built_in_verifier(data_source: str) -> bool:
    """Whether a built-in verifier (SCORERS) rewards rows of this data_source; a run's Verifier
    also rewards, with --reward-fn, the rows of any other (Verifier.rewards)."""
    return scorer_for(data_source) is not None


def verify_built_in(data_source: str, response_text: str, ground_truth: str) -> dict:
    """The verdict of its row's built-in verifier on one decoded response: {"score", "acc",
    "pred"} (the verifiers keep verl's name for the number, score: +1 right, -1 wrong)."""
    scorer = scorer_for(data_source)
    if scorer is None:
        raise UserError(f"no reward function for data_source {data_source!r}; known: "
                        f"{sorted(SCORERS)} and 'aime*'")
    return scorer(response_text, ground_truth)


@dataclass
class Verdicts:
    """The verifier's verdict on each response of a rollout (batch.Batch.from_rollout's input)."""
    score: list[float]  # +1 right, -1 wrong (or --reward-fn's own number)
    acc: list[bool]  # the answer is right
    no_answer: list[bool]  # the verifier found no answer to read
    reward_error: list[bool] | None  # --reward-fn raised on it; None without --reward-fn


# --------------------------------------------------------------------------------------------------
# The verifier a run builds: the built-in ones above, and with --reward-fn FILE.py:NAME your own
# (infra/reward_fn.py loads it and calls it safely)

@dataclass
class Verifier:
    """A run's verifier: the built-in one of each row's data_source and, with --reward-fn, your
    function, for the rows no built-in one scores (or for every row: every_row). launch.py builds
    one a run; rollouts, evaluations and the alarms are handed it.

        Verifier()                                  the built-in verifiers alone
        Verifier.load("mine.py:score", False, 30)   and yours, a call over 30 s a wrong answer
    """
    reward_fn: RewardFn | None = None
    every_row: bool = False

    @classmethod
    def load(cls, spec: str, every_row: bool, timeout_s: float = 0.0) -> "Verifier":
        return cls(RewardFn.load(spec, timeout_s), every_row)

    @property
    def spec(self) -> str:
        """--reward-fn's "FILE.py:NAME", "" without it."""
        return self.reward_fn.spec if self.reward_fn else ""

    def verifies_with_reward_fn(self, data_source: str) -> bool:
        """Whether --reward-fn (if given) gives the verdicts on the rows of this data_source."""
        return self.reward_fn is not None and (self.every_row or
                                               not has_built_in_verifier(data_source))

    def built_in_data_sources(self) -> list[str]:
        """The data_sources a built-in verifier scores, for the error that a row has none."""
        return sorted(SCORERS) + ["aime*"]

    def rewards(self, data_source: str) -> bool:
        """Whether this run can reward rows of this data_source, by a built-in verifier or by
        --reward-fn: data.py checks every row on load, not when it is drawn."""
        return self.reward_fn is not None or has_built_in_verifier(data_source)

    def verify(self, data_source: str, response_text: str, ground_truth: str) -> dict:
        """The verdict on one decoded response for its row's data_source: {"score", "acc",
        "pred"}, from --reward-fn or the built-in verifier."""
        if self.verifies_with_reward_fn(data_source):
            return self.reward_fn.verify(data_source, response_text, ground_truth)
        return verify_built_in(data_source, response_text, ground_truth)

    def verify_rollout(self, rows: list[dict], group_size: int, texts: list[str]) -> Verdicts:
        """The verdicts on the G = group_size responses to each row (texts, group after group),
        each from its row's verifier."""
        row_of_each_text = [row for row in rows for _ in range(group_size)]
        results = [self.verify(row["data_source"], text, row["reward_model"]["ground_truth"])
                   for row, text in zip(row_of_each_text, texts)]
        errors = [bool(r.get("reward_fn_error")) for r in results]
        return Verdicts(score=[r["score"] for r in results],
                        acc=[bool(r["acc"]) for r in results],
                        no_answer=[not found_answer(r) for r in results],
                        reward_error=errors if self.reward_fn is not None else None)

    def check(self, example_ground_truth: str):
        """One call of --reward-fn on the ground truth of a row it scores (RewardFn.check): a
        wrong signature or type stops the run before it starts."""
        self.reward_fn.check(example_ground_truth)

    def take_errors(self) -> str:
        """--reward-fn's first error since the last call, or "" (RewardFn.take_errors)."""
        return self.reward_fn.take_errors() if self.reward_fn else ""
