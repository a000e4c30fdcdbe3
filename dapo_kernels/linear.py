"""
linear_logprobs_and_entropy: the output layer and logprobs_and_entropy in one autograd Function, so
that the (tokens, V) logits are never held whole. `hidden @ weight.T` for 20k response tokens at
Qwen2.5's V = 151936 is 6 GB of bf16 logits, and autograd keeps them, plus as much again for their
gradient. Here they exist one chunk of tokens at a time, in the forward and again in the backward:

    forward, per chunk c of tokens:
        z_c = h_c W^T / T                                       (n, V), freed after the chunk
        lse_c, E_c = logsumexp(z_c), sum softmax(z_c) * z_c     kept: 2 floats a token
        logp_c = z_c[target] - lse_c,  entropy_c = lse_c - E_c
    backward, per chunk c:
        z_c again, from the saved h and W
        dz_c = g_logp (onehot - p) - g_ent p (z - E) (then / T), from lse_c and E_c
        dh_c = dz_c W        dW += dz_c^T h_c                   (fp32 sums for bf16 weights)

The per-chunk log-prob/entropy work is the existing fused kernel's (dapo_kernels/logprobs.py):
Triton on CUDA, the chunked PyTorch reference on CPU.

Why the backward recomputes the logits instead of computing the gradients in the forward
(Liger-Kernel's fused_linear_cross_entropy does the latter): Liger's output is a scalar loss, so the
gradient of every logit is known in the forward up to one scalar factor. Ours are per-token
log-probs, and the DAPO loss's gradient with respect to a log-prob depends on that log-prob itself
(through the ratio r = exp(logp - old_logp) and its clip), so it only exists once the forward has
finished. Storing what the forward could precompute instead (dz for every logit) is the (N, V)
tensor this file exists to avoid. The price is one more matmul: four of them (forward, recompute,
dh, dW) instead of the unfused path's three. verl's fused linear log-prob/entropy for RL makes the
same choice (it saves the hidden states, the weight and per-token statistics, and recomputes in the
backward).

Memory: besides the inputs, the saved state is the targets and two floats per token; the peak adds
one chunk of logits, its gradient and the backends' own chunk-sized scratch, whatever the number of
tokens. With a bf16 (or fp16) weight, dW is summed in an fp32 (V, C) buffer, as one unfused matmul
sums in fp32 internally. Measured by benchmarks/bench_kernels.py (CPU, fp32, one thread,
Qwen2.5-0.5B's head): at 4096 tokens, 0.19x the unfused path's peak extra memory (889 MB against
4785 MB; 533 MB of the 889 are the gradients, which both return) for 1.39x its time; at 8192 tokens,
919 MB against 9597 MB. On CPU the chunk's logit gradient is then written over its logits (one
chunk buffer instead of two): the fused peak at 4096 tokens went from 954 to 729 MB, 196 MB beyond
the gradients (--one-head fused, one subprocess each, side by side). The reference's scratch cut
to 4 MB row blocks then took it to 665-678 MB against 761-875 (0.14x the unfused 4785-4800 MB;
133-145 MB beyond the gradients, whose 533 MB alone are 0.11x), CPU time within noise.

Where it runs: inside the model's forward, as model.forward(..., head=...) calls it, so that under
FSDP2 the root unit has the weight gathered. The weight's gradient then flows to that gathered
parameter like any other, and FSDP reduce-scatters it into the shards; a tied head's gradient adds
up there with the embedding's. Under autocast, the chunk matmuls run in autocast's dtype (bf16: the
logits are bf16, as the unfused `hidden @ weight.T` makes them), and the gradients go back to the
fp32 inputs through the casts. Activation checkpointing of the blocks leaves the head alone; inside
a checkpointed region this Function would just run its forward again.

Padding (the `mask` argument): rows outside the mask are skipped, not computed and ignored. Their
hidden states are gathered away before the first matmul (a (n, C) copy, small beside the logits), so
a micro-batch padded to its longest response pays for its real tokens only; their log-prob and
entropy read 0 and they get no gradient. Their targets are never read, so any value (such as -100)
is fine there.
"""
import torch

from . import reference
from .reference import compute_dtype
from .logprobs import DEFAULT_BLOCK_V, resolve_backend, triton_logprobs

# Logits per chunk (elements): 2^25 is 220 tokens at V = 151936, 128 MB in fp32 and 64 MB in bf16,
# next to the GBs of the unfused path, and still a large matmul (60 GFLOP a chunk at C = 896), as
# fast per FLOP as the whole one. (2^24 took 60 MB more off the peak on CPU but cost ~9% of the
# time: each chunk adds its dW into the whole (V, C) sum, and a thinner chunk is a thinner matmul.)
CHUNK_LOGITS = 2**25
# On CPU, the reference backend's own scratch (its fp32 copy of the logits and their softmax) per
# call of rows: 2^20 elements, 6 rows (4 MB) at V = 151936. Its default, 2^23, made two 32 MB
# buffers beside each chunk, and buffers under glibc's 32 MB mmap ceiling come from the heap, which
# does not always give freed memory back: the peak RSS carried ~100 MB more than the live tensors.
SCRATCH_ELEMENTS = 2**20


def scratch_rows(vocab_size: int) -> int:
    return max(1, SCRATCH_ELEMENTS // vocab_size)


def default_chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_LOGITS // vocab_size)


def chunk_statistics(logits, targets, temperature, backend, block_v):
    """logits (n, V), targets (n,) -> logp, entropy, lse, mean_z: each (n,) fp32."""
    rows = logits[None]  # (1, n, V): the backends' (outer, inner, V) layout
    if backend == "triton":
        return triton_logprobs.forward(rows, targets, temperature, block_v)
    return reference.forward(rows, targets, temperature, scratch_rows(logits.shape[1]))


def chunk_logits_grad(logits, targets, lse, mean_z, grad_logp, grad_entropy, temperature, backend,
                      block_v):
    """The gradient of the chunk's logits, (n, V) in their dtype:
    dz = g_logp (onehot - p) - g_ent p (z - E), / T. On the reference backend it overwrites the
    logits (the caller must not read them afterwards)."""
    rows = logits[None]
    if backend == "triton":
        return triton_logprobs.backward(rows, targets, lse, mean_z, grad_logp, grad_entropy,
                                        temperature, block_v)
    # written over the logits, which the caller needs no more: one (n, V) chunk instead of two
    return reference.backward(rows, targets, lse, mean_z, grad_logp, grad_entropy, temperature,
                              scratch_rows(logits.shape[1]), out=logits)


_mixed_addmm = {}  # device type -> whether torch.addmm takes bf16 inputs and an fp32 out there


def has_mixed_addmm(device: torch.device) -> bool:
    """Whether this torch can multiply half-precision matrices straight into an fp32 sum on this
    device (torch.addmm's out_dtype: CUDA on recent releases; not on CPU, nor in older torch
    releases, whatever the device). Tried once per device type."""
    if device.type not in _mixed_addmm:
        out = torch.zeros(2, 2, device=device)
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        try:
            torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
            _mixed_addmm[device.type] = bool(out[0, 0] == 2)
        except (TypeError, RuntimeError):  # no such overload, or no kernel for this device
            _mixed_addmm[device.type] = False
    return _mixed_addmm[device.type]


def accumulate_weight_grad(grad_weight, grad_logits, hidden):
    """grad_weight (V, C) += grad_logits.T (V, n) @ hidden (n, C), summing in grad_weight's dtype
    (fp32 for a half-precision weight: adding each chunk's product rounded to bf16 would lose low
    bits once per chunk). The two mixed-precision paths compute the same products (a bf16 value is
    exact in fp32) and sum them in fp32."""
    if grad_weight.dtype == grad_logits.dtype:
        grad_weight.addmm_(grad_logits.T, hidden)
    elif has_mixed_addmm(grad_weight.device):  # e.g. cuBLAS: no fp32 copy of the chunk
        torch.addmm(grad_weight, grad_logits.T, hidden, out_dtype=grad_weight.dtype,
                    out=grad_weight)
    else:  # upcast the chunk (a chunk-sized copy)
        grad_weight.addmm_(grad_logits.T.to(grad_weight.dtype), hidden.to(grad_weight.dtype))


class LinearLogProbsAndEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, shape, temperature, chunk_tokens, backend, block_v):
        # hidden (N, C) contiguous, weight (V, C), targets (N,) int, shape: the outputs'
        # (N elements). The caller has applied autocast's cast already, so the matmuls run in the
        # inputs' dtype, as `hidden @ weight.T` would.
        N = hidden.shape[0]
        stats_dtype = compute_dtype(hidden.dtype)  # fp32; float64 for a float64 model
        # the outputs in their final shape, each its own tensor: no view for FSDP's hooks or
        # in-place ops to trip on
        logp, entropy = (torch.empty(shape, dtype=stats_dtype, device=hidden.device)
                         for _ in range(2))
        lse, mean_z = torch.empty(2, N, dtype=stats_dtype, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for n0 in range(0, N, chunk_tokens):
                n1 = min(n0 + chunk_tokens, N)
                logits = hidden[n0:n1] @ weight.T  # (n, V): the only V-sized tensor
                stats = chunk_statistics(logits, targets[n0:n1], temperature, backend, block_v)
                logp.view(-1)[n0:n1], entropy.view(-1)[n0:n1], lse[n0:n1], mean_z[n0:n1] = stats
                # now, not when the next chunk's logits replace it: one chunk at a time, not two
                del logits
        # hidden and weight are alive anyway (the caller's activations and the parameter): saving
        # them costs nothing
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.args = temperature, chunk_tokens, backend, block_v
        # an unused output's gradient stays None (the entropy is only logged)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if (grad_logp is None and grad_entropy is None) or not (need_hidden or need_weight):
            return (None,) * 8
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        temperature, chunk_tokens, backend, block_v = ctx.args
        # the upstream gradients can be expanded views (logp.sum() sends a stride-0 one): make them
        # flat and dense, (N,) each, in the statistics' dtype
        grad_logp, grad_entropy = (None if g is None else g.to(lse.dtype).reshape(-1).contiguous()
                                   for g in (grad_logp, grad_entropy))
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # (N, C)
        # (V, C) sums in fp32 (or float64)
        grad_weight = (torch.zeros_like(weight, dtype=compute_dtype(weight.dtype)) if need_weight
                       else None)
        with torch.autocast(hidden.device.type, enabled=False):
            for n0 in range(0, hidden.shape[0], chunk_tokens):
                span = slice(n0, min(n0 + chunk_tokens, hidden.shape[0]))
                h = hidden[span]  # (n, C)
                # recomputed: the same matmul as the forward's, the same numbers
                logits = h @ weight.T  # (n, V)
                grad_logits = chunk_logits_grad(
                    logits, targets[span], lse[span], mean_z[span],
                    None if grad_logp is None else grad_logp[span],
                    None if grad_entropy is None else grad_entropy[span],
                    temperature, backend, block_v)
                # before the matmuls below: at most one chunk of logits and its gradient at a time
                del logits
                if need_hidden:
                    torch.mm(grad_logits, weight, out=grad_hidden[span])  # (n, C)
                if need_weight:
                    accumulate_weight_grad(grad_weight, grad_logits, h)
                del grad_logits
        if need_weight:
            # a no-op for fp32; autograd wants the input's dtype
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `hidden @ weight.T` computes in here: autocast's, when autocast is on for this
    device and would cast these inputs (it leaves float64 alone), else the inputs' own."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (hidden.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def linear_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                temperature: float = 1.0, chunk_tokens: int | None = None, *,
                                mask: torch.Tensor | None = None, backend: str | None = None,
                                block_v: int = DEFAULT_BLOCK_V):
    """
    hidden (..., C), weight (V, C) (an lm_head, tied to the embedding or not), targets (...) integer
    in [0, V) -> (logp, entropy), both (...) fp32 (float64 for float64 inputs), equal to

        logits = hidden @ weight.T                                   # (..., V)
        logp, entropy = logprobs_and_entropy(logits, targets, temperature)

    but computed chunk_tokens tokens at a time (default: 2^25 logits per chunk, 220 tokens at
    V = 151936), so that neither the forward nor the backward ever holds more than one chunk of
    logits and its gradient. Differentiable with respect to hidden and weight (the returned
    gradients add up with any other use of the weight, as a tied embedding's). Under autocast the
    chunk matmuls run in autocast's dtype, as `hidden @ weight.T` would there; the gradients come
    back in each input's own dtype through the cast.
    mask (...) bool, optional: only positions where it is True are computed (see the module
    docstring); the others read logp = entropy = 0 and get no gradient, and their targets are
    never read.
    backend, block_v: as logprobs_and_entropy's (default backend: Triton on CUDA, the PyTorch
    reference on CPU).
    """
    C = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != C:
        raise ValueError(f"weight must be (V, {C}) for hidden states of size {C}, "
                         f"got {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must have hidden's shape without its "
                         f"last dimension, {tuple(hidden.shape[:-1])}")
    # an integer mask would index rows instead of masking them
    if mask is not None and (mask.shape != targets.shape or mask.dtype != torch.bool):
        raise ValueError(f"mask must be bool with the targets' shape {tuple(targets.shape)}, "
                         f"got {mask.dtype} {tuple(mask.shape)}")
    if targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"expected integer targets, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = matmul_dtype(hidden, weight)
    # the casts autocast would make; no-ops otherwise
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    backend = resolve_backend(backend, hidden)
    chunk_tokens = chunk_tokens or default_chunk_tokens(weight.shape[0])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")

    if mask is None:  # a copy only for odd strides
        rows, row_targets = hidden.reshape(-1, C), targets.reshape(-1)  # (N, C), (N,)
    else:  # the real tokens only, gathered in row-major order (on a GPU, a sync to learn n)
        rows, row_targets = hidden[mask], targets[mask]  # (n, C), (n,)
    shape = targets.shape if mask is None else row_targets.shape
    logp, entropy = LinearLogProbsAndEntropy.apply(
        rows.contiguous(), weight, row_targets.contiguous(), shape,
        float(temperature), chunk_tokens, backend, block_v)
    # back to every position, zeros outside the mask (differentiable in logp and entropy)
    if mask is not None:
        logp = logp.new_zeros(targets.shape).index_put((mask,), logp)
        entropy = entropy.new_zeros(targets.shape).index_put((mask,), entropy)
    return logp, entropy
