"""Fused kernels. logprobs_and_entropy: per-token log-probs and softmax entropy without a (rows, V)
fp32 softmax. linear_logprobs_and_entropy: the same from hidden states and the output layer's
weight, without the (rows, V) logits."""
from .linear import linear_logprobs_and_entropy
from .logprobs import default_backend, logprobs_and_entropy

__all__ = ["logprobs_and_entropy", "linear_logprobs_and_entropy", "default_backend"]
