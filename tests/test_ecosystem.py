"""The project shares a process with the ecosystem a user runs beside it: transformers, and the
Hugging Face `kernels` package that transformers imports (when a model module loads, and inside
from_pretrained). A top-level folder of ours named like a PyPI package would shadow it for every
script started from the checkout; ours is dapo_kernels/ (no PyPI project has that name). And it
installs where triton does not (macOS, Windows)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A random tiny Qwen2 saved by our model and read back by transformers (which runs its kernel-hub
# code in from_pretrained), then the two compared: the round trip a README reader makes.
ROUND_TRIP = """
import os, sys, tempfile
import torch
{first}
{second}
import kernels
from transformers.utils.import_utils import is_kernels_available
# the real package, which transformers accepts (else the test would pass without the clash)
assert hasattr(kernels, "get_kernel") and is_kernels_available(), kernels.__file__
assert "site-packages" in kernels.__file__, kernels.__file__
from model import Transformer, preset
torch.manual_seed(0)
ours = Transformer(preset("tiny", vocab_size=97)).eval()
d = tempfile.mkdtemp()
ours.save_pretrained(d)
theirs = Qwen2ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
ids = torch.randint(0, 97, (2, 7))
with torch.no_grad():
    gap = (ours(ids) - theirs(ids).logits).abs().max().item()
assert gap < 1e-4, gap
print("ok")
"""


@pytest.mark.needs("rope", "attention")  # the round trip compares logits
@pytest.mark.parametrize("order", ["ours first", "transformers first"])
def test_transformers_and_the_kernels_package_import_beside_the_project(order):
    """From the checkout's root (the script's folder is first on sys.path, as for any script a
    user starts there), in either order."""
    ours, theirs = "import dapo", "from transformers import Qwen2ForCausalLM"
    first, second = (ours, theirs) if order == "ours first" else (theirs, ours)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it
    env.update(PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", ROUND_TRIP.format(first=first, second=second)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_triton_is_a_linux_requirement_only():
    # triton ships Linux wheels only: on macOS or Windows `pip install -r requirements.txt` (and
    # so `make run`) failed. .ci/no_triton runs `make run` and `make test` in a venv without it.
    from packaging.requirements import Requirement
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        lines = [line.split("#")[0].strip() for line in f]
    triton = next(Requirement(line) for line in lines if line.startswith("triton"))
    assert triton.marker is not None
    for platform, wanted in (("linux", True), ("darwin", False), ("win32", False)):
        assert triton.marker.evaluate({"sys_platform": platform}) is wanted, platform
