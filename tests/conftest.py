import getpass
import os
import sys
import tempfile

# The Triton kernel runs on CPU tensors only under the interpreter, and the flag is read when the
# module holding the @triton.jit functions is imported: set it before any test imports
# dapo_kernels/.
os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile's on-disk cache is not keyed by the CPU kernel set: code compiled for AVX-512 and
# reused under ATEN_CPU_CAPABILITY=avx2 gave wrong tokens, and under =default failed to build
# (torch 2.13). One cache directory per kernel set.
if os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_"
                               f"{os.environ['ATEN_CPU_CAPABILITY']}"))
# No test reaches the Hugging Face Hub: a name that is not in a test's own cache (tests/test_hub.py)
# fails at once instead of trying the network. huggingface_hub reads this when first imported.
os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the repository's modules, and its tools as packages (from experiments import ablate)
sys.path[:0] = [ROOT]


import pytest  # noqa: E402
import torch  # noqa: E402

from rendezvous import held_store_env  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen2 saved as a Hugging Face directory with the toy tokenizer: what
    --model points at."""
    from toy import make_toy_tokenizer
    from model import Transformer, preset
    d = str(tmp_path_factory.mktemp("tiny"))
    tok = make_toy_tokenizer(d)
    torch.manual_seed(0)
    # beside the tokenizer files
    Transformer(preset("tiny", vocab_size=tok.vocab_size)).save_pretrained(d)
    return d


@pytest.fixture
def store_env():
    """The environment in which two plain processes (two_ranks.start_pair) meet on a store that
    the test holds while it runs (rendezvous.py says why not a free port)."""
    with held_store_env() as env:
        yield env


# The longest files on a fresh clone (seconds on one of 2 cores): the notebook warms up the demo's
# base model (~180), the handout runs the suite in a copy (~85), the two-rank runs (~90 together).
# make test has pytest-xdist hand out whole files in collection order (--dist loadfile
# --no-loadscope-reorder), so these go first: a long file started last keeps one core busy after
# the other has finished.
LONGEST_FIRST = ["test_notebook.py", "test_assign.py", "test_distributed.py", "test_sampler.py",
                 "test_grader.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in order


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Every test on one torch thread: the tests' tiny matmuls gain nothing from a second, and on
    a busy 2-core machine OpenMP threads waiting on each other slow them down many-fold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
