"""assign.py: the exercise markers, the student handout generated from them, and the grader, on
the reference and on a fresh handout (whose own suite runs, minus its slowest tests); the grader's
scores are in test_grader.py."""
import ast
import os
import re
import subprocess

import pytest

import assign
from assign import BY_ID, EXERCISES, INSTRUCTOR_ONLY, INTEGRATION_POINTS, NOT_DONE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The handout's own suite runs without these (marked like the others): the multi-process tests
# (torchrun, spawn: 5-50 s each), the Triton interpreter's (~0.3 s each, 60 of them), and the
# docs' pytest commands (a pytest process that collects the test names: the reference's)
FAST_SUITE = ["tests", "--ignore=tests/test_distributed.py", "-k", "not triton",
              "--deselect=tests/test_linear_kernel.py::test_fsdp2_gradients_equal_one_process",
              "--deselect=tests/test_sampler.py::test_ranks",
              "--deselect=tests/test_kernels.py::test_kernels_compile_for_a_gpu",
              "--deselect=tests/test_readme.py::test_pytest_command_selects_the_tests_it_names"]


def read(root, path):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return f.read()


def grading_exercise(nodeid):
    return next((e.id for e in EXERCISES if any(assign._matches(nodeid, t) for t in e.tests)), None)


# --- the markers and the registry ---

def test_the_registry_agrees_with_the_markers_and_names_tests_that_exist():
    regions = assign.marked_regions(ROOT, assign.source_files(ROOT))  # raises on a mismatch
    assert sum(e.points for e in EXERCISES) + INTEGRATION_POINTS == 100
    for e in EXERCISES:
        assert e.difficulty in ("easy", "medium", "hard") and e.points > 0 and e.hints
        assert not set(e.todo) & set('"\\')  # the failure reports it as is, even in a repr
        assert e.idea and set(e.idea) <= {t.split("::")[1] for t in e.tests}, e.id
        for test in e.tests:
            path, name = test.split("::")
            assert name in {n.name for n in ast.walk(ast.parse(read(ROOT, path)))
                            if isinstance(n, ast.FunctionDef)}, test
    blanked = assign.blank(read(ROOT, "model.py"), regions["model.py"])
    assert max(len(line) for line in blanked.splitlines() if NOT_DONE in line) <= 100


def test_the_instructors_table_is_the_registry():
    regions = assign.marked_regions(ROOT, assign.source_files(ROOT))
    rows = re.findall(r"^\| `(\w+)` \| (.+) \| (.+) \| (\w+) \| (\d+) \|$",
                      read(ROOT, "docs/instructors.md"), re.M)
    assert [(id, paper, level, int(points)) for id, _, paper, level, points in rows] == \
        [(e.id, e.paper, e.difficulty, e.points) for e in EXERCISES]
    for (_, where, *_), e in zip(rows, EXERCISES):
        assert where.endswith(f" in {e.file}"), where
        assert all(f"`{name}()`" in where for name in assign.functions(ROOT, e, regions)), where


@pytest.mark.parametrize("text,error", [
    ("# exercise: a\nx = 1\n", "never closed"),
    ("x = 1\n# end exercise\n", "without a start"),
    ("# exercise: a\n# exercise: b\n", "inside exercise"),
    ("# exercise: a\n# end exercise\n", "marks nothing"),
    ("def f():\n    # exercise: a\n    x = 1\n# end exercise\n", "without a start"),
])
def test_malformed_markers_are_refused_with_their_line(text, error):
    with pytest.raises(ValueError, match=error):
        assign.find_regions(text, "f.py")


def test_no_shipped_python_file_holds_an_unwritten_body():
    for path in assign.source_files(ROOT):
        if path.endswith(".py"):
            assert NOT_DONE not in read(ROOT, path), path


def test_source_files_are_what_git_tracks(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    git("init", "-q")
    for name in ("a.py", "junk.py", "runs/x.json", ".gitignore"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("runs/\n" if name == ".gitignore" else "")
    git("add", "a.py", ".gitignore")
    git("add", "-f", "runs/x.json")  # tracked by mistake: still no part of a handout
    assert assign.source_files(str(tmp_path)) == [".gitignore", "a.py"]


def test_a_handout_is_written_only_where_it_replaces_nothing_else(tmp_path):
    with pytest.raises(ValueError, match="holds the repository"):
        assign.write_handout(ROOT)
    with pytest.raises(ValueError, match="lies in it outside runs"):
        assign.write_handout(os.path.join(ROOT, "tests", "handout"))
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no handout"):
        assign.write_handout(str(tmp_path))
    out = tmp_path / "student"
    assign.write_handout(str(out))
    (out / ".git").mkdir()
    (out / "stale.py").write_text("")
    assign.write_handout(str(out))  # again: replaced, its git history kept
    assert (out / ".git").is_dir() and not (out / "stale.py").exists()


# --- a fresh handout ---

@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    out = tmp_path_factory.mktemp("handout") / "student"
    assign.write_handout(str(out))
    return str(out)


def test_the_handout_is_the_reference_with_each_exercise_blanked(handout):
    files = [f for f in assign.source_files(ROOT) if f not in INSTRUCTOR_ONLY]
    written = sorted(os.path.relpath(os.path.join(d, f), handout)
                     for d, _, names in os.walk(handout) for f in names)
    assert written == sorted(files + ["EXERCISES.md"])
    regions = assign.marked_regions(ROOT, files)
    for path in files:
        expected = assign.blank(read(ROOT, path), regions[path]) if path in regions else \
            read(ROOT, path) if path.endswith((".py", ".md")) else None
        if expected is not None:
            assert read(handout, path) == expected, path
    exercises = read(handout, "EXERCISES.md")
    for e in EXERCISES:
        assert f"`{e.id}`" in exercises and " \\\n    ".join(e.tests) in exercises


@pytest.fixture(scope="module")
def handout_suite(handout):
    return assign.run_tests(FAST_SUITE, root=handout, timeout=600)


def test_in_the_handout_each_exercise_test_fails_on_its_own_exercise(handout_suite):
    graded = [r for r in handout_suite if grading_exercise(r["nodeid"])]
    assert {grading_exercise(r["nodeid"]) for r in graded} == set(BY_ID)
    for r in graded:
        assert r["outcome"] == "failed" and r["exercise"] == grading_exercise(r["nodeid"]), r
        assert r["message"].startswith(f"{NOT_DONE}: {r['exercise']}: "), r


def test_in_the_handout_every_other_test_passes_or_needs_the_exercise_it_stops_at(handout_suite):
    others = [r for r in handout_suite if not grading_exercise(r["nodeid"])]
    assert len(others) > 250 and not [r for r in handout_suite if r["outcome"] == "error"]
    for r in others:
        if r["outcome"] == "failed":
            assert r["exercise"] in r["needs"] or (r["exercise"] and "all" in r["needs"]), r
    assert any(r["outcome"] == "passed" for r in others)
