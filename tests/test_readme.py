"""README.md's code references point where they say. A reference is written

    `name()` ([file.py:L10-L20](file.py#L10-L20))         the def (or class) `name`: exactly those lines
    `some code` ([file.py:L30-L34](file.py#L30-L34))      line 30 holds `some code`; the range stays in its def

so the "From the paper to the code" map cannot drift silently when a file changes. A failure says where the named
code is now. The `pytest ...` commands of the README select the tests it says they do."""
import ast
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = re.compile(r"`([^`]+)` \(\[([\w./]+):L(\d+)-L(\d+)\]\(([^)]*)\)\)")


def readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def references():
    return [(m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), m.group(5)) for m in REF.finditer(readme())]


def definitions(path):
    """{name: (first line, last line)} of every def and class in a file, decorators included."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.name: (min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno)
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_readme_maps_the_paper_to_the_code():
    refs = references()
    assert len(refs) >= 20  # the map is there, written in the form this test reads
    files = {path for _, path, _, _, _ in refs}
    assert {"dapo.py", "reward.py", "data.py", "sampler.py"} <= files


@pytest.mark.parametrize("anchor,path,start,end,link", references(), ids=lambda x: str(x)[:40])
def test_reference_points_at_its_code(anchor, path, start, end, link):
    assert link == f"{path}#L{start}-L{end}", "the link and the text of a reference differ"
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    defs = definitions(path)
    if anchor.endswith("()") and anchor[:-2] in defs:
        where = defs[anchor[:-2]]
        assert (start, end) == where, f"{anchor} is at {path}:L{where[0]}-L{where[1]}"
        return
    holding = [i + 1 for i, line in enumerate(lines) if anchor in line]
    assert holding, f"no line of {path} holds `{anchor}`"
    assert start in holding, f"`{anchor}` is at {path}:L{holding[0]}" + (f" (and {holding[1:]})" if holding[1:] else "")
    enclosing = [(a, b) for a, b in defs.values() if a <= start <= b]
    limit = min(b for _, b in enclosing) if enclosing else len(lines)
    assert start <= end <= limit, f"{path}:L{start}-L{end} runs past the end of its def (line {limit})"


def pytest_commands():
    """(command, the test names its comment promises) for each `pytest ...  # test_a, test_b` line of the README."""
    out = []
    for line in readme().splitlines():
        m = re.match(r"\s*(?:\.venv/bin/python -m )?(pytest [^#]+?)\s+#\s*(.+)", line)
        if m:
            out.append((m.group(1), sorted(set(re.findall(r"test_\w+", m.group(2))))))
    return out


COLLECT = """
import json, shlex, sys
import pytest

class Names:
    def pytest_collection_finish(self, session):
        self.names = sorted({item.originalname for item in session.items})

out = {}
for command in json.loads(sys.argv[1]):
    names = Names()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *shlex.split(command)[1:]], plugins=[names])
    out[command] = getattr(names, "names", None) if code == 0 else None
print("SELECTED " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def selected():
    """{command: names of the tests it collects}, all commands collected in one Python process (imports once)."""
    commands = [command for command, _ in pytest_commands()]
    out = subprocess.run([sys.executable, "-c", COLLECT, json.dumps(commands)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    line = next((l for l in out.stdout.splitlines() if l.startswith("SELECTED ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(line[len("SELECTED "):])


def test_the_instructors_section_has_commands():
    assert len(pytest_commands()) >= 6


@pytest.mark.parametrize("command,promised", pytest_commands(), ids=lambda x: str(x)[:50])
def test_pytest_command_selects_the_tests_it_names(command, promised, selected):
    assert selected[command] is not None, f"{command} does not collect"
    assert selected[command] == promised, f"{command} selects {selected[command]}"
