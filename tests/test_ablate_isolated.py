"""ablate_isolated.py: clip-higher's mechanism on a one-step policy, with dapo.py's own loss."""
import statistics

import pytest

from experiments.ablate_isolated import rollouts_to, run_bandit


@pytest.mark.needs("group_advantages", "policy_loss")
def test_a_raised_upper_clip_lets_the_rare_good_answers_rise_sooner():
    # the same seeds draw the same random numbers under either clip, so the runs are paired
    good = {eh: [run_bandit(eh, seed, rollouts=12)["good"][-1] for seed in range(3)]
            for eh in (0.2, 0.28)}
    assert all(raised > symmetric for raised, symmetric in zip(good[0.28], good[0.2]))
    assert statistics.fmean(good[0.28]) > 1.2 * statistics.fmean(good[0.2])


def test_rollouts_to_counts_a_miss_as_one_past_the_end():
    assert rollouts_to([0.1, 0.4, 0.6, 0.7], 0.5) == 3
    assert rollouts_to([0.1, 0.2], 0.5) == 3
