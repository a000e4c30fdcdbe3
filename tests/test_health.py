"""The dead-run alarms (infra/health.py) on constructed metrics rows, and the bound on dynamic
sampling that finds no signal."""
import pytest

from infra import health

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
])
def test_each_alarm_names_its_cause_and_fix(change, flag):
    causes = health.dead_step_causes(HEALTHY | change)
    assert len(causes) == 1 and flag in causes[0], causes


def test_stop_after_n_consecutive_dead_steps_only():
    alarms = health.Alarms(stop_when_stuck=2)
    dead = HEALTHY | {"train/groups_kept": 0}
    assert not alarms.check(1, dead)
    assert not alarms.check(2, HEALTHY)  # a healthy step resets the count
    assert not alarms.check(3, dead)
    assert alarms.check(4, dead)
    assert "--stop-when-stuck 2" in str(alarms.error())
    assert not any(health.Alarms(0).check(s, dead) for s in range(50))  # 0 = never stop


def test_sampling_without_signal_gives_up_after_the_bound(capsys):
    for n_gen in range(health.NO_SIGNAL_BOUND):
        health.check_sampling(n_gen, 0, 8)
    assert "dynamic sampling: 8 generation batches, 0 of 8" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="no group with signal"):
        health.check_sampling(health.NO_SIGNAL_BOUND, 0, 8)
    health.check_sampling(health.NO_SIGNAL_BOUND, 1, 8)  # slow but alive: goes on
