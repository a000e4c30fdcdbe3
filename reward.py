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
"""
import contextlib
import functools
import logging
import math
import numbers
import os
import re
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from infra.errors import UserError

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
    case: normalize leaves "[INVALID]" as it is). A custom verifier's responses count as
    answered: it says only right or wrong."""
    return result.get("pred") != NO_ANSWER


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
    TOY_DATA_SOURCE: compute_score,
}


def scorer_for(data_source: str):
    """The built-in verifier of a data_source, or None. Any data_source starting with "aime" also
    goes to math_dapo, as in verl (the AIME-2024 eval set). A Verifier adds --reward-fn's."""
    if data_source.startswith("aime"):
        return compute_score
    return SCORERS.get(data_source)


def has_scorer(data_source: str) -> bool:
    """Whether a built-in verifier rewards rows of this data_source."""
    return scorer_for(data_source) is not None


def score_response(data_source: str, response_text: str, ground_truth: str) -> dict:
    """Score one decoded response with its row's built-in verifier: {"score", "acc", "pred"}."""
    scorer = scorer_for(data_source)
    if scorer is None:
        raise UserError(f"no reward function for data_source {data_source!r}; known: "
                        f"{sorted(SCORERS)} and 'aime*'")
    return scorer(response_text, ground_truth)


@dataclass
class Scores:
    """The verifier's verdict on each response of a rollout (batch.Batch.from_rollout's input)."""
    score: list[float]  # +1 right, -1 wrong (or --reward-fn's own number)
    acc: list[bool]  # the answer is right
    no_answer: list[bool]  # the verifier found no answer to read
    reward_error: list[bool] | None  # --reward-fn raised on it; None without --reward-fn


# --------------------------------------------------------------------------------------------------
# Your own verifier: --reward-fn FILE.py:NAME (verl's custom_reward_function.path/name, TRL's
# reward_funcs): NAME(response_text, ground_truth) -> float or {"score": float, "acc": bool}
CUSTOM_DATA_SOURCE = "custom"  # the data_source of plain {"prompt", "answer"} rows (data.py)
SLOW_SCORE_S = 10.0  # one call of the custom verifier this long: say so (once a run)
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the rewards' dtype (batch.Batch.score)
MAX_TIMER_S = 1e8  # under setitimer's limit (the platform's time_t): 3 years is plenty
# A verifier's sys.exit() is one of its errors: a SystemExit let through would end the run with
# exit status 0, losing every step since the last checkpoint (KeyboardInterrupt still stops it)
VERIFIER_ERRORS = (Exception, SystemExit)
FORKED_EXIT_STATUS = 70  # a process the verifier forked that came back into the run (EX_SOFTWARE)


@dataclass
class Verifier:
    """A run's verifier: the built-in one of each row's data_source and, with --reward-fn, your
    function, loaded from spec ("FILE.py:NAME"), for the rows no built-in one scores (or for
    every row: every_row). A call of it longer than timeout_s seconds (0 or inf: no limit) is a
    wrong answer. launch.py builds one a run; rollouts, evaluations and the alarms are handed it.

        Verifier()                                  the built-in verifiers alone
        Verifier.load("mine.py:score", False, 30)   and yours
    """
    reward_fn: Callable | None = None
    spec: str = ""  # "FILE.py:NAME", "" without --reward-fn
    every_row: bool = False
    timeout_s: float = 0.0
    first_error: str = ""  # reward_fn's first error since take_errors(), with its response
    said_slow: bool = False  # a slow call of reward_fn was said (once a run)
    forks: "_ReturningForks" = field(default_factory=lambda: _ReturningForks(), repr=False)

    @classmethod
    def load(cls, spec: str, every_row: bool, timeout_s: float = 0.0) -> "Verifier":
        forks = _ReturningForks()
        return cls(load_reward_fn(spec, forks), spec, every_row, timeout_s, forks=forks)

    def scores_with_reward_fn(self, data_source: str) -> bool:
        """Whether --reward-fn (if given) scores the rows of this data_source."""
        return self.reward_fn is not None and (self.every_row or not has_scorer(data_source))

    def has_scorer(self, data_source: str) -> bool:
        """Whether rows of this data_source can be rewarded: data.py checks every row on load,
        not when it is drawn."""
        return self.reward_fn is not None or has_scorer(data_source)

    def score(self, data_source: str, response_text: str, ground_truth: str) -> dict:
        """Score one decoded response for its row's data_source: {"score", "acc", "pred"}."""
        if self.scores_with_reward_fn(data_source):
            return self._score_with_reward_fn(data_source, response_text, ground_truth)
        return score_response(data_source, response_text, ground_truth)

    def score_responses(self, rows: list[dict], group_size: int, texts: list[str]) -> Scores:
        """The G = group_size responses to each row (texts, group after group), scored by the
        row's verifier."""
        row_of_each_text = [row for row in rows for _ in range(group_size)]
        results = [self.score(row["data_source"], text, row["reward_model"]["ground_truth"])
                   for row, text in zip(row_of_each_text, texts)]
        errors = [bool(r.get("reward_fn_error")) for r in results]
        return Scores(score=[r["score"] for r in results], acc=[bool(r["acc"]) for r in results],
                      no_answer=[not found_answer(r) for r in results],
                      reward_error=errors if self.reward_fn is not None else None)

    def check(self, example_ground_truth: str):
        """One call of --reward-fn on a real ground truth (of a row it scores, given as the
        response too) must return a finite float or {"score", "acc"}: a wrong signature or type
        stops the run before it starts, not at the first rollout."""
        gt = example_ground_truth
        try:
            result = _as_score(self._call(gt, gt), self.spec)
            _check_finite(result["score"], self.spec, gt, gt)
        except VERIFIER_ERRORS as e:
            raise UserError(f"--reward-fn {self.spec}: the check call "
                            f"{self.spec.rpartition(':')[2]}({gt!r}, {gt!r}) failed: "
                            f"{_described(e)}") from e

    def take_errors(self) -> str:
        """The first exception --reward-fn raised since the last call, with its response and
        ground truth, or "" if none; forgets it. The rollout's metrics count them."""
        first, self.first_error = self.first_error, ""
        return first

    def _score_with_reward_fn(self, data_source: str, response_text: str,
                              ground_truth: str) -> dict:
        """An exception (a sys.exit() too), a timeout or a wrong return type is a wrong answer
        (-1), marked reward_fn_error and remembered for the step's warning (the first of them,
        with its response), and the run goes on. A NaN or an inf stops it."""
        try:
            result = _as_score(self._call(response_text, ground_truth), self.spec)
        except VERIFIER_ERRORS as e:
            if not self.first_error:
                self.first_error = (f"{_described(e)}, on a row of data_source "
                                    f"{data_source!r}, ground truth {_excerpt(ground_truth)}, "
                                    f"response {_excerpt(response_text)}")
            return {"score": -1.0, "acc": False, "pred": "", "reward_fn_error": True}
        _check_finite(result["score"], self.spec, response_text, ground_truth)
        return result

    def _call(self, response_text: str, ground_truth: str):
        """reward_fn(response_text, ground_truth), said to be slow after SLOW_SCORE_S and stopped
        with a TimeoutError after timeout_s. The SIGALRM timer interrupts Python code, not a call
        stuck in C (a regex, an extension); outside a Unix main thread the call runs unwatched. A
        function that sets its own SIGALRM (a timeout decorator) takes the timer over."""
        with _guarded(self.forks):
            return self._call_timed(response_text, ground_truth)

    def _call_timed(self, response_text: str, ground_truth: str):
        in_main_thread = threading.current_thread() is threading.main_thread()
        if not (hasattr(signal, "setitimer") and in_main_thread):  # no timer: unwatched
            return self.reward_fn(response_text, ground_truth)
        start = time.monotonic()
        timeout_s = self.timeout_s if math.isfinite(self.timeout_s) else 0.0  # inf: no limit

        def on_alarm(signum, frame):
            ran = time.monotonic() - start
            if timeout_s and ran >= timeout_s * 0.999:  # the timer may ring a hair early
                raise TimeoutError(f"still running after --reward-timeout {timeout_s:g} s")
            self._say_slow(ran, timeout_s)
            if timeout_s:  # a timer beyond MAX_TIMER_S overflows: it rings, and is set again
                signal.setitimer(signal.ITIMER_REAL, min(timeout_s - ran, MAX_TIMER_S))

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, min(SLOW_SCORE_S, timeout_s or SLOW_SCORE_S))
        try:
            return self.reward_fn(response_text, ground_truth)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def _say_slow(self, ran: float, timeout_s: float):
        if self.said_slow:
            return
        self.said_slow = True
        if timeout_s:
            limit = f"--reward-timeout {timeout_s:g} s scores a longer call as a wrong answer"
        else:
            limit = "--reward-timeout S would score a call longer than S s as a wrong answer"
        logging.getLogger(__name__).warning(
            "--reward-fn %s has been scoring one response for %.1f s; the responses of a step "
            "are scored one after another, so a step takes that times their number (%s)",
            self.spec, ran, limit)


def reward_fn_file(spec: str) -> tuple[str, str]:
    """(FILE.py, NAME) from "FILE.py:NAME"; raise naming the flag when the form is wrong or the
    file is missing."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise UserError(f"--reward-fn {spec!r}: expected FILE.py:NAME, e.g. "
                        "examples/countdown.py:score")
    if not os.path.isfile(path):
        raise UserError(f"--reward-fn {spec!r}: no file {path}")
    return path, name


def load_reward_fn(spec: str, forks: "_ReturningForks | None" = None):
    """The function NAME of FILE.py, from "FILE.py:NAME"; raise naming the flag, the file and the
    name when the file is missing or broken or NAME is not a callable."""
    import importlib.util
    path, name = reward_fn_file(spec)
    module_spec = importlib.util.spec_from_file_location(f"reward_fn_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        with _guarded(forks or _ReturningForks()):
            module_spec.loader.exec_module(module)
    except VERIFIER_ERRORS as e:
        raise UserError(f"--reward-fn {spec!r}: importing {path} failed: "
                        f"{_described(e)}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        what = "nothing" if fn is None else f"a {type(fn).__name__}"
        raise UserError(f"--reward-fn {spec!r}: {path} defines {what} named {name}, not a "
                        "function (response_text, ground_truth) -> float or {'score', 'acc'}")
    return fn


# --- what a verifier's code may not do to the run: each undone or stopped around its calls --------

@contextlib.contextmanager
def _guarded(forks: "_ReturningForks"):
    """Around each call of a verifier's code (and its import): the three helpers below."""
    with forks.ended(), _same_directory(), _os_exit_raises():
        yield


@contextlib.contextmanager
def _same_directory():
    """The run's working directory, as it was, after a verifier's code: an os.chdir there would
    move every relative path of the run (--out-dir runs/demo: its metrics could not be opened)."""
    cwd = os.getcwd()
    try:
        yield
    finally:
        os.chdir(cwd)


class OsExitCalled(SystemExit):
    """os._exit(status), called by a verifier in the run's process: raised instead (a SystemExit,
    so that the verifier's own `except Exception` does not swallow it)."""


@contextlib.contextmanager
def _os_exit_raises():
    """os._exit() from the calling process and thread raises OsExitCalled: it would end the run
    on the spot, and with status 0 make it look finished. In a process the verifier forked (a
    sandbox's child), or in another thread, os._exit is itself."""
    real_exit, pid, thread = os._exit, os.getpid(), threading.get_ident()

    def exit_unless_the_run(status):
        if os.getpid() == pid and threading.get_ident() == thread:
            raise OsExitCalled(status)
        real_exit(status)

    os._exit = exit_unless_the_run
    try:
        yield
    finally:
        os._exit = real_exit


class _ReturningForks:
    """A process the verifier forked that comes back into the run (its function returned or
    raised instead of ending with os._exit, as a sandbox without it in a `finally` does) would
    train the run's steps a second time, from where it was forked: it is ended at once, exit
    status FORKED_EXIT_STATUS, after saying so on a pipe, which the calling process reads after
    each call (the call that hears of it is the verifier's error)."""

    def __init__(self):
        self.pipe: tuple[int, int] | None = None  # (read, write) ends, made before the first call

    @contextlib.contextmanager
    def ended(self):
        if self.pipe is None:
            self.pipe = os.pipe()  # inherited by whatever forks
            for fd in self.pipe:  # neither a full pipe nor an empty one may block
                os.set_blocking(fd, False)
            weakref.finalize(self, _close_fds, self.pipe)
        caller = os.getpid()
        try:
            yield
        finally:
            if os.getpid() != caller:
                self._say_and_end()
        heard = self._heard()
        if heard:
            raise UserError(heard)

    def _say_and_end(self):
        said = (f"a process it forked (pid {os.getpid()}) came back into the run instead of "
                f"ending with os._exit(): it was ended, exit status {FORKED_EXIT_STATUS}\n")
        with contextlib.suppress(OSError):
            os.write(self.pipe[1], said.encode())  # one write: atomic
        os._exit(FORKED_EXIT_STATUS)

    def _heard(self) -> str:
        """The first thing a returning fork said since the last call, or ""."""
        try:
            return os.read(self.pipe[0], 1 << 16).decode(errors="replace").partition("\n")[0]
        except BlockingIOError:
            return ""


def _close_fds(fds):
    for fd in fds:
        os.close(fd)


def _described(e: BaseException) -> str:
    """A verifier's error as the warnings and errors show it."""
    if isinstance(e, OsExitCalled):
        return f"the verifier called os._exit({e.code!r}), which would end the run"
    if isinstance(e, SystemExit):
        return f"SystemExit: the verifier called sys.exit({e.code!r})"
    if isinstance(e, UserError):  # ours, which says what is wrong (a NaN score)
        return str(e)
    return f"{type(e).__name__}: {e}"


def _as_score(result, spec: str) -> dict:
    """A custom verifier's float or {"score", "acc"} as {"score", "acc", "pred"}; TypeError else.
    acc defaults to score > 0 (a right answer earns a positive reward)."""
    if isinstance(result, dict) and "score" in result:
        score, acc = result["score"], result.get("acc")
    else:
        score, acc = result, None
    if not _exact_number(score):
        raise TypeError(f"--reward-fn {spec}: returned {result!r} ({type(result).__name__}); "
                        "expected a float or a dict with a float 'score' (and optionally 'acc')")
    if acc is not None and not isinstance(acc, (bool, np.bool_)):  # "False" would read as True
        raise TypeError(f"--reward-fn {spec}: 'acc' must be a bool, got {acc!r} "
                        f"({type(acc).__name__})")
    return {"score": float(score), "acc": bool(score > 0) if acc is None else bool(acc),
            "pred": ""}


def _exact_number(x) -> bool:
    """A real number (numpy's too) that a float holds exactly, not a bool: a Fraction(1, 3) or
    "1.0" is refused rather than rounded or parsed."""
    if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
        return False
    as_float = float(x)
    return math.isnan(as_float) or as_float == x  # a NaN is _check_finite's to refuse


def _check_finite(score: float, spec: str, response_text: str, ground_truth: str):
    """A NaN or an inf reward, or one beyond float32's range (the rewards' dtype), is a bug of the
    verifier, not a wrong answer: it would make its group's advantages and the gradient NaN.
    Raise naming the response and the ground truth."""
    if not math.isfinite(score) or abs(score) > FLOAT32_MAX:
        raise UserError(f"--reward-fn {spec} returned {score} for the response "
                        f"{_excerpt(response_text)} (ground truth {_excerpt(ground_truth)}): a "
                        "score must be a finite number within float32's range (a NaN or inf "
                        "reward makes the advantages and the gradient of its group NaN)")


def _excerpt(text: str, chars: int = 200) -> str:
    """The end of a response, where the answer is, as repr shows it."""
    return repr(text) if len(text) <= chars else "..." + repr(text[-chars:])
