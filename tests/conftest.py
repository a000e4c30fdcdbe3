import os
import sys

# The Triton kernel runs on CPU tensors only under the interpreter, and the flag is read when the module holding the
# @triton.jit functions is imported: set it before any test imports kernels/.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
