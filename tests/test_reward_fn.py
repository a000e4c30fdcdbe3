"""infra/reward_fn.py: a user's verifier (--reward-fn FILE.py:NAME) loaded and called safely.
A bad file or spec stops the run naming the flag; during a run an exception, a sys.exit(), an
os._exit(), a timeout or a wrong return type is a wrong answer the step reports once; a NaN, an
inf or a score beyond float32 stops the run; an os.chdir is undone and a process the verifier
forked that comes back into the run is ended."""
import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest

import infra.reward_fn
from infra.reward_fn import RewardFn, load_reward_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("body,spec_name,error", [
    (None, "score", "no file"),
    ("score = 3\n", "score", "defines a int named score, not a function"),
    ("def other(r, g):\n    return 1.0\n", "score", "defines nothing named score"),
    ("import no_such_module_here\n", "score", "importing .* failed: ModuleNotFoundError"),
    ("def score(r, g):\n    raise KeyError(g)\n", "score", "check call score.* KeyError"),
    ("def score(r, g):\n    return 'right'\n", "score", "check call.*expected a float"),
    ("def score(r, g):\n    return {'acc': True}\n", "score", "check call.*expected a float"),
    ("def score(r):\n    return 1.0\n", "score", "check call.*TypeError"),
], ids=["missing", "not-callable", "no-such-name", "import-fails", "raises", "str", "no-score",
        "one-argument"])
def test_a_bad_reward_file_stops_the_run_naming_the_flag(tmp_path, body, spec_name, error):
    path = str(tmp_path / "mine.py") if body is None else write(tmp_path / "mine.py", body)
    with pytest.raises(ValueError, match=f"--reward-fn .*{error}"):
        verifier = RewardFn.load(f"{path}:{spec_name}")
        verifier.check("7")


@pytest.mark.parametrize("spec", ["mine.py", "mine:score", "mine.py:not a name"])
def test_a_malformed_spec_says_the_form(spec):
    with pytest.raises(ValueError, match="expected FILE.py:NAME"):
        load_reward_fn(spec)


def test_an_exception_during_the_run_is_a_wrong_answer_the_step_reports_once(tmp_path, caplog):
    path = write(tmp_path / "mine.py", "def f(r, g):\n    return 1.0 if r == g else int(r)\n")
    verifier = RewardFn.load(f"{path}:f")
    verifier.check("7")
    with caplog.at_level(logging.WARNING):
        outs = [verifier.verify("custom", r, "7") for r in ("seven", "7", "eight")]
    assert [(o["score"], o["acc"], o.get("reward_fn_error")) for o in outs] == [
        (-1.0, False, True), (1.0, True, None), (-1.0, False, True)]
    assert caplog.text == ""  # not a line per response: the step's warning says it once
    assert re.fullmatch(r"ValueError: invalid literal .*'seven', on a row of data_source "
                        r"'custom', ground truth '7', response 'seven'",
                        verifier.take_errors())
    assert verifier.take_errors() == ""  # read once, then forgotten


@pytest.mark.parametrize("bad", ["float('nan')", "float('inf')", "{'score': float('nan')}"])
def test_a_nan_or_inf_score_stops_the_run_naming_the_function_and_the_response(tmp_path, bad):
    path = write(tmp_path / "mine.py", f"def f(r, g):\n    return 1.0 if r == g else {bad}\n")
    verifier = RewardFn.load(f"{path}:f")
    verifier.check("7")  # 1.0 on its check
    value = "inf" if "inf" in bad else "nan"
    with pytest.raises(ValueError, match=rf"--reward-fn .*mine\.py:f returned {value} for the "
                                         r"response 'Answer: 8' \(ground truth '7'\): a score "
                                         r"must be a finite number"):
        verifier.verify("custom", "Answer: 8", "7")
    always = write(tmp_path / "always.py", f"def f(r, g):\n    return {bad}\n")
    with pytest.raises(ValueError, match=rf"the check call f\('7', '7'\) failed: "
                                         rf"--reward-fn .*:f returned {value}"):
        verifier = RewardFn.load(f"{always}:f")
        verifier.check("7")


def test_a_slow_call_is_said_and_one_past_the_timeout_is_a_wrong_answer(tmp_path, caplog,
                                                                         monkeypatch):
    monkeypatch.setattr(infra.reward_fn, "SLOW_SCORE_S", 0.1)
    path = write(tmp_path / "mine.py", "import time\ndef f(r, g):\n"
                                       "    time.sleep(0.3 if r == 'slow' else 60)\n"
                                       "    return 1.0\n")
    verifier = RewardFn.load(f"{path}:f", timeout_s=1.0)
    with caplog.at_level(logging.WARNING):
        assert verifier.verify("custom", "slow", "7")["score"] == 1.0  # slow, in time
        start = time.monotonic()
        out = verifier.verify("custom", "hangs", "7")
    assert time.monotonic() - start < 5  # stopped at the timeout, not after 60 s
    assert out == {"score": -1.0, "acc": False, "pred": "", "reward_fn_error": True}
    assert verifier.take_errors().startswith(
        "TimeoutError: still running after --reward-timeout 1 s, on a row")
    assert caplog.text.count("has been scoring one response for 0.1 s") == 1  # said once
    assert "--reward-timeout 1 s scores a longer call as a wrong answer" in caplog.text


def test_a_verifier_that_calls_sys_exit_is_a_verifier_error_not_the_end_of_the_run(tmp_path):
    # before: SystemExit passed `except Exception`, and the run ended with exit status 0
    path = write(tmp_path / "mine.py", "import sys\ndef f(r, g):\n"
                                       "    if r != g:\n        sys.exit(0)\n    return 1.0\n")
    verifier = RewardFn.load(f"{path}:f")
    verifier.check("7")
    out = verifier.verify("custom", "8", "7")
    assert out == {"score": -1.0, "acc": False, "pred": "", "reward_fn_error": True}
    assert verifier.take_errors().startswith("SystemExit: the verifier called "
                                                     "sys.exit(0), on a row")
    with pytest.raises(ValueError, match=r"the check call f\('7', '7'\) failed: SystemExit: the "
                                         r"verifier called sys.exit\(3\)"):
        always = write(tmp_path / "always.py", "import sys\ndef f(r, g):\n    sys.exit(3)\n")
        verifier = RewardFn.load(f"{always}:f")
        verifier.check("7")
    # sys.exit(4), not sys.exit(): once wandb has run in this process, its hook makes that 0
    at_import = write(tmp_path / "at_import.py", "import sys\nsys.exit(4)\n")
    with pytest.raises(ValueError, match=r"importing .*at_import.py failed: SystemExit: the "
                                         r"verifier called sys.exit\(4\)"):
        load_reward_fn(f"{at_import}:f")


@pytest.mark.parametrize("timeout_s", [1e12, float("inf")])
def test_a_huge_or_infinite_reward_timeout_lets_a_slow_call_finish(tmp_path, monkeypatch,
                                                                   timeout_s):
    # before: past SLOW_SCORE_S the timer was re-armed for timeout_s and setitimer overflowed,
    # so every call longer than 10 s scored -1
    monkeypatch.setattr(infra.reward_fn, "SLOW_SCORE_S", 0.05)
    path = write(tmp_path / "mine.py", "import time\ndef f(r, g):\n    time.sleep(0.2)\n"
                                       "    return 1.0\n")
    verifier = RewardFn.load(f"{path}:f", timeout_s=timeout_s)
    assert verifier.verify("custom", "slow", "7") == {"score": 1.0, "acc": True, "pred": ""}
    assert verifier.take_errors() == ""


def test_a_numpy_score_is_a_score_and_a_non_bool_acc_is_refused(tmp_path):
    # before: np.float32(1.0) was refused as "expected a float", and an acc of "False" read as True
    path = write(tmp_path / "mine.py", "import numpy as np\n"
                                       "def f(r, g):\n    return np.float32(0.5)\n"
                                       "def n(r, g):\n    return {'score': np.int64(-1), "
                                       "'acc': np.bool_(False)}\n"
                                       "def s(r, g):\n    return {'score': 1.0, 'acc': 'False'}\n"
                                       "def third(r, g):\n    return 1 / 3 if False else "
                                       "__import__('fractions').Fraction(1, 3)\n")
    verifier = RewardFn.load(f"{path}:f")
    assert verifier.verify("custom", "7", "7") == {"score": 0.5, "acc": True, "pred": ""}
    verifier = RewardFn.load(f"{path}:n")
    assert verifier.verify("custom", "7", "7") == {"score": -1.0, "acc": False, "pred": ""}
    for name, error in [("s", r"'acc' must be a bool, got 'False' \(str\)"),
                        ("third", r"returned Fraction\(1, 3\) \(Fraction\); expected a float")]:
        verifier = RewardFn.load(f"{path}:{name}")
        with pytest.raises(ValueError, match=rf"check call {name}\('7', '7'\) failed: "
                                             rf"TypeError: --reward-fn .*{error}"):
            verifier.check("7")


def test_a_score_beyond_float32_stops_the_run_as_an_inf_does(tmp_path):
    # before: 1e39 became inf in the fp32 reward tensor, every update was skipped, --lr blamed
    path = write(tmp_path / "mine.py", "def f(r, g):\n    return 1.0 if r == g else -1e39\n")
    verifier = RewardFn.load(f"{path}:f")
    verifier.check("7")
    with pytest.raises(ValueError, match=r"returned -1e\+39 for the response '8' .*: a score must "
                                         r"be a finite number within float32's range"):
        verifier.verify("custom", "8", "7")


def test_a_verifier_that_changes_directory_leaves_the_runs_own_as_it_was(tmp_path, monkeypatch):
    # before: its os.chdir moved the run, whose relative paths (runs/demo/metrics.jsonl) then
    # failed to open: "could not write ... (is the disk full?)"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    path = write(tmp_path / "mine.py", "import os\nos.chdir('elsewhere')\n"
                                       "def f(r, g):\n    os.chdir('/')\n    return 1.0\n")
    verifier = RewardFn.load(f"{path}:f")
    assert os.getcwd() == str(tmp_path)  # at import
    verifier.check("7")
    assert verifier.verify("custom", "7", "7")["score"] == 1.0
    assert os.getcwd() == str(tmp_path)  # after each call


# --- round 5: a verifier that forks or calls os._exit (each failed before its fix) ----------------

class RealExitReached(BaseException):
    """Stands in for the process's end in these tests: no verifier error catches it."""


def no_real_exit(status):
    raise RealExitReached(status)


def test_a_verifier_that_calls_os_exit_is_a_verifier_error_not_the_end_of_the_run(tmp_path,
                                                                                 monkeypatch):
    # before: os._exit(0) ended the run at once, exit status 0, with no word
    monkeypatch.setattr(os, "_exit", no_real_exit)
    path = write(tmp_path / "mine.py", "import os\ndef f(r, g):\n"
                                       "    if r != g:\n        os._exit(0)\n    return 1.0\n"
                                       "def always(r, g):\n    os._exit(3)\n")
    verifier = RewardFn.load(f"{path}:f")
    verifier.check("7")
    out = verifier.verify("custom", "8", "7")
    assert out == {"score": -1.0, "acc": False, "pred": "", "reward_fn_error": True}
    assert verifier.take_errors().startswith("the verifier called os._exit(0), which would end "
                                             "the run, on a row of data_source 'custom'")
    assert os._exit is no_real_exit  # put back after the call
    with pytest.raises(ValueError, match=r"the check call always\('7', '7'\) failed: the "
                                         r"verifier called os._exit\(3\)"):
        RewardFn.load(f"{path}:always").check("7")
    at_import = write(tmp_path / "at_import.py", "import os\nos._exit(4)\n")
    with pytest.raises(ValueError, match=r"importing .*at_import.py failed: the verifier called "
                                         r"os._exit\(4\)"):
        load_reward_fn(f"{at_import}:f")


def test_os_exit_in_a_process_the_verifier_forked_ends_that_process(tmp_path):
    # a sandbox's child that ends with os._exit, as it should: the real one, its own status
    path = write(tmp_path / "sandbox.py", "import os\ndef f(r, g):\n    pid = os.fork()\n"
                                          "    if pid == 0:\n        os._exit(5)\n"
                                          "    return float(os.waitstatus_to_exitcode("
                                          "os.waitpid(pid, 0)[1]))\n")
    verifier = RewardFn.load(f"{path}:f")
    assert verifier.verify("custom", "7", "7")["score"] == 5.0
    assert verifier.take_errors() == ""


# A verifier that forks, its child returning (a sandbox without os._exit in a `finally`); the
# parent waits for the child and writes down its exit status
FORKS_AND_RETURNS = """import os
def f(r, g):
    pid = os.fork()
    if pid == 0:
        return 1.0
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    with open(os.path.join(os.path.dirname(__file__), "child_status"), "w") as f:
        f.write(str(status))
    return 1.0
"""
# one line from each process that comes back from the call
CALL_IT = """import json, sys
from infra.reward_fn import RewardFn
verifier = RewardFn.load(sys.argv[1])
try:
    result = verifier.{call}
except ValueError as e:
    result = str(e)
print(json.dumps([result, verifier.take_errors()]), flush=True)
"""
CAME_BACK = (r"a process it forked \(pid \d+\) came back into the run instead of ending with "
             r"os._exit\(\): it was ended, exit status 70")


@pytest.mark.parametrize("call", ["verify('custom', '7', '7')", "check('7')"])
def test_a_process_the_verifier_forked_that_returns_is_ended_and_said(tmp_path, call):
    # before: the child came back from the call and went on with the run: it trained to the end,
    # then the parent trained the same steps again, and the run exited 0. In a subprocess: here,
    # such a child would go on running pytest
    path = write(tmp_path / "forks.py", FORKS_AND_RETURNS)
    out = subprocess.run([sys.executable, "-c", CALL_IT.format(call=call), f"{path}:f"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1, lines  # the parent's line alone: the child said nothing
    assert (tmp_path / "child_status").read_text() == "70"
    result, errors = json.loads(lines[0])
    if call.startswith("verify"):
        assert result == {"score": -1.0, "acc": False, "pred": "", "reward_fn_error": True}
        assert re.fullmatch(rf"{CAME_BACK}, on a row of data_source 'custom', ground truth '7', "
                            r"response '7'", errors), errors
    else:  # the run stops before it starts
        assert re.fullmatch(rf"--reward-fn .*forks.py:f: the check call f\('7', '7'\) failed: "
                            rf"{CAME_BACK}", result), result
