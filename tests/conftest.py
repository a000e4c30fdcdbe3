import os
import sys

# The Triton kernel runs on CPU tensors only under the interpreter, and the flag is read when the
# module holding the @triton.jit functions is imported: set it before any test imports kernels/.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen2 saved as a Hugging Face directory with the toy tokenizer: what
    --model points at."""
    from toy import make_toy_tokenizer
    from model import Qwen2, preset
    d = str(tmp_path_factory.mktemp("tiny"))
    tok = make_toy_tokenizer(d)
    torch.manual_seed(0)
    # beside the tokenizer files
    Qwen2(preset("tiny", vocab_size=tok.vocab_size)).save_pretrained(d)
    return d
