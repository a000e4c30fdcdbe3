"""The README's map from the paper to the code names things that exist: `name()` in `file.py` is a
def or class of that file, any other `text` in `file.py` is a line of it (a banner, a statement),
so the map cannot drift silently when the code changes. The `pytest ...` commands of the docs
select the tests they say they do."""
import ast
import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = re.compile(r"`([^`]+)` in `([\w./]+)`")


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def references():
    return sorted(set(REF.findall(read("README.md"))))


def definitions(path):
    """Names of every def and class in a file."""
    return {node.name for node in ast.walk(ast.parse(read(path)))
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_readme_maps_the_paper_to_the_code():
    refs = references()
    assert len(refs) >= 25  # the map is there, written in the form this test reads
    assert {"dapo.py", "reward.py", "data.py", "sampler.py"} <= {path for _, path in refs}


@pytest.mark.parametrize("anchor,path", references(), ids=lambda x: str(x)[:40])
def test_reference_names_code_that_exists(anchor, path):
    if anchor.endswith("()") and "." not in anchor:
        assert anchor[:-2] in definitions(path), f"{path} defines no {anchor}"
    else:
        assert anchor in read(path), f"no line of {path} holds `{anchor}`"


ALGORITHM_1 = re.compile(r"Algorithm 1, lines? (\d+(?:-\d+)?)")


def test_the_readme_numbers_algorithm_1_as_dapo_py_does():
    # one numbering of the paper's Algorithm 1 (line 6 fills the buffer, lines 7-8 loop until it
    # is full, ...): every line the README's map names is one dapo.py's comments name, and back
    table = "".join(line for line in read("README.md").splitlines(True) if line.startswith("|"))
    in_readme, in_code = set(ALGORITHM_1.findall(table)), set(ALGORITHM_1.findall(read("dapo.py")))
    assert {"1", "6", "7-8", "10-11"} <= in_readme
    assert in_readme == in_code, f"README only: {in_readme - in_code}, dapo.py only: " \
                                 f"{in_code - in_readme}"


def docs():
    return read("README.md") + "".join(read(p) for p in sorted(glob.glob(f"{ROOT}/docs/*.md")))


def pytest_commands():
    """(command, the test names its comment promises) for each `pytest ...  # test_a, test_b` line
    of the README and docs/."""
    out = []
    for line in docs().splitlines():
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
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", *shlex.split(command)[1:]]
    code = pytest.main(args, plugins=[names])
    out[command] = getattr(names, "names", None) if code == 0 else None
print("SELECTED " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def selected():
    """{command: names of the tests it collects}, all commands collected in one Python process
    (imports once)."""
    commands = [command for command, _ in pytest_commands()]
    out = subprocess.run([sys.executable, "-c", COLLECT, json.dumps(commands)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    line = next((s for s in out.stdout.splitlines() if s.startswith("SELECTED ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(line[len("SELECTED "):])


def test_the_instructors_section_has_commands():
    assert len(pytest_commands()) >= 1


@pytest.mark.parametrize("command,promised", pytest_commands(), ids=lambda x: str(x)[:50])
def test_pytest_command_selects_the_tests_it_names(command, promised, selected):
    assert selected[command] is not None, f"{command} does not collect"
    assert selected[command] == promised, f"{command} selects {selected[command]}"


def documented_metrics() -> set[str]:
    """The names in the first column of docs/metrics.md's table; "`a/b/c`, `/d`" is a/b/c and
    a/b/d, "pass@k" any k."""
    names = set()
    for line in read("docs/metrics.md").splitlines():
        if not line.startswith("| `"):
            continue
        last = ""
        for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            last = last.rpartition("/")[0] + name if name.startswith("/") else name
            names.add(last)
    return names


@pytest.mark.needs("all")
def test_docs_metrics_names_every_metric_a_step_logs(tiny_model_dir, tmp_path):
    import dapo
    from test_dapo import _cfg
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=1, eval_every=1, dynamic_sampling=False))
    logged = {k for line in open(tmp_path / "metrics.jsonl") for k in json.loads(line)} - {"step"}
    assert "training/rollout_logp_diff_mean" in logged and "val/acc" in logged
    names = documented_metrics()
    missing = sorted(k for k in logged if k not in names and re.sub(r"@\d+$", "@k", k) not in names)
    assert not missing, f"docs/metrics.md does not say what these are: {missing}"


# The README's training commands: each runs as written, at the world size it states, on the
# cards its comment names (`# ... N GPUs of X GB`): its flags pass check_flags for that many
# processes and its memory plan fits the card, for the model its --model path names.
CARD_GIB = {80: 79, 141: 139}  # what torch.cuda.mem_get_info reports of an H100 80GB, an H200
MODELS = {"Qwen2.5-32B": "qwen2.5-32b", "Qwen2.5-7B": "qwen2.5-7b", "Qwen2.5-1.5B": "qwen2.5-1.5b",
          "Qwen2.5-0.5B": "qwen2.5-0.5b", "Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b"}


def training_commands():
    """(the comment over it, its world size, the arguments after dapo.py) of each command block
    of the README and docs/training.md that runs dapo.py on GPUs."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", read("README.md") + read("docs/training.md"),
                            re.S):
        lines = block.replace("\\\n", " ").splitlines()
        comment = " ".join(line for line in lines if line.startswith("#"))
        for line in lines:
            if "dapo.py" in line and "GPU" in comment and not line.startswith("#"):
                launcher, args = line.split("dapo.py", 1)
                nodes = re.search(r"--nnodes[= ](\d+)", launcher)
                per_node = re.search(r"--nproc_per_node[= ](\d+)", launcher)
                world = (int(nodes.group(1)) if nodes else 1) * \
                    (int(per_node.group(1)) if per_node else 1)
                out.append((comment, world, args.split()))
    return out


def test_the_readme_and_training_md_have_their_four_training_recipes():
    # the README's paper run, then docs/training.md's 1.5B, 7B and GSM8K ones
    assert [world for _, world, _ in training_commands()] == [128, 1, 8, 1]


@pytest.mark.parametrize("comment,world,args", training_commands(), ids=lambda x: str(x)[:30])
def test_each_training_command_passes_its_checks_and_fits_its_cards(comment, world, args):
    from config import check_flags, parse_args
    from infra import memory, precision
    from model import preset
    gpus, card = map(int, re.search(r"(\d+) GPUs? of (\d+) GB", comment).groups())
    assert gpus == world, comment
    preset_name = MODELS[os.path.basename(args[args.index("--model") + 1])]  # "qwen2.5-32b"
    cfg = parse_args(args)
    check_flags(cfg, world)  # raises naming the flag
    for flag in ("--train-data", "--val-data", "--lr", "--max-prompt-len", "--max-response-len",
                 "--overlong-buffer", "--warmup-steps", "--out-dir"):
        assert flag in args, f"{flag} missing: a copied command would run the demo's value"
    cfg.precision = precision.resolve(cfg.precision, "cuda")
    plan = memory.plan(preset(preset_name), cfg, world, capacity=CARD_GIB[card] * memory.GB)
    assert plan.fits and plan.slots >= 1, plan.describe(f"{card} GB cards")
    assert plan.peak <= 0.9 * CARD_GIB[card] * memory.GB
    size = preset_name.split("-")[1].upper()  # "32B"
    row = next(line for line in read("docs/training.md").splitlines()
               if line.startswith(f"| {size}, {world} x {card} GB"))
    assert row.split("|")[-2].strip() == str(plan.slots), (row, plan.describe("the card"))
