"""The grader (assign.py grade): full marks on the reference, nothing on a blank handout, exactly
one exercise's points when its body is put back, the idea tests' half, private extra tests, and
each exercise graded by the tests that reach it alone. Apart from test_assign.py so that the two
halves of the course's slowest tests run side by side under pytest-xdist (--dist loadfile)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from course import assign
from course.assign import BY_ID, EXERCISES, INTEGRATION_POINTS, OPTIONAL, REQUIRED

from test_assign import ROOT, grading_exercise, read, restore  # the registry's helpers


@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    out = tmp_path_factory.mktemp("handout") / "student"
    assign.write_handout(str(out))
    return str(out)


def test_the_grader_gives_nothing_for_the_blank_handout(handout, tmp_path):
    result = tmp_path / "results.json"
    out = subprocess.run([sys.executable, "-m", "course.assign", "grade", "--json", str(result)],
                         cwd=handout, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads(result.read_text())
    assert report["score"] == 0 and report["max_score"] == 100  # the optional ones: a bonus
    scores = {t["name"]: (t["score"], t["max_score"]) for t in report["tests"]}
    assert scores == {**{e.id: (0, e.points) for e in EXERCISES},
                      "integration": (0, INTEGRATION_POINTS)}
    assert [t["name"] for t in report["tests"] if t.get("tags") == ["optional"]] == \
        [e.id for e in OPTIONAL]
    # nothing trains without the required exercises; the demo never waits on the optional ones
    assert report["tests"][-1]["output"].startswith("not run")
    assert not [e.id for e in OPTIONAL if e.id in report["tests"][-1]["output"]]
    assert "not written" in out.stdout and "0.0 / 100" in out.stdout
    assert f"0.0 / {sum(e.points for e in OPTIONAL)}" in out.stdout.split("bonus points")[1]


def test_restoring_one_exercise_in_the_handout_gives_exactly_its_points(handout, tmp_path):
    one = str(tmp_path / "one")
    shutil.copytree(handout, one, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    restore(one, "token_count")  # in update_policy, with three other exercises in dapo.py
    restore(one, "cispo")  # an optional one, between two others in losses.py: its bonus
    report = assign.grade(json_path=str(tmp_path / "results.json"), integration=False, root=one)
    assert {t["name"]: t["score"] for t in report["tests"] if t["score"]} == \
        {"token_count": 8, "cispo": 4}
    assert (report["score"], report["max_score"]) == (12, 100 - INTEGRATION_POINTS)


# --- the reference ---

def test_the_grader_gives_full_marks_on_the_reference(tmp_path):
    report = assign.grade(json_path=str(tmp_path / "results.json"), integration=False)
    assert [(t["name"], t["score"], t["status"]) for t in report["tests"]] == \
        [(e.id, e.points, "passed") for e in EXERCISES]
    # the optional exercises' points on top of the required ones' maximum
    assert report["max_score"] == sum(e.points for e in REQUIRED)
    assert report["score"] == sum(e.points for e in EXERCISES)
    assert json.loads((tmp_path / "results.json").read_text()) == report


PRIVATE = """
import pytest
import torch

from dapo import keep_groups


@pytest.mark.grades("keep_groups")
def test_private_groups_of_two():
    assert keep_groups(torch.tensor([True, False, True, True]), 2).tolist() == [True, False]


@pytest.mark.grades("keep_groups")
def test_private_expects_the_wrong_answer():
    assert keep_groups(torch.tensor([True, True]), 2).tolist() == [True]
"""


def test_a_solution_that_misses_the_idea_scores_at_most_half():
    policy_loss = assign.BY_ID["policy_loss"]
    idea = f"tests/test_dapo.py::{policy_loss.idea[1]}[2-micro-batches]"
    other = next(t for t in policy_loss.tests if t.split("::")[1] not in policy_loss.idea)
    # one case of an idea test failed out of 20: half the points are gone with it
    assert assign.exercise_score(policy_loss, 19, 20, [(idea, "")]) == 12 * (0 + 0.5 * 19 / 20)
    # the same count of failures elsewhere keeps the idea's half
    assert assign.exercise_score(policy_loss, 19, 20, [(other, "")]) == 12 * (0.5 + 0.5 * 19 / 20)
    assert assign.exercise_score(policy_loss, 20, 20, []) == 12


# Idea-level mistakes, each in the body of its exercise: (exercise, reference line, the mistake);
# one grading run scores a list, so a list holds at most one mistake of an exercise
MISTAKES = [
    # the first Answer: instead of the last (a response that corrects itself ends with its answer)
    ("extract_answer", "return found[-1] if found else NO_ANSWER",
     "return found[0] if found else NO_ANSWER"),
    # the two clip bounds swapped (Eq. 10)
    ("policy_loss", "clipped = ratio.clamp(1 - eps_low, 1 + eps_high)",
     "clipped = ratio.clamp(1 - eps_high, 1 + eps_low)"),
    # the population std where Eq. 9 (and verl) take the unbiased one
    ("group_advantages", "(r.std(1, keepdim=True) + eps)",
     "(r.std(1, keepdim=True, unbiased=False) + eps)"),
    # the optional ones (losses.py). Dr. GRPO's advantage still divided by the group's std
    ("dr_grpo", "return (r - mean).flatten()", "return ((r - mean) / (std + eps)).flatten()"),
    # GSPO's log s_i left attached: its gradient counts twice, once
    # through each token's logp and once through the sequence mean
    ("gspo", "log_s.detach()[:, None]", "log_s[:, None]"),
    # CISPO's clipped weight not detached: the weight's own gradient joins -clip(r) A
    ("cispo", "loss_tok = -weight.detach() * adv * logp", "loss_tok = -weight * adv * logp"),
    # KL-Cov's covariance without its means: the product A logp picks other tokens
    ("kl_cov", "cov = (a - a.mean()) * (lp - lp.mean())", "cov = a * lp"),
]
MORE_MISTAKES = [
    # the batch's mean where each group's belongs
    ("dr_grpo", "mean, std = r.mean(1, keepdim=True), r.std(1, keepdim=True)",
     "mean, std = r.mean(), r.std(1, keepdim=True)"),
    # GSPO's log s_i a mean over the padded width, padding included
    ("gspo", "log_s = ((logp - old_logp) * mask).sum(-1) / n",
     "log_s = (logp - old_logp).mean(-1)"),
    # CISPO written as PPO's clip: a clipped token loses its gradient, which is what CISPO keeps
    ("cispo", "loss_tok = -weight.detach() * adv * logp",
     "loss_tok = torch.maximum(-adv * ratio, -adv * weight)"),
    # KL-Cov's penalty on every token of the loss, not on the top k alone
    ("kl_cov", "torch.where(penalised, loss_tok +", "torch.where(mask > 0, loss_tok +"),
]


@pytest.mark.parametrize("mistakes", [MISTAKES, MORE_MISTAKES], ids=["mistakes", "more"])
def test_an_idea_level_mistake_keeps_at_most_half_the_points(tmp_path, mistakes):
    """Each mistake planted in an otherwise complete copy (one exercise each, so one grading run
    scores them all): an idea test fails, and at most half the points are left."""
    copy = tmp_path / "copy"
    for path in assign.source_files(ROOT):
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, path), copy / path)
    for exercise, line, mistake in mistakes:
        text = read(str(copy), BY_ID[exercise].file)
        assert text.count(line) == 1, f"{exercise}: the reference no longer holds {line!r}"
        (copy / BY_ID[exercise].file).write_text(text.replace(line, mistake))
    report = assign.grade([e for e, _, _ in mistakes], json_path=str(tmp_path / "results.json"),
                          root=str(copy))
    scores = {t["name"]: t["score"] for t in report["tests"]}
    assert all(scores[e] <= BY_ID[e].points / 2 for e, _, _ in mistakes), scores
    for t in report["tests"]:
        assert any(f"::{idea}" in t["output"] for idea in BY_ID[t["name"]].idea), t["name"]


def test_extra_tests_count_for_the_exercise_they_name(tmp_path):
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "test_private_groups.py").write_text(PRIVATE)
    report = assign.grade(["keep_groups"], extra_tests=str(tmp_path / "private"),
                          json_path=str(tmp_path / "results.json"))
    (entry,) = report["tests"]  # one exercise asked for: no integration check either
    # keep_groups's idea test passes: half of 5, and 5 / 2 * 3 / 4 for the tests that pass
    assert (entry["tests_passed"], entry["tests_total"]) == (3, 4) and entry["score"] == 4.38
    assert "test_private_expects_the_wrong_answer" in entry["output"]


def test_each_exercise_is_graded_by_tests_that_run_it_and_no_other(tmp_path, monkeypatch):
    """A copy of the reference whose marked bodies log, first thing, which test reached them:
    each exercise's tests reach that exercise alone, so that its points never wait on another."""
    copy, log = tmp_path / "probe", tmp_path / "reached.txt"
    for path in assign.source_files(ROOT):
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, path), copy / path)
    for path, regions in assign.marked_regions(ROOT, assign.source_files(ROOT)).items():
        lines = read(ROOT, path).splitlines(True)
        for r in sorted(regions, key=lambda r: r.start, reverse=True):
            probe = f"__import__('course.assign').assign.reached({r.id!r})"
            lines.insert(r.start + 1, f"{r.indent}{probe}\n")
        (copy / path).write_text("".join(lines))
    (copy / "course" / "assign.py").write_text(read(ROOT, "course/assign.py") + PROBE)
    monkeypatch.setenv("REACHED_LOG", str(log))
    records = assign.run_tests([t for e in EXERCISES for t in e.tests], root=str(copy))
    assert records and all(r["outcome"] == "passed" for r in records)
    reached = {}
    for line in log.read_text().splitlines():
        test, exercise = line.split("\t")
        reached.setdefault(test, set()).add(exercise)
    for r in records:
        assert reached.get(r["nodeid"]) == {grading_exercise(r["nodeid"])}, r["nodeid"]


PROBE = '''

def reached(exercise):
    test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    with open(os.environ["REACHED_LOG"], "a") as f:
        f.write(f"{test}\\t{exercise}\\n")
'''
