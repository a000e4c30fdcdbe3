"""The walkthrough notebook runs top to bottom with the project's current code (a failing cell
fails the test, naming it), and the committed copy is the one its builder writes."""
import os
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "notebooks"))
import build  # noqa: E402  (notebooks/build.py)


@pytest.mark.needs("all")  # its cells call the exercises' functions
def test_the_notebook_executes_every_cell(monkeypatch):
    # as a user runs it: conftest's TRITON_INTERPRET=1 (inherited by the kernel) would put the
    # log-probs through the Triton interpreter, many times slower than the torch path
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    nb = build.execute(build.build())
    silent = [c.source.split("\n")[0] for c in nb.cells if c.cell_type == "code"
              and not c.outputs and "Colab" not in c.source]
    assert not silent, f"cells that showed nothing: {silent}"


def test_the_committed_notebook_is_the_builders_with_outputs():
    committed = nbformat.read(build.PATH, as_version=4)
    sources = [c.source for c in committed.cells]
    assert sources == [c.source for c in build.build().cells], "rerun notebooks/build.py"
    if os.path.exists(os.path.join(ROOT, "EXERCISES.md")):
        return  # a student handout: course/assign.py strips the outputs (students run it)
    assert all(c.outputs for c in committed.cells if c.cell_type == "code"
               and "import" not in c.source.split("\n")[0] and "Colab" not in c.source)
