"""ablate_toy.py: the ablation's task, its rows, the warm-up data, and the lengths the regime relies
on."""
import random
import statistics

import pytest

from experiments import ablate_toy as T
import reward
from toy import make_toy_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_toy_tokenizer(str(tmp_path_factory.mktemp("tok")))


class NoSlip(random.Random):
    def random(self):  # every draw above any threshold: no slip, no working, no filler
        return 0.999


def test_counting_on_moves_one_across_per_line_and_ends_at_the_sum():
    text, answer = T.counting_on(38, 3, NoSlip())
    assert text == "= 39+2\n= 40+1\n= 41" and answer == 41


def test_rows_hold_every_problem_once_with_disjoint_held_out_split():
    train, test = T.ablation_rows("train"), T.ablation_rows("test")
    prompts = [r["prompt"][0]["content"] for r in train + test]
    assert len(prompts) == len(set(prompts)) == len(T.ABL_A) * len(T.ABL_K)
    assert 0.1 < len(test) / len(prompts) < 0.3  # 1 in 5 by a hash of the problem
    a, k = map(int, test[0]["prompt"][0]["content"].split("+"))
    assert test[0]["reward_model"]["ground_truth"] == str(a + k)


@pytest.mark.needs("extract_answer", "normalize")
def test_a_worked_response_is_scored_right_by_math_dapo():
    response = "= 39+2\n= 40+1\n= 41\nLet me check. Let me check.\nAnswer: 41"
    assert reward.verify_built_in(T.TOY_DATA_SOURCE, response, "41")["acc"]
    assert T.is_worked(response) and T.filler_repeats(response) == 2


def test_warm_up_works_half_the_time_while_learning_the_skill_then_rarely():
    pairs = T.ablation_warmup_pairs(4000, seed=0, skill=2000)
    worked = [T.is_worked(response) for _, response in pairs]
    assert statistics.fmean(worked[:2000]) == pytest.approx(0.5, abs=0.04)
    assert statistics.fmean(worked[2000:]) == pytest.approx(T.ABL_WORK_PROB, abs=0.03)


def test_the_longest_working_fits_before_the_penalty_but_not_with_much_filler(tok):
    # the regime's premise: truncation cuts off sound working only when the response also rambles
    worst = max(len(tok.encode(T.counting_on(a, k, NoSlip())[0] + f"\nAnswer: {a + k}"))
                + 1  # + EOS
                for a in T.ABL_A for k in T.ABL_K)
    assert worst <= T.ABL_MAX_RESPONSE_LEN - T.ABL_OVERLONG_BUFFER
    filler = len(tok.encode(" ".join([T.TOY_FILLER] * T.ABL_RAMBLE_REPEATS[1])))
    assert worst + filler > T.ABL_MAX_RESPONSE_LEN
