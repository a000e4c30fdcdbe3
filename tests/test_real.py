"""make real's pieces without the 93 MB model: the sums task and its verifier (examples/sums.py),
and experiments/real.py's wiring, end to end on a tiny random model."""
import json
import os
import sys
from dataclasses import asdict

import pytest
import torch

from config import Config, parse_args
from examples import sums
from experiments import real


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A random tiny Llama (SmolLM2's family: no biases) with the toy tokenizer."""
    from model import Transformer, preset
    from toy import make_toy_tokenizer
    d = str(tmp_path_factory.mktemp("llama"))
    tok = make_toy_tokenizer(d)
    torch.manual_seed(0)
    Transformer(preset("tiny", model_type="llama", vocab_size=tok.vocab_size)).save_pretrained(d)
    return d


@pytest.mark.parametrize("response, truth, acc", [
    ("7 + 12 = 19", "19", True),
    ("The sum of 7 and 12 is 19.", "19", True),
    ("19 is the answer, since 7 + 12 = 19", "19", True),
    ("7 + 12 = 19, and 19 + 1 = 20", "19", False),  # the last integer counts, not the first
    ("7 + 12 = 18", "19", False),
    ("nineteen", "19", False),  # no integer at all
    ("", "0", False),
    ("The total is 1,000", "1000", True),  # a thousands separator
    ("3 - 5 = -2", "-2", True),  # the sign belongs to the number
    ("19" + " filler" * 100, "19", False),  # beyond the last 300 characters
])
def test_the_verifier_reads_the_last_integer(response, truth, acc):
    assert sums.score(response, truth) == {"score": 1.0 if acc else -1.0, "acc": acc}


def test_the_split_holds_every_problem_once_and_no_pair_on_both_sides():
    train, val = sums.split_pairs(12, 64, seed=0)
    assert len(val) >= 64 and len(val) <= 65  # a pair adds 1 or 2 problems
    every = [(a, b) for a in range(13) for b in range(13)]
    assert sorted(train + val) == every  # each ordered problem exactly once
    # the pair {a, b} is on one side: "5 + 3" never validates a model trained on "3 + 5"
    assert not {frozenset(p) for p in train} & {frozenset(p) for p in val}


def test_the_split_is_seeded():
    assert sums.split_pairs(12, 64, 0) == sums.split_pairs(12, 64, 0)
    assert sums.split_pairs(12, 64, 0) != sums.split_pairs(12, 64, 1)


def test_too_few_numbers_for_the_held_out_problems_is_an_error():
    with pytest.raises(ValueError, match="none left to train on"):
        sums.split_pairs(3, 64, 0)  # 16 problems in all


def test_the_task_files_are_plain_rows_dapo_reads_and_the_verifier_scores(tmp_path):
    train_path, val_path = sums.write_task(str(tmp_path), max_number=12, val_problems=64)
    counts = []
    for path in (train_path, val_path):
        with open(path) as f:
            lines = f.readlines()
            counts.append(len(lines))
            for line in lines:
                row = json.loads(line)
                a, b = map(int, row["prompt"].removeprefix("What is ").rstrip("?").split(" + "))
                assert row["answer"] == str(a + b)
                assert sums.score(f"{a} + {b} = {a + b}", row["answer"])["acc"]
                assert set(row) == {"prompt", "answer"}  # a plain row: --reward-fn scores it
    assert counts[1] >= 64 and sum(counts) == 13 * 13


def test_dapo_argv_is_dapo_pys_command_line_with_the_settings(tmp_path):
    task = real.Task(str(tmp_path / "t.jsonl"), str(tmp_path / "v.jsonl"))
    cfg = parse_args(real.dapo_argv("some/model", task, str(tmp_path / "run"), seed=3))
    for name, value in real.SETTINGS.items():
        assert getattr(cfg, name) == value, name
    assert (cfg.model, cfg.train_data, cfg.val_data, cfg.seed, cfg.overwrite) == \
        ("some/model", task.train, task.val, 3, True)
    file, name = cfg.reward_fn.rsplit(":", 1)
    assert os.path.isfile(file) and name == "score"
    # every other flag is dapo.py's default
    wired = set(real.SETTINGS) | {"model", "train_data", "val_data", "reward_fn", "out_dir",
                                  "seed", "overwrite"}
    defaults = asdict(Config())
    assert {k: v for k, v in asdict(cfg).items() if k not in wired} == \
        {k: v for k, v in defaults.items() if k not in wired}


def test_make_real_takes_several_optimizer_steps_per_rollout():
    """The paper's shape at CPU size (512 / 32 = 16 steps a rollout there): with one step the
    ratio pi_theta / pi_old is 1 and the clip never binds."""
    settings = real.SETTINGS
    assert settings["train_prompts"] // settings["mini_batch_prompts"] >= 4
    assert settings["gen_prompts"] > settings["train_prompts"]  # dynamic sampling has a choice
    assert settings["overlong_buffer"] > 0 and "precision" not in settings  # auto: the fast one


def test_dapo_flags_given_to_make_real_override_its_settings(tmp_path):
    task = real.Task(str(tmp_path / "t.jsonl"), str(tmp_path / "v.jsonl"))
    argv = real.dapo_argv("m", task, str(tmp_path / "run"), seed=0,
                          overrides=("--precision", "fp32", "--steps", "3"))
    cfg = parse_args(argv)
    assert (cfg.precision, cfg.steps) == ("fp32", 3)


def test_side_by_side_marks_each_answer_with_the_verifiers_verdict():
    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}]
    table = real.side_by_side(rows, ["Two plus three\nis six, 6"], ["2 + 3 = 5"])
    lines = table.splitlines()
    assert lines[1] == "What is 2 + 3?  (answer 5)"
    left, right = lines[2].split(" | ")
    assert left.strip() == "- Two plus three / is six, 6" and right == "+ 2 + 3 = 5"


@pytest.mark.needs("all")
def test_make_real_runs_end_to_end_on_a_tiny_llama(tiny_llama_dir, tmp_path, monkeypatch,
                                                   capsys):
    # a random model answers no sum: without dynamic sampling its all-wrong groups still take the
    # optimizer step the run needs; one step, one evaluation of the held-out set at each end
    small = real.SETTINGS | dict(steps=1, train_prompts=2, gen_prompts=2, group_size=2,
                                 mini_batch_prompts=2, max_response_len=8, overlong_buffer=4,
                                 eval_every=1, eval_samples=1, precision="fp32")
    monkeypatch.setattr(real, "SETTINGS", small | {"dynamic_sampling": False})
    out = tmp_path / "real"
    with open(os.path.join(tiny_llama_dir, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"
    real.main(["--model", tiny_llama_dir, "--out-dir", str(out), "--threads", "1"])
    printed = capsys.readouterr().out
    assert "python dapo.py --steps 1" in printed and "--precision fp32" in printed
    assert printed.count("(answer ") == real.SHOWN  # the side-by-side table
    assert (out / "curves.png").stat().st_size > 0
    rows = [json.loads(line) for line in open(out / "dapo" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "val/acc" in r] == [0, 1]
    # last, the command that chats with the last checkpoint
    said, python, script, flag, model_dir = printed.strip().splitlines()[-1].rsplit(" ", 4)
    assert (said, flag, model_dir) == ("chat with it:", "--model",
                                       str(out / "dapo" / "checkpoints" / "step_000001" / "model"))
    assert os.path.samefile(python, sys.executable) and os.path.basename(script) == "chat.py"
    assert os.path.isfile(script) and os.path.isfile(os.path.join(model_dir, "config.json"))
