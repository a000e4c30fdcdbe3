"""Fused kernels. logprobs_and_entropy: per-token log-probs and softmax entropy without a (rows, V) fp32 softmax."""
from .logprobs import default_backend, logprobs_and_entropy

__all__ = ["logprobs_and_entropy", "default_backend"]
