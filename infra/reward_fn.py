"""
Calling a user's verifier safely: --reward-fn FILE.py:NAME (verl's
custom_reward_function.path/name, TRL's reward_funcs), NAME(response_text, ground_truth) -> float
or {"score": float, "acc": bool}, called on each response of a run, in the run's process.

A verifier is code we did not write, so each of its calls is watched (reward.py's Verifier calls
it through RewardFn, for the rows no built-in verifier scores, or for every row):

- an exception (a sys.exit() too), a wrong return type or a call past --reward-timeout is a wrong
  answer (-1), the first of them kept for the step's one warning (take_errors), and the run goes
  on; a slow call is said once a run;
- a NaN, an inf or a score beyond float32 stops the run: it is a bug of the verifier, which would
  make its group's advantages and the gradient NaN;
- what it does to the run's process is undone or stopped around each call and its import: an
  os.chdir, an os._exit, a process it forked that comes back into the run.
"""
import contextlib
import importlib.util
import logging
import math
import numbers
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from infra.errors import UserError

SLOW_SCORE_S = 10.0  # one call of the custom verifier this long: say so (once a run)
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the rewards' dtype (batch.Batch.score)
MAX_TIMER_S = 1e8  # under setitimer's limit (the platform's time_t): 3 years is plenty
# A verifier's sys.exit() is one of its errors: a SystemExit let through would end the run with
# exit status 0, losing every step since the last checkpoint (KeyboardInterrupt still stops it)
VERIFIER_ERRORS = (Exception, SystemExit)
FORKED_EXIT_STATUS = 70  # a process the verifier forked that came back into the run (EX_SOFTWARE)


@dataclass
class RewardFn:
    """The function of spec ("FILE.py:NAME"), called safely. A call longer than timeout_s seconds
    (0 or inf: no limit) is a wrong answer.

        RewardFn.load("mine.py:score", timeout_s=30)
    """
    fn: Callable
    spec: str  # "FILE.py:NAME"
    timeout_s: float = 0.0
    first_error: str = ""  # fn's first error since take_errors(), with its response
    said_slow: bool = False  # a slow call of fn was said (once a run)
    forks: "_ReturningForks" = field(default_factory=lambda: _ReturningForks(), repr=False)

    @classmethod
    def load(cls, spec: str, timeout_s: float = 0.0) -> "RewardFn":
        forks = _ReturningForks()
        return cls(load_reward_fn(spec, forks), spec, timeout_s, forks=forks)

    def verify(self, data_source: str, response_text: str, ground_truth: str) -> dict:
        """{"score", "acc", "pred"} of one response to a row of data_source. An exception (a
        sys.exit() too), a timeout or a wrong return type is a wrong answer (-1), marked
        reward_fn_error and remembered for the step's warning (the first of them, with its
        response), and the run goes on. A NaN or an inf stops it."""
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

    def check(self, example_ground_truth: str):
        """One call on a real ground truth (of a row it scores, given as the response too) must
        return a finite float or {"score", "acc"}: a wrong signature or type stops the run before
        it starts, not at the first rollout."""
        gt = example_ground_truth
        try:
            result = _as_score(self._call(gt, gt), self.spec)
            _check_finite(result["score"], self.spec, gt, gt)
        except VERIFIER_ERRORS as e:
            raise UserError(f"--reward-fn {self.spec}: the check call "
                            f"{self.spec.rpartition(':')[2]}({gt!r}, {gt!r}) failed: "
                            f"{_described(e)}") from e

    def take_errors(self) -> str:
        """The first exception fn raised since the last call, with its response and ground truth,
        or "" if none; forgets it. The rollout's metrics count them."""
        first, self.first_error = self.first_error, ""
        return first

    def _call(self, response_text: str, ground_truth: str):
        """fn(response_text, ground_truth), said to be slow after SLOW_SCORE_S and stopped with a
        TimeoutError after timeout_s. The SIGALRM timer interrupts Python code, not a call stuck
        in C (a regex, an extension); outside a Unix main thread the call runs unwatched. A
        function that sets its own SIGALRM (a timeout decorator) takes the timer over."""
        with _guarded(self.forks):
            return self._call_timed(response_text, ground_truth)

    def _call_timed(self, response_text: str, ground_truth: str):
        in_main_thread = threading.current_thread() is threading.main_thread()
        if not (hasattr(signal, "setitimer") and in_main_thread):  # no timer: unwatched
            return self.fn(response_text, ground_truth)
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
            return self.fn(response_text, ground_truth)
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


# --- what a verifier returned, and its errors as the run says them --------------------------------

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
