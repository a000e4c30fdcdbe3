"""assign.py: the exercise markers, the student handout generated from them, and the grader, on
the reference and on a fresh handout (whose own suite runs, minus its slowest tests); the grader's
scores are in test_grader.py."""
import ast
import json
import os
import re
import shutil
import subprocess

import pytest

from course import assign
from course.assign import (BY_ID, EXERCISES, INSTRUCTOR_ONLY, INTEGRATION_POINTS, NOT_DONE,
                           OPTIONAL, REQUIRED)
from config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The handout's own suite runs without these (marked like the others): the multi-process tests
# (torchrun, spawn: 5-50 s each), the ones that start a whole program in a process of its own
# (gpu-check's smoke run, the notebook's kernel, a fresh interpreter beside transformers: 100 s of
# the run's 190 s together, each also run on the reference), the Triton interpreter's (~0.3 s
# each, 60 of them), and the docs' pytest commands (a pytest process that collects the test
# names: the reference's)
FAST_SUITE = ["tests", "--ignore=tests/test_distributed.py", "-k", "not triton",
              "--deselect=tests/test_launch.py::test_a_dead_rank",
              "--deselect=tests/test_launch.py::test_a_stopped_rank",
              "--deselect=tests/test_launch.py::test_ranks_started",
              "--deselect=tests/test_linear_kernel.py::test_fsdp2_gradients_equal_one_process",
              "--deselect=tests/test_sampler.py::test_ranks",
              "--deselect=tests/test_kernels.py::test_kernels_compile_for_a_gpu",
              "--deselect=tests/test_readme.py::test_pytest_command_selects_the_tests_it_names",
              "--deselect=tests/test_launch.py::test_two_ranks_load_a_shard_each",
              "--deselect=tests/test_precision.py::test_the_loop_trains_in_bf16_on_two_fsdp_ranks",
              "--deselect=tests/test_precision.py::test_the_learning_canary_sees_the_step_in_bf16",
              "--deselect=tests/test_hub.py::test_under_torchrun",
              "--deselect=tests/test_loop_guards.py::test_under_torchrun",
              "--ignore=tests/test_gpu_check.py", "--ignore=tests/test_notebook.py",
              "--ignore=tests/test_ecosystem.py"]


def read(root, path):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return f.read()


def grading_exercise(nodeid):
    return next((e.id for e in EXERCISES if any(assign._matches(nodeid, t) for t in e.tests)), None)


# --- the markers and the registry ---

def test_the_registry_agrees_with_the_markers_and_names_tests_that_exist():
    regions = assign.marked_regions(ROOT, assign.source_files(ROOT))  # raises on a mismatch
    # the optional exercises are a bonus on top of the 100, listed last (the tables split there)
    assert sum(e.points for e in REQUIRED) + INTEGRATION_POINTS == 100
    assert OPTIONAL and EXERCISES == REQUIRED + OPTIONAL
    for e in EXERCISES:
        assert e.difficulty in ("easy", "medium", "hard") and e.points > 0 and e.hints
        assert not set(e.todo) & set('"\\')  # the failure reports it as is, even in a repr
        assert e.idea and set(e.idea) <= {t.split("::")[1] for t in e.tests}, e.id
        for test in e.tests:
            path, name = test.split("::")
            name = name.split("[")[0]  # one case of a parametrized test: test_x[gspo]
            assert name in {n.name for n in ast.walk(ast.parse(read(ROOT, path)))
                            if isinstance(n, ast.FunctionDef)}, test
    for path in ("model.py", "losses.py"):
        blanked = assign.blank(read(ROOT, path), regions[path])
        assert max(len(line) for line in blanked.splitlines() if NOT_DONE in line) <= 100, path


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
    (out / ".git").mkdir(parents=True)  # a clone of the students' empty repository
    assign.write_handout(str(out))
    (out / ".git" / "HEAD").write_text("ref")
    (out / "runs").mkdir()
    (out / "runs" / "metrics.jsonl").write_text("{}")
    os.remove(out / "toy.py")
    assign.write_handout(str(out))  # again: replaced, its git history and runs kept
    assert (out / ".git" / "HEAD").read_text() == "ref"
    assert (out / "runs" / "metrics.jsonl").read_text() == "{}"
    assert (out / "toy.py").is_file()


@pytest.mark.parametrize("change,error", [
    (lambda out: (out / "notes.txt").write_text("mine"), "notes.txt is not the handout's"),
    (lambda out: (out / "reward.py").write_text("mine"),
     "reward.py changed since the handout wrote it"),
    (lambda out: os.remove(out / assign.MANIFEST), "is not empty and holds no handout"),
], ids=["a file of its own", "an edited file", "no manifest"])
def test_a_handout_is_not_written_over_what_it_did_not_write(tmp_path, change, error):
    # before: any directory holding an EXERCISES.md was emptied, work not committed included
    out = tmp_path / "student"
    assign.write_handout(str(out))
    change(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=rf"^{re.escape(str(out))}(: | ){error}"):
        assign.write_handout(str(out))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


# --- a fresh handout ---

@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    out = tmp_path_factory.mktemp("handout") / "student"
    assign.write_handout(str(out))
    return str(out)


def test_the_handout_is_the_reference_with_each_exercise_blanked(handout):
    files = assign.source_files(ROOT)
    assert INSTRUCTOR_ONLY <= set(files)  # each name is a file that exists
    left_out = assign.instructor_files(ROOT, files)
    files = [f for f in files if f not in left_out]
    written = sorted(os.path.relpath(os.path.join(d, f), handout)
                     for d, _, names in os.walk(handout) for f in names)
    assert written == sorted(files + ["EXERCISES.md", assign.MANIFEST])
    assert sorted(assign.replaceable_files(handout)) == written  # the manifest lists them all
    regions = assign.marked_regions(ROOT, files)
    for path in files:
        expected = assign.blank(read(ROOT, path), regions[path]) if path in regions else \
            assign.student_readme(read(ROOT, path), ROOT, regions) if path == "README.md" else \
            read(ROOT, path) if path.endswith((".py", ".md")) else None
        if expected is not None:
            assert read(handout, path) == expected, path
    exercises = read(handout, "EXERCISES.md")
    for e in EXERCISES:
        assert f"`{e.id}`" in exercises and f"`make check EX={e.id}`" in exercises
        assert all(f"`{t.split('::')[1]}`" in exercises for t in e.tests)


def restore(root, exercise):
    """Put the reference's body of one exercise back into the copy at root."""
    path = BY_ID[exercise].file
    lines, ref = read(root, path).splitlines(True), read(ROOT, path).splitlines(True)
    regions = [r for r in assign.find_regions("".join(lines), path) if r.id == exercise]
    ref_regions = [r for r in assign.find_regions("".join(ref), path) if r.id == exercise]
    for r, s in reversed(list(zip(regions, ref_regions))):
        lines[r.start + 1:r.end] = ref[s.start + 1:s.end]
    with open(os.path.join(root, path), "w", encoding="utf-8") as f:
        f.write("".join(lines))


def test_the_handout_readme_says_it_is_a_student_copy_and_how_to_check_an_exercise(handout):
    readme = read(handout, "README.md")
    title, top = readme.split("\n")[0], readme.split("\n## ")[0]
    assert title == read(ROOT, "README.md").split("\n")[0]
    assert "This is a student copy" in top and "[EXERCISES.md](EXERCISES.md)" in top
    assert all(f"| `{e.id}` | `{e.file}` |" in top for e in EXERCISES)
    assert f"make check EX={assign.EXAMPLE}" in top
    # the hand-run command selects the example's tests, and only them (pytest -k: a substring)
    example = BY_ID[assign.EXAMPLE]
    command = next(line for line in top.splitlines() if " -m pytest " in line)
    path = re.search(r"(tests/\S+\.py) -k (\w+)  #", command).groups()
    names = {n.name for n in ast.walk(ast.parse(read(ROOT, path[0])))
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    assert {n for n in names if path[1] in n} == {t.split("::")[1] for t in example.tests}
    assert "docs/instructors.md" not in readme and "## Teaching with it" not in readme


def test_make_check_installs_the_test_requirements_then_runs_one_exercise(handout):
    dry = subprocess.run(["make", "-n", "check", "EX=rope", f"VENV={handout}/no-venv"],
                         cwd=handout, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    out = dry.stdout
    assert out.index("requirements-test.txt") < out.index("-m course.assign check rope")


def test_check_runs_an_exercises_tests_which_fail_until_it_is_written(handout, capfd):
    assert assign.check(["keep_groups"], root=handout) != 0  # (the reference's pass: the grader)
    out = capfd.readouterr().out
    assert f"{NOT_DONE}: keep_groups" in out and f"{len(BY_ID['keep_groups'].tests)} failed" in out


def test_make_run_in_the_handout_names_what_is_not_written_in_one_line(handout, tmp_path):
    copy = tmp_path / "student"
    shutil.copytree(handout, copy, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    (copy / ".venv").mkdir()
    (copy / ".venv" / ".runtime").touch()  # as after a first make run: nothing to install
    restore(str(copy), "keep_groups")
    # as a student types it, not as a sub-make of `make test` (which says "Entering directory")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "run"], cwd=copy, capture_output=True, text=True, timeout=60,
                         env=env)
    left = [e.id for e in REQUIRED if e.id != "keep_groups"]  # the demo runs no optional one
    assert out.returncode != 0 and not out.stdout
    (line,) = out.stderr.strip().splitlines()  # one line: no traceback
    assert f"{len(left)} are not written yet: {', '.join(left)} " in line
    assert assign.todo(str(copy)) == left and assign.todo(ROOT) == []  # the reference: runs


def reference_lines(exercise) -> set[str]:
    """The lines of an exercise's reference bodies that give it away: each line, and its code
    without the trailing comment, of 25 characters or more (a shorter one is generic:
    `return logits`, `mask = loss_mask.float()`)."""
    lines = read(ROOT, exercise.file).splitlines()
    regions = [r for r in assign.find_regions("\n".join(lines), exercise.file)
               if r.id == exercise.id]
    out = set()
    for r in regions:
        for line in lines[r.start + 1:r.end]:
            out |= {line.strip(), line.split("  #")[0].strip()}
    return {line for line in out if len(line) >= 25}


def handout_texts(handout) -> dict[str, str]:
    """{file: its text} for every text file of the handout; a notebook's text is its cells'
    sources and outputs, decoded from the JSON."""
    out = {}
    for d, _, names in os.walk(handout):
        for name in names:
            path = os.path.relpath(os.path.join(d, name), handout)
            try:
                text = read(handout, path)
            except UnicodeDecodeError:  # a picture
                continue
            if path.endswith(".ipynb"):
                cells = json.loads(text)["cells"]
                text += "\n".join("".join(c["source"]) + "\n" + "".join(
                    "".join(o.get("text", "")) + json.dumps(o.get("data", {}))
                    for o in c.get("outputs", [])) for c in cells)
            out[path] = text
    return out


def test_the_handout_holds_no_reference_body(handout):
    texts = handout_texts(handout)  # as grep -F: a reference line anywhere in a line is found
    for e in EXERCISES:
        wanted = reference_lines(e)
        assert len(wanted) >= 1, e.id  # the check has something to look for
        for line in wanted:
            found = [path for path, text in texts.items() if line in text]
            assert not found, f"{e.id}'s reference line {line!r} is in the handout's {found}"


def answer_sketches() -> list[str]:
    """The written part's answer sketches (docs/instructors.md), cut into clauses of 25
    characters or more, whitespace collapsed."""
    text = " ".join(read(ROOT, "docs/instructors.md").split("## The written part")[1].split())
    return [c.strip() for c in re.split(r"[.;:,()*]\s|\s[(*]", text) if len(c.strip()) >= 25]


def test_the_answer_sketches_state_the_demos_lengths():
    cfg = Config()
    sketch = " ".join(read(ROOT, "docs/instructors.md").split("## The written part")[1].split())
    stated = re.search(r"`--max-response-len` (\d+), `--overlong-buffer` (\d+)\), lengths up to "
                       r"L_max - L_cache = (\d+) cost nothing, (\d+)-(\d+) lose", sketch)
    assert stated, "the overlong sketch no longer says which settings its lengths are"
    short = cfg.max_response_len - cfg.overlong_buffer
    assert [int(n) for n in stated.groups()] == \
        [cfg.max_response_len, cfg.overlong_buffer, short, short, cfg.max_response_len]


def test_the_handout_holds_no_answer_sketch_and_no_notebook_output(handout):
    sketches = answer_sketches()
    assert len(sketches) >= 10
    for path in assign.source_files(handout):
        try:
            text = " ".join(read(handout, path).split())
        except UnicodeDecodeError:
            continue
        assert not [c for c in sketches if c in text], path
        if path.endswith(".ipynb"):  # its outputs answer the written part: students run it
            cells = json.loads(read(handout, path))["cells"]
            assert not any(c.get("outputs") or c.get("execution_count") for c in cells), path


def test_a_test_file_with_a_private_test_stays_out_of_a_handout(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_private_loss.py").write_text(
        'import pytest\n\n\n@pytest.mark.grades("policy_loss")\ndef test_x():\n    pass\n')
    (tmp_path / "tests" / "test_public.py").write_text("def test_y():\n    pass\n")
    files = ["tests/test_private_loss.py", "tests/test_public.py"]
    assert assign.instructor_files(str(tmp_path), files) == {"tests/test_private_loss.py"}


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
