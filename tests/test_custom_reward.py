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

import pytest

import dapo
import reward
from config import Config
from data import load_rows
from examples.countdown import make_problem, make_row, score
from launch import install_custom_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTDOWN = os.path.join(ROOT, "examples", "countdown.py")


@pytest.fixture(autouse=True)
def no_custom_reward_left_behind():
    yield
    reward.uninstall_reward_fn()


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
        reward.install_reward_fn(f"{path}:{spec_name}", False, example_ground_truth="7")


@pytest.mark.parametrize("spec", ["mine.py", "mine:score", "mine.py:not a name"])
def test_a_malformed_spec_says_the_form(spec):
    with pytest.raises(ValueError, match="expected FILE.py:NAME"):
        reward.load_reward_fn(spec)


@pytest.mark.needs("extract_answer", "normalize")  # math_dapo keeps its own verifier
def test_floats_and_dicts_are_scores_and_acc_follows_the_sign(tmp_path):
    path = write(tmp_path / "mine.py", "def f(r, g):\n    return float(r == g) * 2 - 1\n"
                                       "def d(r, g):\n    return {'score': 0.5, 'acc': False}\n")
    reward.install_reward_fn(f"{path}:f", False)
    assert reward.score_response("custom", "7", "7") == {"score": 1.0, "acc": True, "pred": ""}
    assert reward.score_response("custom", "8", "7")["acc"] is False
    # a data_source with a built-in verifier keeps it unless every row is asked for
    assert reward.score_response("math_dapo", "Answer: 7", "7")["pred"] == "7"
    reward.install_reward_fn(f"{path}:d", True)
    assert reward.score_response("math_dapo", "Answer: 7", "7") == {"score": 0.5, "acc": False,
                                                                    "pred": ""}


def test_an_exception_during_the_run_is_a_logged_wrong_answer(tmp_path, caplog):
    path = write(tmp_path / "mine.py", "def f(r, g):\n    return 1.0 if r == g else int(r)\n")
    reward.install_reward_fn(f"{path}:f", False, example_ground_truth="7")
    with caplog.at_level(logging.WARNING):
        out = reward.score_response("custom", "seven", "7")
    assert out["score"] == -1.0 and out["acc"] is False
    assert re.search(r"--reward-fn .*:f raised ValueError.*ground truth '7', response 'seven'",
                     caplog.text)


def test_plain_jsonl_rows_become_chat_rows_scored_by_the_reward_fn(tmp_path):
    data = plain_jsonl(tmp_path / "plain.jsonl", [{"prompt": "2+3?", "answer": "5"},
                                                  {"prompt": "1+1?", "answer": 2}])
    with pytest.raises(ValueError, match=r"plain.jsonl:1: no reward function for data_source "
                                         r"'custom'.*--reward-fn"):
        load_rows(data)
    reward.install_reward_fn(f"{COUNTDOWN}:score", False)
    rows = load_rows(data)
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
    reward.install_reward_fn(f"{COUNTDOWN}:score", False)
    data = plain_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1?", "answer": "2"}, row])
    with pytest.raises(ValueError, match=error):
        load_rows(data)


def test_reward_fn_all_rows_needs_reward_fn():
    with pytest.raises(ValueError, match="--reward-fn-all-rows needs --reward-fn"):
        install_custom_reward(Config(reward_fn_all_rows=True))


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


@pytest.mark.needs("all")
def test_a_few_dapo_steps_on_countdown_with_a_raising_reward_fn(tiny_model_dir, tmp_path, caplog):
    subprocess.run([sys.executable, COUNTDOWN, "--rows", "40", "--out", str(tmp_path / "cd.jsonl")],
                   check=True, capture_output=True)
    # countdown's verifier, except that one response in every group raises
    flaky = write(tmp_path / "flaky.py", f"import sys\nsys.path.insert(0, {ROOT!r})\n"
                  "from examples.countdown import score\nCALLS = [0]\n"
                  "def flaky(response, truth):\n    CALLS[0] += 1\n"
                  "    if CALLS[0] % 4 == 0:\n        raise RuntimeError('planted')\n"
                  "    return score(response, truth)\n")
    cfg = Config(model=tiny_model_dir, out_dir=str(tmp_path / "run"), steps=2, train_prompts=4,
                 gen_prompts=4, group_size=4, max_response_len=12, overlong_buffer=4,
                 mini_batch_prompts=2, micro_batch_size=8, eval_every=0, eval_prompts=4,
                 eval_samples=2, max_prompt_len=160, dynamic_sampling=False,
                 train_data=str(tmp_path / "cd.jsonl"), val_data=str(tmp_path / "cd.jsonl"),
                 reward_fn=f"{flaky}:flaky")
    with caplog.at_level(logging.WARNING):
        dapo.main(cfg)
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in lines if "rollout/acc" in m] == [1, 2]
    assert "raised RuntimeError: planted" in caplog.text


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
        assert out.returncode == 0, command + "\n" + out.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
