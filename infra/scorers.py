"""
verl's other built-in verifiers, scored as verl scores them, so that the rows verl's preprocessing
scripts write train here unchanged. verl's default_compute_score (`verl/utils/reward_score/
__init__.py`) picks a row's verifier by its data_source:

    openai/gsm8k                          gsm8k_score(): the number after the last "####"
    lighteval/MATH,                       math_score(): the last \\boxed{...}, normalised by
    DigitalLearningGmbH/MATH-lighteval,   Hendrycks' strip_string (from the MATH paper's code,
    HuggingFaceH4/MATH-500                via lm-evaluation-harness)
    math, math_dapo_reasoning, aime*      reward.py's math_dapo, as math_dapo rows

Both score 1.0 for a right answer and 0.0 otherwise (verl's scores; math_dapo's are +1 / -1).
The group advantage of Eq. 9 is the same for either pair, (R - mean) / std being blind to a shift
and a scale; the overlong penalty of Eq. 13, added on top, weighs twice as much against the 0-1
gap. Like math_dapo, neither does any maths: the answers are normalised by fixed string edits,
in verl's order, and compared as strings. Model output is never executed. A result's "pred" is
the answer read, or None when the response holds none (reward.found_answer).
"""
import re

# --------------------------------------------------------------------------------------------------
# GSM8K: verl `verl/utils/reward_score/gsm8k.py`, method "strict" (its default), after ReFT (Trung
# et al. 2024): the answer must follow "#### ", as in GSM8K's own solutions

GSM8K_WINDOW = 300  # characters read from the end of the response
GSM8K_ANSWER_RE = re.compile(r"#### (-?[0-9.,]+)")  # one space, then an optional minus and digits
GSM8K_FORMAT_SCORE = 0.0  # verl's format_score: an answer in the format, but a wrong one


def gsm8k_score(solution_str: str, ground_truth: str) -> dict:
    """1.0 when the LAST "#### N" of the response's last GSM8K_WINDOW characters, its commas
    dropped ("#### 1,000" reads 1000), equals the ground truth as a string (verl's preprocessing
    writes it without commas); else GSM8K_FORMAT_SCORE, or 0.0 without any "#### N". No other
    normalisation: "72.0" and "72." are not "72". (verl also deletes "$" from the number, which
    the pattern never captures.)"""
    found = GSM8K_ANSWER_RE.findall(solution_str[-GSM8K_WINDOW:])
    if not found:
        return {"score": 0.0, "acc": False, "pred": None}
    pred = found[-1].replace(",", "")
    acc = pred == ground_truth
    return {"score": 1.0 if acc else GSM8K_FORMAT_SCORE, "acc": acc, "pred": pred}


# --------------------------------------------------------------------------------------------------
# MATH: verl `verl/utils/reward_score/math_reward.py`, adapted from lm-evaluation-harness's
# hendrycks_math (Hendrycks et al. 2021, "Measuring Mathematical Problem Solving With the MATH
# Dataset"). The whole response is read, not only its end.

def last_boxed(text: str) -> str | None:
    """The answer of the response's last box, or None:
    - anywhere "\\boxed " (with a space) occurs, what follows its last occurrence up to the next
      "$" ("\\boxed 5$" -> "5"), even when a \\boxed{...} comes later;
    - else the last "\\boxed", up to the "}" that closes its first "{" (nested braces counted):
      "\\boxed{\\frac{1}{2}}" -> "\\frac{1}{2}". A box never closed, or "\\boxed" not directly
      followed by "{", is no answer.
    verl also finds a last "\\fbox{...}" when there is no "\\boxed", then refuses it (it expects
    "\\boxed{"): it scores 0.0, as no answer does here."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if text[end] == "}" and depth == 0:
            box = text[start:end + 1]
            return box[len("\\boxed{"):-1] if box.startswith("\\boxed{") else None
    return None


class Unnormalisable(ValueError):
    """Where verl's strip_string raises (an assert, an index past the end of a string): its
    is_equiv then compares the two answers as they are."""


# --- strip_string, step 1: literal replacements (old, new), in order ------------------------------
MATH_REPLACEMENTS = [
    ("\n", ""),
    ("\\!", ""),  # a negative thin space
    ("\\\\", "\\"),  # a doubled backslash
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),  # degrees
    ("^\\circ", ""),
    ("\\$", ""),  # an escaped dollar sign
]
# --- step 2: units on the right (units_removed()), then more replacements, in order ---------------
MATH_REPLACEMENTS_AFTER_UNITS = [
    ("\\\\%", ""),  # percent signs
    ("\\%", ""),
    (" .", " 0."),  # a leading zero: " .5" -> " 0.5"
    ("{.", "{0."),
]
INTEGER = re.compile(r"0|-?[1-9][0-9]*")  # as Python prints an int: fix_a_slash_b's test


def units_removed(s: str) -> str:
    """"5 \\text{ cm}" -> "5 ": what precedes the one "\\text{ " (in MATH, a unit always opens
    with a space); two of them are Unnormalisable."""
    parts = s.split("\\text{ ")
    if len(parts) > 2:
        raise Unnormalisable(s)
    return parts[0]


def sqrt_braced(s: str) -> str:
    """"\\sqrt3" -> "\\sqrt{3}": the one character after each \\sqrt, braced. A \\sqrt at the end,
    or right before another, is Unnormalisable."""
    pieces = s.split("\\sqrt")
    for i in range(1, len(pieces)):
        if not pieces[i]:
            raise Unnormalisable(s)
        if pieces[i][0] != "{":
            pieces[i] = "{" + pieces[i][0] + "}" + pieces[i][1:]
    return "\\sqrt".join(pieces)


def fracs_braced(s: str) -> str:
    """"\\frac12" -> "\\frac{1}{2}", "\\frac1{72}" -> "\\frac{1}{72}" (but "\\frac{72}1" stays):
    the two characters after each \\frac, each braced unless it is a "{". A \\frac at the end, or
    right before another, is Unnormalisable; one character after a \\frac leaves s as it was."""
    pieces = s.split("\\frac")
    for i in range(1, len(pieces)):
        piece = pieces[i]
        if not piece:
            raise Unnormalisable(s)
        if piece[0] == "{":
            continue
        if len(piece) < 2:
            return s
        a, b, rest = piece[0], piece[1], piece[2:]
        pieces[i] = "{" + a + "}" + (b if b == "{" else "{" + b + "}") + rest
    return "\\frac".join(pieces)


def strip_string(s: str) -> str:
    """Hendrycks' normalisation of a MATH answer, in verl's order: step 1, units, step 2, then a
    leading "." becomes "0.", a short left side goes ("k = 3" -> "3": one "=" with at most two
    characters before it), \\sqrt and \\frac are braced, spaces removed (between the two), "0.5"
    becomes "\\frac{1}{2}", and "a/b" of two integers "\\frac{a}{b}"."""
    for old, new in MATH_REPLACEMENTS:
        s = s.replace(old, new)
    s = units_removed(s)
    for old, new in MATH_REPLACEMENTS_AFTER_UNITS:
        s = s.replace(old, new)
    if s.startswith("."):
        s = "0" + s
    left, _, right = s.partition("=")
    if s.count("=") == 1 and len(left) <= 2:
        s = right
    s = fracs_braced(sqrt_braced(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    a, _, b = s.partition("/")
    if s.count("/") == 1 and INTEGER.fullmatch(a) and INTEGER.fullmatch(b):
        s = f"\\frac{{{a}}}{{{b}}}"
    return s


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """verl's is_equiv: the normalised strings are equal, or, where either cannot be normalised,
    the strings as they are."""
    try:
        return strip_string(answer) == strip_string(ground_truth)
    except Unnormalisable:
        return answer == ground_truth


def math_score(solution_str: str, ground_truth: str) -> dict:
    """1.0 when the answer of the response's last box (last_boxed()) is equivalent to the ground
    truth, else 0.0."""
    pred = last_boxed(solution_str)
    acc = pred is not None and is_equivalent(pred, ground_truth)
    return {"score": 1.0 if acc else 0.0, "acc": acc, "pred": pred}


# Which verifier scores a row, by its data_source, as verl's default_compute_score (reward.py
# adds math_dapo's names)
VERL_SCORERS = {
    "openai/gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
}
