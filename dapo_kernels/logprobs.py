"""
logprobs_and_entropy: log pi(t | ...) of each target token and the entropy of each row's softmax,
from logits, without ever materialising a (rows, V) softmax in fp32. With V = 151936 that softmax
is what runs a DAPO step out of memory: 16k response tokens of bf16 logits are 5 GB, their fp32
log_softmax another 10 GB.

One autograd.Function, two implementations of its forward and backward:
  - CUDA tensors                         -> the Triton kernels (dapo_kernels/triton_logprobs.py)
  - CPU tensors                          -> the chunked PyTorch reference
                                            (dapo_kernels/reference.py)
  - CPU tensors with TRITON_INTERPRET=1  -> the Triton kernels under Triton's interpreter
                                            (how the tests run them)
"""
import os

import torch

from . import reference

try:
    from . import triton_logprobs
except ImportError:  # no triton installed: the reference path serves every device
    triton_logprobs = None

# Triton reads this flag when it compiles the @triton.jit functions, i.e. when triton_logprobs is
# imported just above
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEFAULT_BLOCK_V = 4096


def default_backend(logits: torch.Tensor) -> str:
    # the Triton kernels compute in fp32: float64 (the tests' exact comparisons) takes the reference
    if triton_logprobs is None or logits.dtype == torch.float64:
        return "torch"
    if logits.is_cuda or (TRITON_INTERPRET and logits.device.type == "cpu"):
        return "triton"
    return "torch"


def resolve_backend(backend: str | None, tensor: torch.Tensor) -> str:
    """backend as asked ("triton" or "torch"), or by the tensor's device when None."""
    backend = backend or default_backend(tensor)
    if backend == "triton" and triton_logprobs is None:
        raise RuntimeError("backend='triton' needs triton installed (pip install triton)")
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    return backend


def as_rows(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> an (outer, inner, V) view with unit last stride; flat row r is
    [r // inner, r % inner].
    Two levels of row strides cover a contiguous tensor and slices such as logits[:, :-1]
    (B, T-1, V) without a copy, where reshape(-1, V) would copy all the logits."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    sizes, strides = [], []
    for size, stride in zip(logits.shape[:-1], logits.stride()[:-1]):
        if size == 1:
            continue  # a length-1 dimension has no rows to step over
        # steps like one dimension with the previous one: merge them
        if sizes and strides[-1] == stride * size:
            sizes[-1], strides[-1] = sizes[-1] * size, stride
        else:
            sizes.append(size)
            strides.append(stride)
    if len(sizes) > 2:  # three independent row strides: rare enough to pay for a copy
        return as_rows(logits.contiguous())
    sizes, strides = [1] * (2 - len(sizes)) + sizes, [0] * (2 - len(strides)) + strides
    return logits.as_strided((*sizes, logits.shape[-1]), (*strides, 1))


class LogProbsAndEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, backend, block_v, chunk_rows):
        rows = as_rows(logits)  # (outer, inner, V)
        flat_targets = targets.reshape(-1).contiguous()  # (N,)
        if backend == "triton":
            stats = triton_logprobs.forward(rows, flat_targets, temperature, block_v)
        else:
            stats = reference.forward(rows, flat_targets, temperature, chunk_rows)
        logp, entropy, lse, mean_z = stats
        # the logits are alive anyway: saving costs nothing
        ctx.save_for_backward(logits, flat_targets, lse, mean_z)
        ctx.args = temperature, backend, block_v, chunk_rows
        # an unused output's gradient stays None instead of a tensor of zeros
        ctx.set_materialize_grads(False)
        return logp.view(targets.shape), entropy.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if grad_logp is None and grad_entropy is None:
            return (None,) * 6
        logits, flat_targets, lse, mean_z = ctx.saved_tensors
        temperature, backend, block_v, chunk_rows = ctx.args
        rows = as_rows(logits)
        # the upstream gradients can be expanded views (logp.sum() sends a stride-0 one): make them
        # flat and dense, (N,) each, in the statistics' dtype
        grad_logp, grad_entropy = (None if g is None else g.to(lse.dtype).reshape(-1).contiguous()
                                   for g in (grad_logp, grad_entropy))
        if backend == "triton":
            grad = triton_logprobs.backward(rows, flat_targets, lse, mean_z, grad_logp,
                                            grad_entropy, temperature, block_v)
        else:
            grad = reference.backward(rows, flat_targets, lse, mean_z, grad_logp, grad_entropy,
                                      temperature, chunk_rows)
        return grad.view(logits.shape), None, None, None, None, None


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                         backend: str | None = None, block_v: int = DEFAULT_BLOCK_V,
                         chunk_rows: int | None = None):
    """
    logits (..., V) fp32/fp16/bf16, any strides with a unit last stride (copied otherwise);
    targets (...) integer in [0, V). Returns (logp, entropy), both (...) fp32 (float64 for
    float64 logits, on the torch backend):
    logp = log_softmax(logits / T)[target] and
    entropy = -sum_j p_j log p_j with p = softmax(logits / T). Both are differentiable.
    backend: "triton" or "torch" (default: by device, see the module docstring). block_v: the
    Triton kernels' block over the vocabulary (a power of two). chunk_rows: rows per chunk on the
    torch path (default: 32 MB of fp32).
    A row whose logits are all -inf has no softmax and gives NaN. A target outside [0, V) gives
    NaN on the Triton path (the kernel never reads outside the row) and an index error on the
    torch path.
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must have the logits' shape without the "
                         f"vocabulary dimension, {tuple(logits.shape[:-1])}")
    if not logits.is_floating_point() or targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"expected floating logits and integer targets, got {logits.dtype} and "
                        f"{targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    backend = resolve_backend(backend, logits)
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16 (tl.arange needs one), "
                         f"got {block_v}")
    return LogProbsAndEntropy.apply(logits, targets, float(temperature), backend, block_v,
                                    chunk_rows)
