"""The dead-run alarms (infra/health.py) on constructed metrics rows, and the bound on dynamic
sampling that finds no signal."""
import json
from dataclasses import replace

import pytest
import torch

from infra import health
from infra.errors import UserError

HEALTHY = {"rollout/truncated": 0.1, "train/groups_kept": 8, "train/groups_surplus": 0,
           "rollout/frac_all_correct": 0.2, "rollout/frac_all_wrong": 0.3, "actor/entropy": 0.8}


def test_a_healthy_step_raises_no_alarm():
    assert health.dead_step_causes(HEALTHY) == []


@pytest.mark.parametrize("change, flag", [
    ({"rollout/truncated": 1.0}, "--max-response-len"),
    ({"train/groups_kept": 0}, "answer format"),
    ({"train/groups_kept": 0, "train/groups_surplus": 3}, "--max-gen-batches"),
    ({"actor/entropy": 0.0}, "collapsed"),
    ({"actor/entropy": float("nan")}, "collapsed"),
    ({"train/updates": 0, "train/skipped_updates": 2}, "all 2 optimizer steps skipped"),
    ({"train/groups_kept": 0, "rollout/reward_fn_error": 0.9},
     "no group with signal: --reward-fn f.py:score raised on 90% of the responses"),
])
def test_each_alarm_names_its_cause_and_fix(change, flag):
    causes = health.dead_step_causes(HEALTHY | change, reward_fn="f.py:score")
    assert len(causes) == 1 and flag in causes[0], causes


def test_a_few_reward_fn_errors_leave_the_prompt_format_the_suspect():
    few = health.dead_step_causes(HEALTHY | {"train/groups_kept": 0,
                                             "rollout/reward_fn_error": 0.1})
    assert len(few) == 1 and "answer format" in few[0], few


def test_a_step_with_one_update_taken_is_not_dead():
    assert health.dead_step_causes(HEALTHY | {"train/updates": 1, "train/skipped_updates": 1}) == []


def test_a_run_whose_every_update_was_skipped_never_finishes_quietly():
    alarms = health.Alarms(stop_when_stuck=0)  # never stops early
    skipped = HEALTHY | {"train/updates": 0, "train/skipped_updates": 2}
    for step in (1, 2):
        alarms.check(step, skipped)
    with pytest.raises(health.RunStuck, match="all 4 optimizer steps of this run were skipped"):
        alarms.finish()
    alarms.check(3, HEALTHY | {"train/updates": 1, "train/skipped_updates": 1})
    alarms.finish()  # one update taken: it trained
    health.Alarms(stop_when_stuck=0).finish()  # no step at all (a resume with nothing to do)


def test_stop_after_n_consecutive_dead_steps_only():
    alarms = health.Alarms(stop_when_stuck=2)
    dead = HEALTHY | {"train/groups_kept": 0}
    assert not alarms.check(1, dead)
    assert not alarms.check(2, HEALTHY)  # a healthy step resets the count
    assert not alarms.check(3, dead)
    assert alarms.check(4, dead)
    with pytest.raises(health.RunStuck, match="--stop-when-stuck 2"):
        alarms.raise_stuck()
    assert not any(health.Alarms(0).check(s, dead) for s in range(50))  # 0 = never stop


def test_sampling_without_signal_gives_up_after_the_bound(capsys):
    for n_gen in range(health.NO_SIGNAL_BOUND):
        health.check_sampling(n_gen, 0, 8)
    assert "dynamic sampling: 8 generation batches, 0 of 8" in capsys.readouterr().out
    with pytest.raises(UserError, match="no group with signal"):
        health.check_sampling(health.NO_SIGNAL_BOUND, 0, 8)
    health.check_sampling(health.NO_SIGNAL_BOUND, 1, 8)  # slow but alive: goes on


def _dead_run(model_dir, out_dir, **kw):
    """The demo's failure mode on a random model: it never writes "Answer:", so every group is
    all wrong, and at --max-response-len 2 every response is truncated."""
    from test_dapo import _cfg
    return _cfg(model_dir, out_dir, **{"max_response_len": 2, "overlong_buffer": 2,
                                       "eval_every": 0, "steps": 6, "dynamic_sampling": True,
                                       **kw})


@pytest.mark.needs("all")
def test_a_run_that_trains_on_nothing_warns_and_stops_with_a_checkpoint(
        tiny_model_dir, tmp_path, capsys):
    import dapo
    with pytest.raises(SystemExit) as stopped:  # a non-zero exit, its cause in one line
        dapo.main(_dead_run(tiny_model_dir, tmp_path, stop_when_stuck=2, max_gen_batches=1,
                            train_prompts=2, gen_prompts=2, mini_batch_prompts=2))
    assert stopped.value.code == 1
    out = capsys.readouterr().out
    assert "error: stopping: 2 consecutive steps" in out
    assert "warning: step 1: 100% of responses truncated: raise --max-response-len" in out
    assert "warning: step 2: no group with signal" in out
    saved = tmp_path / "checkpoints"
    assert (saved / "step_000002").is_dir() and not (saved / "step_000003").exists()


@pytest.mark.needs("all")
def test_a_run_that_never_had_a_group_to_train_on_exits_non_zero(tiny_model_dir, tmp_path,
                                                                 capsys):
    """Fewer steps than --stop-when-stuck, none with a group with signal: it trained nothing, so
    it must not exit 0 as a run that trained does (before: exit 0 after two warnings)."""
    import dapo
    with pytest.raises(SystemExit) as stopped:
        dapo.main(_dead_run(tiny_model_dir, tmp_path, steps=2, max_gen_batches=1,
                            train_prompts=2, gen_prompts=2, mini_batch_prompts=2))
    assert stopped.value.code == 1
    assert ("error: none of this run's 2 steps took an optimizer step (no group with signal, or "
            "no token in the loss): it trained nothing") in capsys.readouterr().out


@pytest.mark.needs("all")
def test_unbounded_dynamic_sampling_without_signal_gives_up(tiny_model_dir, tmp_path, capsys):
    import dapo
    with pytest.raises(UserError, match="no group with signal in 64 generation batches"):
        dapo.main(_dead_run(tiny_model_dir, tmp_path, max_gen_batches=0, gen_prompts=2,
                            train_prompts=2, mini_batch_prompts=2, group_size=2))
    assert "dynamic sampling: 56 generation batches, 0 of 2" in capsys.readouterr().out


@pytest.mark.parametrize("change, words", [
    ({"rollout/no_answer_finished": 0.95}, "no answer in 95% of the responses that ended"),
    ({"training/rollout_logp_diff_mean": 0.2}, "a temperature or top-p applied on one side"),
    ({"training/rollout_logp_diff_mean": float("nan")}, "rollout_logp_diff_mean nan"),
])
def test_a_wrong_signal_warns_but_does_not_count_as_a_dead_step(change, words, capsys):
    causes = health.wrong_signal_causes(HEALTHY | change, example="...x = 3")
    assert len(causes) == 1 and words in causes[0], causes
    assert health.wrong_signal_causes(HEALTHY | {"rollout/no_answer_finished": 0.5,
                                                 "training/rollout_logp_diff_mean": 1e-7}) == []
    alarms = health.Alarms(stop_when_stuck=1)
    assert not alarms.check(1, HEALTHY | change)  # it warns, every step, but trains on
    assert words in capsys.readouterr().out


def test_a_raising_reward_fn_warns_once_a_step_with_the_share_the_count_and_the_first_error():
    from batches import random_batch
    generated = random_batch(50)
    errors = torch.zeros(len(generated), dtype=torch.bool)
    errors[:3] = True
    line = health.reward_fn_warning(0.25, "f.py:score", "KeyError: 'x', on a row ...",
                                    replace(generated, reward_error=errors))
    assert line == (f"--reward-fn f.py:score raised on 25% of the responses (3 of "
                    f"{len(generated)}), each scored as a wrong answer (-1); the first: "
                    "KeyError: 'x', on a row ...")
    alarms = health.Alarms(stop_when_stuck=1, reward_fn="f.py:score")
    assert not alarms.check(1, HEALTHY | {"rollout/reward_fn_error": 0.25})  # trains on


@pytest.mark.needs("all")
def test_responses_without_an_answer_warn_and_show_one(tiny_model_dir, tmp_path, capsys,
                                                       monkeypatch):
    # every token ends a response: each is one token long, finished, and has no "Answer:", as a
    # model that answers in another format than the verifier reads
    import dapo
    import sampler
    generate = sampler.generate

    def every_token_ends(*args, eos_token_ids, **kw):
        return generate(*args, eos_token_ids=list(range(args[0].config.vocab_size)), **kw)
    monkeypatch.setattr(sampler, "generate", every_token_ends)
    from test_dapo import _cfg
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=1, eval_every=0, dynamic_sampling=False))
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "no answer" in x)
    with capsys.disabled():  # as a user sees it, for -s
        print(line)
    assert line.startswith("warning: step 1: the verifier found no answer in 100% of the "
                           "responses that ended: check that the prompt asks for the format")
    assert line.endswith("'") and "one ends '" in line, line  # the response, as repr shows it
    m = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")][1]  # after the settings row
    assert m["rollout/no_answer"] == m["rollout/no_answer_finished"] == 1.0
