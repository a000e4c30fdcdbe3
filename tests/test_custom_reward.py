"""--reward-fn FILE.py:NAME, plain {"prompt", "answer"} JSONL rows and the Countdown example:
the reward file is checked before anything loads, its errors during a run are a logged wrong
answer, and a few DAPO steps train on Countdown rows scored by examples/countdown.py."""
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import replace

import pytest

import dapo
import reward
from reward import Verifier
from config import Config
from data import load_rows
from examples.countdown import make_problem, make_row, score
from launch import check_files, load_verifier
from test_dapo import torch_kernel_path  # noqa: F401 (an autouse fixture: the PyTorch kernel path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTDOWN = os.path.join(ROOT, "examples", "countdown.py")


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def plain_jsonl(path, rows):
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


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
        verifier = Verifier.load(f"{path}:{spec_name}", False)
        verifier.check("7")


@pytest.mark.parametrize("spec", ["mine.py", "mine:score", "mine.py:not a name"])
def test_a_malformed_spec_says_the_form(spec):
    with pytest.raises(ValueError, match="expected FILE.py:NAME"):
        reward.load_reward_fn(spec)


@pytest.mark.needs("extract_answer", "normalize")  # math_dapo keeps its own verifier
def test_floats_and_dicts_are_scores_and_acc_follows_the_sign(tmp_path):
    path = write(tmp_path / "mine.py", "def f(r, g):\n    return float(r == g) * 2 - 1\n"
                                       "def d(r, g):\n    return {'score': 0.5, 'acc': False}\n")
    verifier = Verifier.load(f"{path}:f", False)
    assert verifier.score("custom", "7", "7") == {"score": 1.0, "acc": True, "pred": ""}
    assert verifier.score("custom", "8", "7")["acc"] is False
    # a data_source with a built-in verifier keeps it unless every row is asked for
    assert verifier.score("math_dapo", "Answer: 7", "7")["pred"] == "7"
    verifier = Verifier.load(f"{path}:d", True)
    assert verifier.score("math_dapo", "Answer: 7", "7") == {"score": 0.5, "acc": False,
                                                                    "pred": ""}


def test_an_exception_during_the_run_is_a_wrong_answer_the_step_reports_once(tmp_path, caplog):
    path = write(tmp_path / "mine.py", "def f(r, g):\n    return 1.0 if r == g else int(r)\n")
    verifier = Verifier.load(f"{path}:f", False)
    verifier.check("7")
    with caplog.at_level(logging.WARNING):
        outs = [verifier.score("custom", r, "7") for r in ("seven", "7", "eight")]
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
    verifier = Verifier.load(f"{path}:f", False)
    verifier.check("7")  # 1.0 on its check
    value = "inf" if "inf" in bad else "nan"
    with pytest.raises(ValueError, match=rf"--reward-fn .*mine\.py:f returned {value} for the "
                                         r"response 'Answer: 8' \(ground truth '7'\): a score "
                                         r"must be a finite number"):
        verifier.score("custom", "Answer: 8", "7")
    always = write(tmp_path / "always.py", f"def f(r, g):\n    return {bad}\n")
    with pytest.raises(ValueError, match=rf"the check call f\('7', '7'\) failed: "
                                         rf"--reward-fn .*:f returned {value}"):
        verifier = Verifier.load(f"{always}:f", False)
        verifier.check("7")


def test_a_slow_call_is_said_and_one_past_the_timeout_is_a_wrong_answer(tmp_path, caplog,
                                                                         monkeypatch):
    monkeypatch.setattr(reward, "SLOW_SCORE_S", 0.1)
    path = write(tmp_path / "mine.py", "import time\ndef f(r, g):\n"
                                       "    time.sleep(0.3 if r == 'slow' else 60)\n"
                                       "    return 1.0\n")
    verifier = Verifier.load(f"{path}:f", False, timeout_s=1.0)
    with caplog.at_level(logging.WARNING):
        assert verifier.score("custom", "slow", "7")["score"] == 1.0  # slow, in time
        start = time.monotonic()
        out = verifier.score("custom", "hangs", "7")
    assert time.monotonic() - start < 5  # stopped at the timeout, not after 60 s
    assert out == {"score": -1.0, "acc": False, "pred": "", "reward_fn_error": True}
    assert verifier.take_errors().startswith(
        "TimeoutError: still running after --reward-timeout 1 s, on a row")
    assert caplog.text.count("has been scoring one response for 0.1 s") == 1  # said once
    assert "--reward-timeout 1 s scores a longer call as a wrong answer" in caplog.text


def test_plain_jsonl_rows_become_chat_rows_scored_by_the_reward_fn(tmp_path):
    data = plain_jsonl(tmp_path / "plain.jsonl", [{"prompt": "2+3?", "answer": "5"},
                                                  {"prompt": "1+1?", "answer": 2}])
    with pytest.raises(ValueError, match=r"plain.jsonl:1: no reward function for data_source "
                                         r"'custom'.*--reward-fn"):
        load_rows(data)
    rows = load_rows(data, verifier=Verifier.load(f"{COUNTDOWN}:score", False))
    assert rows == [
        {"data_source": "custom", "prompt": [{"role": "user", "content": "2+3?"}],
         "reward_model": {"ground_truth": "5", "style": "rule"}},
        {"data_source": "custom", "prompt": [{"role": "user", "content": "1+1?"}],
         "reward_model": {"ground_truth": "2", "style": "rule"}}]


def test_a_row_without_a_verifier_says_how_to_use_the_built_in_one(tmp_path):
    # before: the error pointed at --reward-fn only; "math_dapo" was in data.py alone
    data = plain_jsonl(tmp_path / "plain.jsonl", [{"prompt": "2+3?", "answer": "5"}])
    with pytest.raises(ValueError) as e:
        load_rows(data)
    assert 'give the row "data_source": "math_dapo" for the built-in verifier' in str(e.value)
    assert "--reward-fn FILE.py:NAME" in str(e.value)
    row = {"prompt": "2+3?", "answer": "5", "data_source": "math_dapo"}
    assert load_rows(plain_jsonl(tmp_path / "math.jsonl", [row]))[0]["data_source"] == "math_dapo"


def test_the_readme_says_which_rows_the_built_in_verifier_scores_and_where_the_data_is():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert '"data_source": "math_dapo"' in readme_section()
    for dataset in ("BytedTsinghua-SIA/DAPO-Math-17k", "BytedTsinghua-SIA/AIME-2024"):
        assert dataset in text


@pytest.mark.parametrize("row,error", [
    ({"prompt": "2+3?"}, r"bad.jsonl:2: a plain row is .*got keys \['prompt'\]"),
    ({"prompt": "2+3?", "answer": "5", "extra": 1}, r"bad.jsonl:2: a plain row"),
    ({"prompt": "2+3?", "answer": ["5"]}, r"bad.jsonl:2: ground_truth must be a string"),
])
def test_a_bad_plain_row_names_its_line(tmp_path, row, error):
    verifier = Verifier.load(f"{COUNTDOWN}:score", False)
    data = plain_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1?", "answer": "2"}, row])
    with pytest.raises(ValueError, match=error):
        load_rows(data, verifier=verifier)


def test_reward_fn_all_rows_needs_reward_fn():
    with pytest.raises(ValueError, match="--reward-fn-all-rows needs --reward-fn"):
        check_files(Config(reward_fn_all_rows=True))


TRUTH = json.dumps({"numbers": [3, 5, 7], "target": 16})


@pytest.mark.parametrize("response,right", [
    ("Answer: 3 + 5 + 7 + 1", False),  # a number not given
    ("Answer: 3*7 - 5", True),
    ("I think so.\nAnswer: (7 - 5) * (3 + 5)", False),  # 5 used twice
    ("Answer: 7 * 3 - 5 = 16", True),  # the "= target" is allowed
    ("Answer: 7 + 5 + 3", False),  # 15
    ("Answer: 3 * 5 + 7 / 7", False),  # 7 twice
    ("Answer: (7 + 5 / 5 * 3)", False),
    ("Answer: 16", False),  # the numbers are not used
    ("Answer: 3**2 + 7", False),  # powers are not allowed
    ("Answer: __import__('os').getcwd()", False),  # never executed
    ("Answer: 3 / (5 - 5) + 7", False),  # division by zero
    ("no answer line", False),
    ("Answer: 3*7 - 5\nAnswer: 3 + 5 + 7", False),  # the last answer counts
    ("Answer: 7 - 5 + 3", False),
])
def test_countdown_verifier_on_hand_cases(response, right):
    assert score(response, TRUTH) == {"score": 1.0 if right else -1.0, "acc": right}


def test_countdown_division_is_exact():
    truth = json.dumps({"numbers": [3, 3, 8, 8], "target": 24})
    assert score("Answer: 8 / (3 - 8 / 3)", truth)["acc"]  # 8 / (1/3), exact only in fractions
    assert not score("Answer: 8 / (3 - 8 / 3) + 1 - 1", truth)["acc"]


def test_generated_countdown_rows_are_solved_by_their_own_equation():
    import random
    rng = random.Random(0)
    for _ in range(50):
        numbers, equation, target = make_problem(rng, 4, 9)
        answer = make_row(random.Random(0), 4, 9)["answer"]  # the row's format
        assert set(json.loads(answer)) == {"numbers", "target"}
        truth = json.dumps({"numbers": numbers, "target": target})
        assert len(numbers) == 4 and 0 < target <= 1000
        assert score(f"Answer: {equation}", truth)["acc"]


def countdown_run(tiny_model_dir, tmp_path, reward_fn: str) -> Config:
    """Two tiny steps on 40 Countdown rows, scored by reward_fn."""
    subprocess.run([sys.executable, COUNTDOWN, "--rows", "40", "--out", str(tmp_path / "cd.jsonl")],
                   check=True, capture_output=True)
    return Config(model=tiny_model_dir, out_dir=str(tmp_path / "run"), steps=2, train_prompts=4,
                  gen_prompts=4, group_size=4, max_response_len=12, overlong_buffer=4,
                  mini_batch_prompts=2, micro_batch_size=8, eval_every=0, eval_prompts=4,
                  eval_samples=2, max_prompt_len=160, dynamic_sampling=False,
                  train_data=str(tmp_path / "cd.jsonl"), val_data=str(tmp_path / "cd.jsonl"),
                  reward_fn=reward_fn)


def every_fourth_call(tmp_path, body: str) -> str:
    """countdown's verifier, except that every fourth call (one response a group) does body."""
    return write(tmp_path / "flaky.py", f"import sys\nsys.path.insert(0, {ROOT!r})\n"
                 "from examples.countdown import score\nCALLS = [0]\n"
                 "def flaky(response, truth):\n    CALLS[0] += 1\n"
                 f"    if CALLS[0] % 4 == 0:\n        {body}\n"
                 "    return score(response, truth)\n") + ":flaky"


@pytest.mark.needs("all")
def test_a_few_dapo_steps_on_countdown_with_a_raising_reward_fn(tiny_model_dir, tmp_path,
                                                                capsys):
    flaky = every_fourth_call(tmp_path, "raise RuntimeError('planted')")
    dapo.main(countdown_run(tiny_model_dir, tmp_path, flaky))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in rows if "rollout/acc" in m] == [1, 2]
    # the check call is call 1: each step's 16 responses are calls 2-17 and 18-33, 4 raise
    assert [m["rollout/reward_fn_error"] for m in rows] == [0.25, 0.25]
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "raised" in line]
    assert len(said) == 2, said  # one line a step, not one a response
    for step, line in enumerate(said, 1):
        assert line.startswith(f"warning: step {step}: --reward-fn {flaky} raised on 25% of the "
                               "responses (4 of 16), each scored as a wrong answer (-1); the "
                               "first: RuntimeError: planted, on a row of data_source "
                               "'custom'"), line


@pytest.mark.needs("all")
def test_an_evaluation_says_when_the_reward_fn_raised(tiny_model_dir, tmp_path, capsys):
    # before: --eval-only with a verifier raising on every response said val/acc 0.0, and no why
    path = write(tmp_path / "mine.py", "def f(r, g):\n    if r == g:\n        return 1.0\n"
                                       "    raise RuntimeError('planted')\n")  # passes its check
    cfg = replace(countdown_run(tiny_model_dir, tmp_path, f"{path}:f"), eval_only=True)
    result = dapo.main(cfg)
    assert result["val/acc"] == 0.0 and result["val/reward_fn_error"] == 1.0
    said = [line for line in capsys.readouterr().out.splitlines() if "raised" in line]
    assert len(said) == 1, said
    assert said[0].startswith(f"warning: evaluation: --reward-fn {path}:f raised on 100% of the "
                              "responses (8 of 8), each scored as a wrong answer (-1); the "
                              "first: RuntimeError: planted, on a row of data_source 'custom'")


@pytest.mark.needs("all")
def test_a_run_whose_reward_fn_returns_nan_now_and_then_stops_at_the_first(tiny_model_dir,
                                                                           tmp_path):
    # before: every update was skipped (a NaN advantage), train/updates 0, and the run exited 0
    flaky = every_fourth_call(tmp_path, "return float('nan')")
    with pytest.raises(ValueError, match=rf"--reward-fn {re.escape(flaky)} returned nan for the "
                                         r"response '.*' \(ground truth '\{.*\}'\): a score"):
        dapo.main(countdown_run(tiny_model_dir, tmp_path, flaky))
    assert not (tmp_path / "run" / "checkpoints").exists()


def readme_section():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return text.split("## Your own task", 1)[1].split("\n## ", 1)[0]


@pytest.mark.needs("all")
def test_the_readme_commands_of_your_own_task_run_as_written(tiny_model_dir, tmp_path):
    """Each command of the section's first code block, run in a copy's place (tmp_path, the
    worktree on PYTHONPATH), with tiny settings appended (argparse: the last value wins)."""
    block = readme_section().split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [c.split("#")[0] for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    assert len(commands) == 2 and "--reward-fn examples/countdown.py:score" in commands[1]
    tiny = {"countdown.py": ["--rows", "40"],
            "dapo.py": ["--model", tiny_model_dir, "--steps", "1", "--train-prompts", "4",
                        "--gen-prompts", "4", "--mini-batch-prompts", "2", "--group-size", "2",
                        "--max-response-len", "8", "--overlong-buffer", "4", "--eval-every", "0",
                        "--eval-prompts", "2", "--eval-samples", "1", "--out-dir", "run"]}
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    os.symlink(os.path.join(ROOT, "dapo.py"), tmp_path / "dapo.py")
    for command in commands:
        args = shlex.split(command)
        assert args[0] == "python"
        extra = next(v for k, v in tiny.items() if args[1].endswith(k))
        out = subprocess.run([sys.executable, *args[1:], *extra], cwd=tmp_path, text=True,
                             capture_output=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": ROOT})
        if args[1] == "dapo.py":  # as the README says: the tiny model trains nothing, and says so
            assert out.returncode == 1 and "it trained nothing" in out.stdout, out.stderr[-3000:]
        else:
            assert out.returncode == 0, command + "\n" + out.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()


# --- round 4: what a hostile verifier does (each failed before its fix) ---------------------------

def test_a_verifier_that_calls_sys_exit_is_a_verifier_error_not_the_end_of_the_run(tmp_path):
    # before: SystemExit passed `except Exception`, and the run ended with exit status 0
    path = write(tmp_path / "mine.py", "import sys\ndef f(r, g):\n"
                                       "    if r != g:\n        sys.exit(0)\n    return 1.0\n")
    verifier = Verifier.load(f"{path}:f", False)
    verifier.check("7")
    out = verifier.score("custom", "8", "7")
    assert out == {"score": -1.0, "acc": False, "pred": "", "reward_fn_error": True}
    assert verifier.take_errors().startswith("SystemExit: the verifier called "
                                                     "sys.exit(0), on a row")
    with pytest.raises(ValueError, match=r"the check call f\('7', '7'\) failed: SystemExit: the "
                                         r"verifier called sys.exit\(3\)"):
        always = write(tmp_path / "always.py", "import sys\ndef f(r, g):\n    sys.exit(3)\n")
        verifier = Verifier.load(f"{always}:f", False)
        verifier.check("7")
    # sys.exit(4), not sys.exit(): once wandb has run in this process, its hook makes that 0
    at_import = write(tmp_path / "at_import.py", "import sys\nsys.exit(4)\n")
    with pytest.raises(ValueError, match=r"importing .*at_import.py failed: SystemExit: the "
                                         r"verifier called sys.exit\(4\)"):
        reward.load_reward_fn(f"{at_import}:f")


@pytest.mark.parametrize("timeout_s", [1e12, float("inf")])
def test_a_huge_or_infinite_reward_timeout_lets_a_slow_call_finish(tmp_path, monkeypatch,
                                                                   timeout_s):
    # before: past SLOW_SCORE_S the timer was re-armed for timeout_s and setitimer overflowed,
    # so every call longer than 10 s scored -1
    monkeypatch.setattr(reward, "SLOW_SCORE_S", 0.05)
    path = write(tmp_path / "mine.py", "import time\ndef f(r, g):\n    time.sleep(0.2)\n"
                                       "    return 1.0\n")
    verifier = Verifier.load(f"{path}:f", False, timeout_s=timeout_s)
    assert verifier.score("custom", "slow", "7") == {"score": 1.0, "acc": True, "pred": ""}
    assert verifier.take_errors() == ""


def test_the_check_call_scores_a_row_the_verifier_will_score(tiny_model_dir, tmp_path):
    # before: it scored the first training row, the toy task's '5' without --train-data (which
    # the built-in verifier scores), so --eval-only on your own task was impossible
    from data import load_tokenizer
    from launch import load_data
    val = plain_jsonl(tmp_path / "val.jsonl", [{"prompt": "x1?", "answer": "x1"}])
    picky = write(tmp_path / "picky.py", "def f(r, g):\n    assert g.startswith('x'), g\n"
                                         "    return float(r == g)\n")
    tok = load_tokenizer(tiny_model_dir)
    for eval_only in (True, False):  # training on the toy task, evaluating on your own
        cfg = Config(model=tiny_model_dir, val_data=val, reward_fn=f"{picky}:f",
                     eval_only=eval_only)
        assert load_data(cfg, tok, load_verifier(cfg))[1][0]["reward_model"]["ground_truth"] == "x1"
    broken = write(tmp_path / "broken.py", "def f(r, g):\n    raise KeyError(g)\n")
    cfg = Config(model=tiny_model_dir, val_data=val, reward_fn=f"{broken}:f", eval_only=True)
    with pytest.raises(ValueError, match=r"the check call f\('x1', 'x1'\) failed: KeyError"):
        load_data(cfg, tok, load_verifier(cfg))
    math_row = {"prompt": "1+1?", "answer": "2", "data_source": "math_dapo"}
    cfg = replace(cfg, val_data=plain_jsonl(tmp_path / "math.jsonl", [math_row]))
    # it scores no row: nothing to check it on
    assert len(load_data(cfg, tok, load_verifier(cfg))[1]) == 1


def test_a_numpy_score_is_a_score_and_a_non_bool_acc_is_refused(tmp_path):
    # before: np.float32(1.0) was refused as "expected a float", and an acc of "False" read as True
    path = write(tmp_path / "mine.py", "import numpy as np\n"
                                       "def f(r, g):\n    return np.float32(0.5)\n"
                                       "def n(r, g):\n    return {'score': np.int64(-1), "
                                       "'acc': np.bool_(False)}\n"
                                       "def s(r, g):\n    return {'score': 1.0, 'acc': 'False'}\n"
                                       "def third(r, g):\n    return 1 / 3 if False else "
                                       "__import__('fractions').Fraction(1, 3)\n")
    verifier = Verifier.load(f"{path}:f", False)
    assert verifier.score("custom", "7", "7") == {"score": 0.5, "acc": True, "pred": ""}
    verifier = Verifier.load(f"{path}:n", False)
    assert verifier.score("custom", "7", "7") == {"score": -1.0, "acc": False, "pred": ""}
    for name, error in [("s", r"'acc' must be a bool, got 'False' \(str\)"),
                        ("third", r"returned Fraction\(1, 3\) \(Fraction\); expected a float")]:
        verifier = Verifier.load(f"{path}:{name}", False)
        with pytest.raises(ValueError, match=rf"check call {name}\('7', '7'\) failed: "
                                             rf"TypeError: --reward-fn .*{error}"):
            verifier.check("7")


def test_a_score_beyond_float32_stops_the_run_as_an_inf_does(tmp_path):
    # before: 1e39 became inf in the fp32 reward tensor, every update was skipped, --lr blamed
    path = write(tmp_path / "mine.py", "def f(r, g):\n    return 1.0 if r == g else -1e39\n")
    verifier = Verifier.load(f"{path}:f", False)
    verifier.check("7")
    with pytest.raises(ValueError, match=r"returned -1e\+39 for the response '8' .*: a score must "
                                         r"be a finite number within float32's range"):
        verifier.score("custom", "8", "7")


def test_a_verifier_that_changes_directory_leaves_the_runs_own_as_it_was(tmp_path, monkeypatch):
    # before: its os.chdir moved the run, whose relative paths (runs/demo/metrics.jsonl) then
    # failed to open: "could not write ... (is the disk full?)"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    path = write(tmp_path / "mine.py", "import os\nos.chdir('elsewhere')\n"
                                       "def f(r, g):\n    os.chdir('/')\n    return 1.0\n")
    verifier = Verifier.load(f"{path}:f", False)
    assert os.getcwd() == str(tmp_path)  # at import
    verifier.check("7")
    assert verifier.score("custom", "7", "7")["score"] == 1.0
    assert os.getcwd() == str(tmp_path)  # after each call


@pytest.mark.needs("all")
def test_a_runs_verifier_ends_with_the_run(tiny_model_dir, tmp_path, capsys):
    # before: --reward-fn was reward.py's module state, installed by a run and left there: after
    # it, in the same process, rows of data_source 'custom' still loaded and were scored by it
    path = write(tmp_path / "mine.py", "def f(r, g):\n    if r == g:\n        return 1.0\n"
                                       "    raise RuntimeError('planted')\n")
    cfg = replace(countdown_run(tiny_model_dir, tmp_path, f"{path}:f"), eval_only=True)
    assert dapo.main(cfg)["val/reward_fn_error"] == 1.0
    with pytest.raises(ValueError, match="no reward function for data_source 'custom'"):
        load_rows(cfg.val_data)
    capsys.readouterr()
    math = plain_jsonl(tmp_path / "math.jsonl", [{"prompt": "1+1?", "answer": "2",
                                                  "data_source": "math_dapo"}])
    result = dapo.main(replace(cfg, reward_fn="", train_data=math, val_data=math,
                               out_dir=str(tmp_path / "second")))
    assert "val/reward_fn_error" not in result and "raised" not in capsys.readouterr().out


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
    verifier = Verifier.load(f"{path}:f", False)
    verifier.check("7")
    out = verifier.score("custom", "8", "7")
    assert out == {"score": -1.0, "acc": False, "pred": "", "reward_fn_error": True}
    assert verifier.take_errors().startswith("the verifier called os._exit(0), which would end "
                                             "the run, on a row of data_source 'custom'")
    assert os._exit is no_real_exit  # put back after the call
    with pytest.raises(ValueError, match=r"the check call always\('7', '7'\) failed: the "
                                         r"verifier called os._exit\(3\)"):
        Verifier.load(f"{path}:always", False).check("7")
    at_import = write(tmp_path / "at_import.py", "import os\nos._exit(4)\n")
    with pytest.raises(ValueError, match=r"importing .*at_import.py failed: the verifier called "
                                         r"os._exit\(4\)"):
        reward.load_reward_fn(f"{at_import}:f")


def test_os_exit_in_a_process_the_verifier_forked_ends_that_process(tmp_path):
    # a sandbox's child that ends with os._exit, as it should: the real one, its own status
    path = write(tmp_path / "sandbox.py", "import os\ndef f(r, g):\n    pid = os.fork()\n"
                                          "    if pid == 0:\n        os._exit(5)\n"
                                          "    return float(os.waitstatus_to_exitcode("
                                          "os.waitpid(pid, 0)[1]))\n")
    verifier = Verifier.load(f"{path}:f", False)
    assert verifier.score("custom", "7", "7")["score"] == 5.0
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
CALL_IT = """import json, sys, reward
verifier = reward.Verifier.load(sys.argv[1], False)
try:
    result = verifier.{call}
except ValueError as e:
    result = str(e)
print(json.dumps([result, verifier.take_errors()]), flush=True)
"""
CAME_BACK = (r"a process it forked \(pid \d+\) came back into the run instead of ending with "
             r"os._exit\(\): it was ended, exit status 70")


@pytest.mark.parametrize("call", ["score('custom', '7', '7')", "check('7')"])
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
    if call.startswith("score"):
        assert result == {"score": -1.0, "acc": False, "pred": "", "reward_fn_error": True}
        assert re.fullmatch(rf"{CAME_BACK}, on a row of data_source 'custom', ground truth '7', "
                            r"response '7'", errors), errors
    else:  # the run stops before it starts
        assert re.fullmatch(rf"--reward-fn .*forks.py:f: the check call f\('7', '7'\) failed: "
                            rf"{CAME_BACK}", result), result
