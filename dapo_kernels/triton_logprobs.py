"""
Triton kernels for the per-token log-prob and entropy of a softmax over a large vocabulary, one
program per row. The forward reads each row once and keeps three numbers; the backward reads it once
more and writes the gradient. Neither ever holds the (rows, V) softmax, so the only full-size
tensors are the logits and their gradient.

This module imports triton at the top: dapo_kernels/logprobs.py imports it inside a try, so without
triton the package still works (on the plain PyTorch path).
"""
import torch
import triton
import triton.language as tl

# a global read inside @triton.jit must be a tl.constexpr: a plain float compiles under the
# interpreter, not on a GPU
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _logprobs_entropy_fwd(
    logits_ptr, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, mean_z_ptr,
    V, rows_per_outer, stride_outer, stride_row, inv_temp,
    BLOCK_V: tl.constexpr,
):
    # int64 BEFORE any multiply: with int32 indices row * V wraps once rows x V > 2^31, and
    # 16384 x 151936 already does, so rows past 14,134 would silently read another row
    row = tl.program_id(0).to(tl.int64)
    outer = row // rows_per_outer
    row_ptr = logits_ptr + outer * stride_outer + (row % rows_per_outer) * stride_row

    # Online softmax: walk the row in blocks, keeping, for the logits z seen so far,
    #   m = their max,   d = sum exp(z - m),   s = sum exp(z - m) * (z - m).
    # When a block raises the max from m to m', every old term exp(z - m) becomes
    # exp(z - m) * exp(m - m'), and every old (z - m) becomes (z - m) + (m - m'): so d' = d * a and
    # s' = (s + d * (m - m')) * a with a = exp(m - m'). Keeping s relative to m (rather than
    # sum exp(z - m) * z) avoids a cancellation: entropy = log d - s / d needs no subtraction of
    # two large numbers when the logits sit at +100.
    m = tl.full((), NEG_INF, tl.float32)
    d = tl.zeros((), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        # the tail past V reads as -inf, i.e. probability 0: a vocab need not be a multiple
        # of BLOCK_V
        z = tl.load(row_ptr + cols, mask=cols < V, other=NEG_INF)
        z = z.to(tl.float32) * inv_temp  # (BLOCK_V,)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # Guard: while every logit so far is -inf (a masked block, or the masked tail),
        # m_new = -inf and z - m_new would be -inf - -inf = NaN. Shift by 0 instead:
        # exp(-inf - 0) = 0, which is right. m keeps the true max.
        shift = tl.where(m_new == NEG_INF, 0.0, m_new)
        # Same guard for the rescale: before the first finite logit m = -inf and d = s = 0;
        # 0 * (m - shift) would be 0 * -inf = NaN, so use a step of 0 there (a = 1, and it
        # multiplies zeros anyway)
        step = tl.where(m == NEG_INF, 0.0, m - shift)
        a = tl.exp(step)
        zs = z - shift  # (BLOCK_V,) <= 0, -inf where masked
        e = tl.exp(zs)
        # zero the -inf before multiplying: e = 0 there, and 0 * -inf is NaN, not 0
        s = (s + d * step) * a + tl.sum(e * tl.where(e > 0, zs, 0.0), axis=0)
        d = d * a + tl.sum(e, axis=0)
        m = m_new

    log_d = tl.log(d)
    lse = m + log_d  # log sum exp(z)
    target = tl.load(targets_ptr + row)
    # a target outside [0, V) (an ignore index such as -100) must not read memory past the row: it
    # gives NaN instead
    valid = (target >= 0) & (target < V)
    z_target = tl.load(row_ptr + target, mask=valid, other=float("nan")).to(tl.float32) * inv_temp
    # not z_target - lse: that would add lse's rounding
    tl.store(logp_ptr + row, (z_target - m) - log_d)
    tl.store(entropy_ptr + row, log_d - s / d)  # H = lse - E[z] = log d - s / d
    # saved for the backward, with E[z]: two floats per row instead of a (rows, V) softmax
    tl.store(lse_ptr + row, lse)
    tl.store(mean_z_ptr + row, m + s / d)


@triton.jit
def _logprobs_entropy_bwd(
    logits_ptr, targets_ptr, lse_ptr, mean_z_ptr, grad_logp_ptr, grad_entropy_ptr, grad_logits_ptr,
    V, rows_per_outer, stride_outer, stride_row, inv_temp,
    HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # dz_j = g_logp * (1[j = t] - p_j) - g_ent * p_j * (z_j - E[z]),  p_j = exp(z_j - lse),
    # d logits = dz / T. The softmax is recomputed from the saved lse: one more read of the row
    # instead of storing (rows, V) floats.
    row = tl.program_id(0).to(tl.int64)  # int64 for the same reason as in the forward
    outer = row // rows_per_outer
    row_ptr = logits_ptr + outer * stride_outer + (row % rows_per_outer) * stride_row
    out_ptr = grad_logits_ptr + row * V  # the gradient is a fresh contiguous (rows, V) tensor
    lse = tl.load(lse_ptr + row)
    # HAS_GRAD_* are compile-time flags: the training loss uses logp only (the entropy is only
    # monitored, never in the loss: the paper's Eq. 8 has no entropy term), and then the entropy
    # term below is not even compiled in
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + row)
        target = tl.load(targets_ptr + row)
    if HAS_GRAD_ENTROPY:
        g_entropy = tl.load(grad_entropy_ptr + row)
        mean_z = tl.load(mean_z_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=NEG_INF)
        z = z.to(tl.float32) * inv_temp  # (BLOCK_V,)
        p = tl.exp(z - lse)
        dz = tl.zeros((BLOCK_V,), tl.float32)
        if HAS_GRAD_LOGP:
            # the one-hot term is added here in fp32, so the target's gradient g * (1 - p_t) is
            # rounded to bf16 once; adding g to an already-rounded -g * p_t in bf16 would lose it to
            # rounding
            dz += g_logp * (tl.where(cols == target, 1.0, 0.0) - p)
        if HAS_GRAD_ENTROPY:
            # where: p = 0 at z = -inf, and 0 * -inf = NaN
            dz -= g_entropy * p * tl.where(p > 0, z - mean_z, 0.0)
        tl.store(out_ptr + cols, (dz * inv_temp).to(grad_logits_ptr.dtype.element_ty), mask=mask)


def _num_warps(block_v):
    return max(1, min(16, block_v // 256))  # 8 elements (16 bytes of bf16) per thread per block


def forward(rows, targets, temperature, block_v):
    """rows (outer, inner, V) with unit last stride, targets (N,) integer, N = outer * inner
    -> logp, entropy, lse, mean_z: each (N,) fp32."""
    outer, inner, V = rows.shape
    N = outer * inner
    logp, entropy, lse, mean_z = torch.empty(4, N, dtype=torch.float32, device=rows.device)
    if N:
        _logprobs_entropy_fwd[(N,)](
            rows, targets, logp, entropy, lse, mean_z,
            V, inner, rows.stride(0), rows.stride(1), 1.0 / temperature,
            BLOCK_V=block_v, num_warps=_num_warps(block_v))
    return logp, entropy, lse, mean_z


def backward(rows, targets, lse, mean_z, grad_logp, grad_entropy, temperature, block_v):
    """The gradient w.r.t. the logits, (N, V) contiguous in the logits' dtype. grad_logp /
    grad_entropy: (N,) fp32 contiguous, or None when that output received no gradient."""
    outer, inner, V = rows.shape
    N = outer * inner
    grad_logits = torch.empty(N, V, dtype=rows.dtype, device=rows.device)
    if N:
        _logprobs_entropy_bwd[(N,)](
            rows, targets, lse, mean_z,
            # a placeholder pointer, never read when the flag is off
            grad_logp if grad_logp is not None else lse,
            grad_entropy if grad_entropy is not None else lse,
            grad_logits,
            V, inner, rows.stride(0), rows.stride(1), 1.0 / temperature,
            HAS_GRAD_LOGP=grad_logp is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
            BLOCK_V=block_v, num_warps=_num_warps(block_v))
    return grad_logits
