"""The walkthrough notebook runs top to bottom with the project's current code (a failing cell
fails the test, naming it), what it prints is read from the code (the filter's verdicts, the
demo's settings as Config() has them), and the committed copy is the one its builder writes."""
import ast
import os
import re
import subprocess

import nbformat
import pytest

from config import Config
from notebooks import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_setup(source: str) -> bool:
    """A cell that only sets up (the Colab and path cell, or imports alone): it shows nothing."""
    body = ast.parse(source).body
    return "Colab" in source or all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in body)


@pytest.fixture(scope="module")
def executed():
    # as a user runs it: conftest's TRITON_INTERPRET=1 (inherited by the kernel) would put the
    # log-probs through the Triton interpreter, many times slower than the torch path
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TRITON_INTERPRET", raising=False)
        return build.execute(build.build())


def printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)


@pytest.mark.needs("all")  # its cells call the exercises' functions
def test_the_notebook_executes_every_cell_and_draws_its_figures(executed):
    silent = [c.source.split("\n")[0] for c in executed.cells if c.cell_type == "code"
              and not c.outputs and not is_setup(c.source)]
    assert not silent, f"cells that showed nothing: {silent}"
    figures = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs
               if "image/png" in o.get("data", {})]
    assert len(figures) >= 6


@pytest.mark.needs("all")
def test_the_filter_example_keeps_a_group_and_drops_one(executed):
    verdicts = re.findall(r"^group \d+: (\d+)/(\d+) right -> (kept|dropped)", printed(executed),
                          re.M)
    assert {"kept", "dropped"} <= {verdict for *_, verdict in verdicts}
    for right, size, verdict in verdicts:  # Eq. 11: dropped iff all wrong or all right
        assert (verdict == "dropped") == (right in ("0", size))


@pytest.mark.needs("all")
def test_the_settings_it_states_are_the_demos(executed):
    cfg, text = Config(), printed(executed)
    stated = {name: float(value) for name, value in
              re.findall(r"\b(L_max|L_cache|G|eps_low|eps_high) =? ?([\d.]+) \(--", text)}
    assert stated == {"L_max": cfg.max_response_len, "L_cache": cfg.overlong_buffer,
                      "G": cfg.group_size, "eps_low": cfg.eps_low, "eps_high": cfg.eps_high}
    steps = re.search(r"of the demo's (\d+) steps", text)
    assert steps and int(steps.group(1)) == cfg.steps


def test_the_committed_notebook_is_the_builders():
    committed = nbformat.read(build.PATH, as_version=4)
    sources = [c.source for c in committed.cells]
    assert sources == [c.source for c in build.build().cells], "rerun notebooks/build.py"


def test_the_committed_notebook_carries_its_outputs():
    if os.path.exists(os.path.join(ROOT, "EXERCISES.md")):  # students run it
        pytest.skip("a student handout: course/assign.py strips the outputs")
    committed = nbformat.read(build.PATH, as_version=4)
    assert all(c.outputs for c in committed.cells if c.cell_type == "code"
               and not is_setup(c.source))


def test_make_notebook_installs_what_it_imports_then_opens_or_runs_it(tmp_path):
    with open(os.path.join(ROOT, "requirements-notebook.txt")) as f:
        wanted = {re.split(r"[<>=\s]", line)[0] for line in f if line.strip()[:1] not in "#"}
    # the project's own requirements, the figures' matplotlib, Jupyter, and a kernel to run it in
    assert {"-r", "matplotlib", "notebook", "nbconvert", "ipykernel"} <= wanted
    for args, command in (([], "-m notebook notebooks/dapo_step.ipynb"),
                          (["RUN=1"], "-m jupyter nbconvert --to notebook --execute")):
        dry = subprocess.run(["make", "-n", "notebook", *args, f"VENV={tmp_path}/venv"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.index("-r requirements-notebook.txt") < dry.stdout.index(command)
