"""--reward-fn FILE.py:NAME, plain {"prompt", "answer"} JSONL rows and the Countdown example:
the reward file is checked before anything loads, its errors during a run are a logged wrong
answer, and a few DAPO steps train on Countdown rows scored by examples/countdown.py."""
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest

import dapo
from reward import Verifier
from config import Config
from data import load_rows
from examples.countdown import make_problem, make_row, score
from tmpfiles import plain_jsonl, write
from test_dapo import torch_kernel_path  # noqa: F401 (an autouse fixture: the PyTorch kernel path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTDOWN = os.path.join(ROOT, "examples", "countdown.py")


@pytest.mark.needs("extract_answer", "normalize")  # math_dapo keeps its own verifier
def test_floats_and_dicts_are_scores_and_acc_follows_the_sign(tmp_path):
    path = write(tmp_path / "mine.py", "def f(r, g):\n    return float(r == g) * 2 - 1\n"
                                       "def d(r, g):\n    return {'score': 0.5, 'acc': False}\n")
    verifier = Verifier.load(f"{path}:f", False)
    assert verifier.verify("custom", "7", "7") == {"score": 1.0, "acc": True, "pred": ""}
    assert verifier.verify("custom", "8", "7")["acc"] is False
    # a data_source with a built-in verifier keeps it unless every row is asked for
    assert verifier.verify("math_dapo", "Answer: 7", "7")["pred"] == "7"
    verifier = Verifier.load(f"{path}:d", True)
    assert verifier.verify("math_dapo", "Answer: 7", "7") == {"score": 0.5, "acc": False,
                                                                    "pred": ""}


def test_plain_jsonl_rows_become_chat_rows_scored_by_the_reward_fn(tmp_path):
    data = plain_jsonl(tmp_path / "plain.jsonl", [{"prompt": "2+3?", "answer": "5"},
                                                  {"prompt": "1+1?", "answer": 2}])
    with pytest.raises(ValueError, match=r"plain.jsonl:1: no reward function for data_source "
                                         r"'custom'.*--reward-fn"):
        load_rows(data, rewarded=Verifier().rewards)
    rows = load_rows(data, rewarded=Verifier.load(f"{COUNTDOWN}:score", False).rewards)
    assert rows == [
        {"data_source": "custom", "prompt": [{"role": "user", "content": "2+3?"}],
         "reward_model": {"ground_truth": "5", "style": "rule"}},
        {"data_source": "custom", "prompt": [{"role": "user", "content": "1+1?"}],
         "reward_model": {"ground_truth": "2", "style": "rule"}}]


def test_a_row_without_a_verifier_says_how_to_use_the_built_in_one(tmp_path):
    # before: the error pointed at --reward-fn only; "math_dapo" was in data.py alone
    data = plain_jsonl(tmp_path / "plain.jsonl", [{"prompt": "2+3?", "answer": "5"}])
    with pytest.raises(ValueError) as e:
        load_rows(data, rewarded=Verifier().rewards)
    assert 'give the row "data_source": "math_dapo" for the built-in verifier' in str(e.value)
    assert "--reward-fn FILE.py:NAME" in str(e.value)
    row = {"prompt": "2+3?", "answer": "5", "data_source": "math_dapo"}
    rows = load_rows(plain_jsonl(tmp_path / "math.jsonl", [row]), rewarded=Verifier().rewards)
    assert rows[0]["data_source"] == "math_dapo"


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
        load_rows(data, rewarded=verifier.rewards)


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
    subprocess.run([sys.executable, "-m", "examples.countdown", "--rows", "40", "--out",
                    str(tmp_path / "cd.jsonl")], cwd=ROOT, check=True, capture_output=True)
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
    assert [m["rollout/reward_fn_error"] for m in rows if "rollout/acc" in m] == [0.25, 0.25]
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
    tiny = {"examples.countdown": ["--rows", "40"],
            "dapo.py": ["--model", tiny_model_dir, "--steps", "1", "--train-prompts", "4",
                        "--gen-prompts", "4", "--mini-batch-prompts", "2", "--group-size", "2",
                        "--max-response-len", "8", "--overlong-buffer", "4", "--eval-every", "0",
                        "--eval-prompts", "2", "--eval-samples", "1", "--out-dir", "run"]}
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    os.symlink(os.path.join(ROOT, "dapo.py"), tmp_path / "dapo.py")
    for command in commands:
        args = shlex.split(command)
        assert args[0] == "python"
        extra = tiny[args[2] if args[1] == "-m" else args[1]]  # the module's or the script's
        out = subprocess.run([sys.executable, *args[1:], *extra], cwd=tmp_path, text=True,
                             capture_output=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": ROOT})
        if args[1] == "dapo.py":  # as the README says: the tiny model trains nothing, and says so
            assert out.returncode == 1 and "it trained nothing" in out.stdout, out.stderr[-3000:]
        else:
            assert out.returncode == 0, command + "\n" + out.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()


# --- round 4: what a hostile verifier does (each failed before its fix) ---------------------------


@pytest.mark.needs("all")
def test_a_runs_verifier_ends_with_the_run(tiny_model_dir, tmp_path, capsys):
    # before: --reward-fn was reward.py's module state, installed by a run and left there: after
    # it, in the same process, rows of data_source 'custom' still loaded and were scored by it
    path = write(tmp_path / "mine.py", "def f(r, g):\n    if r == g:\n        return 1.0\n"
                                       "    raise RuntimeError('planted')\n")
    cfg = replace(countdown_run(tiny_model_dir, tmp_path, f"{path}:f"), eval_only=True)
    assert dapo.main(cfg)["val/reward_fn_error"] == 1.0
    with pytest.raises(ValueError, match="no reward function for data_source 'custom'"):
        load_rows(cfg.val_data, rewarded=Verifier().rewards)
    capsys.readouterr()
    math = plain_jsonl(tmp_path / "math.jsonl", [{"prompt": "1+1?", "answer": "2",
                                                  "data_source": "math_dapo"}])
    result = dapo.main(replace(cfg, reward_fn="", train_data=math, val_data=math,
                               out_dir=str(tmp_path / "second")))
    assert "val/reward_fn_error" not in result and "raised" not in capsys.readouterr().out
