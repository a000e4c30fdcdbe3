"""
The same computation as the Triton kernels in plain PyTorch: the CPU path in training, and the
oracle the kernel is tested against. It works on any device.

It goes over the rows in chunks, so at most a chunk of fp32 logits exists at a time: the naive
log_softmax(logits.float()) on (2048, 151936) bf16 logits makes several 1.2 GB fp32 copies, a chunk
of 55 rows is 32 MB. Every row is computed on its own, so the chunk size changes the memory, never
the numbers.
"""
import torch

# fp32 elements per chunk (32 MB): big enough that the per-chunk overhead is negligible
CHUNK_ELEMENTS = 2**23


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32, bf16 and fp16 logits; float64 stays float64 (the tests' exact comparisons
    run whole models in float64)."""
    return torch.promote_types(dtype, torch.float32)


def default_chunk_rows(V):
    return max(1, CHUNK_ELEMENTS // V)


def row_chunks(rows, chunk_rows):
    """rows (outer, inner, V) -> (r0, r1, chunk): consecutive flat rows [r0, r1), chunk (r1 - r0, V)
    in the input dtype. A chunk inside one outer slice is a view; one that straddles two is gathered
    (a copy of that chunk only)."""
    outer, inner, V = rows.shape
    N = outer * inner
    for r0 in range(0, N, chunk_rows):
        r1 = min(r0 + chunk_rows, N)
        b0, b1 = r0 // inner, (r1 - 1) // inner
        if b0 == b1:
            yield r0, r1, rows[b0, r0 - b0 * inner:r1 - b0 * inner]
        else:
            flat = torch.arange(r0, r1, device=rows.device)
            yield r0, r1, rows[flat // inner, flat % inner]


def forward(rows, targets, temperature, chunk_rows=None):
    """rows (outer, inner, V), targets (N,) -> logp, entropy, lse, mean_z: each (N,) fp32, as the
    Triton forward (float64 for float64 rows)."""
    outer, inner, V = rows.shape
    # logp, entropy, lse, mean_z
    stats = torch.empty(4, outer * inner, dtype=compute_dtype(rows.dtype), device=rows.device)
    targets = targets.long()
    # one function call per chunk: its (n, V) buffers are freed on return, before the next chunk
    # allocates its own
    for r0, r1, chunk in row_chunks(rows, chunk_rows or default_chunk_rows(V)):
        stats[:, r0:r1] = forward_chunk(chunk, targets[r0:r1], temperature)
    return tuple(stats)


def forward_chunk(chunk, targets, temperature):
    """chunk (n, V), targets (n,) int64 -> (4, n): logp, entropy, lse, mean_z."""
    # exercise: logprobs_forward
    # our own copy, in fp32 (float64 stays float64): changed in place below
    z = chunk.to(compute_dtype(chunk.dtype), copy=True).mul_(1.0 / temperature)  # (n, V)
    # Everything relative to the row max m, as the kernel does: z - m is exact near the max, and
    # log d, with d = sum exp(z - m) in [1, V], is a small number. Going through lse = m + log d
    # instead would add lse's rounding (4e-6 when the logits sit at +100) to every log-prob and to
    # the entropy.
    m = z.amax(dim=-1)  # (n,)
    z_m = z.sub_(m[:, None])  # (n, V) z - m, in z's buffer
    p = z_m.exp()  # (n, V) unnormalised for now
    d = p.sum(dim=-1)  # (n,)
    log_d = d.log()
    logp = z_m.gather(1, targets[:, None])[:, 0] - log_d
    # s / d = E[z - m] = sum p (z - m), where a -inf logit has p = 0 and 0 * -inf = NaN: clamping
    # -inf to the most negative float makes that term 0 * (finite) = 0, in place
    s_d = p.mul_(z_m.clamp_(min=torch.finfo(z.dtype).min)).sum(dim=-1) / d  # (n,)
    entropy = log_d - s_d  # H = lse - E[z] = log d - s / d
    return torch.stack([logp, entropy, m + log_d, m + s_d])
    # end exercise


def backward(rows, targets, lse, mean_z, grad_logp, grad_entropy, temperature, chunk_rows=None,
             out=None):
    """The gradient w.r.t. the logits, (N, V) contiguous in the logits' dtype, as the Triton
    backward: dz_j = g_logp * (1[j = t] - p_j) - g_ent * p_j * (z_j - E[z]), then divided by T.
    out (N, V), optional: where to write it, which may be the logits' own (contiguous) buffer:
    each chunk of rows is read whole before its gradient is written back, so a caller that needs
    the logits no more saves one (N, V) tensor."""
    outer, inner, V = rows.shape
    grad_logits = (torch.empty(outer * inner, V, dtype=rows.dtype, device=rows.device)
                   if out is None else out)
    targets = targets.long()
    for r0, r1, chunk in row_chunks(rows, chunk_rows or default_chunk_rows(V)):
        span = slice(r0, r1)
        grad_logits[span] = backward_chunk(
            chunk, targets[span], lse[span], mean_z[span],
            None if grad_logp is None else grad_logp[span],
            None if grad_entropy is None else grad_entropy[span], temperature)
    return grad_logits


def backward_chunk(chunk, targets, lse, mean_z, grad_logp, grad_entropy, temperature):
    """chunk (n, V) -> its gradient, (n, V) fp32 (float64 for a float64 chunk); the other
    arguments are (n,), a gradient may be None."""
    # exercise: logprobs_backward
    z = chunk.to(compute_dtype(chunk.dtype), copy=True).mul_(1.0 / temperature)  # (n, V)
    if grad_entropy is None:
        # the usual training case (logp in the loss, entropy only logged): -g_logp * p
        dz = z.sub_(lse[:, None]).exp_().mul_(-grad_logp[:, None])  # in z's buffer
    else:
        p = (z - lse[:, None]).exp_()  # (n, V) the softmax, recomputed from the saved lse
        # -g_ent * p * (z - E), with -inf clamped as in the forward so that p = 0 gives 0, not NaN
        z.clamp_(min=torch.finfo(z.dtype).min)
        dz = z.sub_(mean_z[:, None]).mul_(p).mul_(-grad_entropy[:, None])
        if grad_logp is not None:
            dz.sub_(p.mul_(grad_logp[:, None]))
    # the one-hot term, in fp32 before the single rounding to the logits' dtype
    if grad_logp is not None:
        dz.scatter_add_(1, targets[:, None], grad_logp[:, None])
    return dz.mul_(1.0 / temperature)
    # end exercise
