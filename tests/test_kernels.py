"""dapo_kernels/: logprobs_and_entropy against float64 autograd, on both paths: the chunked PyTorch
reference (the CPU path in training) and the Triton kernels, run on CPU under TRITON_INTERPRET=1
(conftest.py sets it)."""
import math
import os
import subprocess
import sys

import pytest
import torch

from dapo_kernels import default_backend, logprobs_and_entropy
from dapo_kernels.logprobs import TRITON_INTERPRET, as_rows, triton_logprobs
from dapo_kernels.reference import backward_chunk, forward_chunk

# not a multiple of the block: the last block, [2560, 3072), is partial (441 real columns)
V, BLOCK = 3001, 512
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    triton_logprobs is None or not TRITON_INTERPRET,
    reason="Triton on CPU needs triton and TRITON_INTERPRET=1"))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS32 = torch.finfo(torch.float32).eps
# A half-precision gradient is a rounded fp32 one: up to half an ulp with round-to-nearest, but the
# interpreter's fp32 -> bf16 store truncates (triton/runtime/interpreter.py casts with no rounding
# mode), which can lose a whole ulp. Relative tolerances of one ulp cover both.
GRAD_RTOL = {torch.float32: 0.0, torch.float16: 2**-10, torch.bfloat16: 2**-7}
# The fp32 kernels against float64 (so every tolerance is one of fp32, derived from its epsilon):
# gradient entries are at most ~1 (a probability times an upstream gradient of size ~1), each a
# V-term computation in fp32: 2^7 ulps of 1
GRAD_ATOL = 2**7 * EPS32  # 1.5e-5
# log-probs and entropies of size up to log V ~ 8 (plus the logits' own size, see forward_tol):
# lse is a V-term sum, 16 ulps of 8
FWD_ATOL = 16 * 8 * EPS32  # 1.5e-5

# the kernels against float64 and each other, and a few cheap checks of their interface
pytestmark = pytest.mark.parity


def backends(*needs):
    """Both paths: the PyTorch reference (its chunk functions are exercises, assign.py) and the
    Triton kernels."""
    no_triton = triton_logprobs is None or not TRITON_INTERPRET
    return [pytest.param("torch", marks=pytest.mark.needs(*needs)),
            pytest.param("triton", marks=pytest.mark.skipif(
                no_triton, reason="Triton on CPU needs triton and TRITON_INTERPRET=1"))]


FORWARD, BACKWARD = backends("logprobs_forward"), backends("logprobs_forward", "logprobs_backward")


def run(logits, targets, temperature=1.0, backend="torch", **kw):
    return logprobs_and_entropy(logits, targets, temperature, backend=backend, block_v=BLOCK, **kw)


def trap_rows(dtype=torch.float32, seed=0):
    """(8, V) logits and (8,) targets, one known trap per row."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, V, generator=g) * 3
    targets = torch.randint(0, V, (8,), generator=g)
    targets[0] = 0  # the first column
    targets[1] = V - 1  # the last column, in the partial last block
    targets[2] = V - 200  # inside the partial last block
    # a first block all -inf: exp(-inf - -inf) = NaN unless the max is guarded
    logits[3, :BLOCK] = -math.inf
    targets[3] = BLOCK + 7
    logits[4] += 100  # far from 0: lse ~ 108, so an entropy computed as lse - E[z] would cancel
    logits[5] = 0.5  # uniform: entropy = log V exactly
    logits[6, 1::7] = -math.inf  # scattered masked entries: 0 * -inf inside the entropy sum
    targets[6] = 7 * 100
    logits[7, targets[7]] += 30  # peaked: p_target ~ 1, entropy ~ 0
    return logits.to(dtype), targets


def float64_oracle(logits, targets, temperature):
    """The textbook computation in float64, on the same (already rounded) input values."""
    x = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    p = logp_all.exp()
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    # where: p = 0 at -inf, and 0 * -inf = NaN
    entropy = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return x, logp, entropy


def forward_tol(logits, temperature):
    # fp32 holds a logit of size |z| only to eps * |z|: FWD_ATOL plus a few of those (the +100 row
    # at T = 0.7 is ~143)
    z = logits.double().abs().nan_to_num(posinf=0.0).amax(-1) / temperature
    return FWD_ATOL + 4 * EPS32 * z


def float64_statistics(logits, temperature):
    """lse and E[z] of each row of z = logits / T, in float64 (p E[z]'s terms are 0 where p is)."""
    z = logits.double() / temperature
    lse = z.logsumexp(-1)
    p = (z - lse[:, None]).exp()
    return lse, torch.where(p > 0, p * z, 0.0).sum(-1)


# forward_chunk and backward_chunk on their own: what the reference path runs on each chunk

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_forward_chunk_matches_float64(dtype, temperature):
    logits, targets = trap_rows(dtype)
    out = forward_chunk(logits, targets, temperature)
    assert out.dtype == torch.float32 and out.shape == (4, 8)  # logp, entropy, lse, mean_z
    _, ref_logp, ref_entropy = float64_oracle(logits, targets, temperature)
    tol = forward_tol(logits, temperature)
    for got, want in zip(out, (ref_logp, ref_entropy, *float64_statistics(logits, temperature))):
        assert ((got - want).abs() <= tol).all(), (got - want).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("wrt", ["logp", "entropy", "both"])
def test_backward_chunk_matches_float64(dtype, wrt):
    logits, targets = trap_rows(dtype, seed=1)
    temperature = 1.3  # not 1: a missing 1/T shows
    w_logp, w_entropy = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    x64, ref_logp, ref_entropy = float64_oracle(logits, targets, temperature)
    loss = 0.0
    if wrt != "entropy":
        loss = loss + (w_logp * ref_logp).sum()
    if wrt != "logp":
        loss = loss + (w_entropy * ref_entropy).sum()
    loss.backward()
    lse, mean_z = (t.float() for t in float64_statistics(logits, temperature))
    grad = backward_chunk(logits, targets, lse, mean_z, w_logp if wrt != "entropy" else None,
                          w_entropy if wrt != "logp" else None, temperature)
    assert grad.dtype == torch.float32 and grad.shape == logits.shape
    err = (grad.double() - x64.grad).abs()
    assert (err <= GRAD_ATOL).all(), err.max()


@pytest.mark.parametrize("backend", FORWARD)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_forward_matches_float64(backend, dtype, temperature):
    logits, targets = trap_rows(dtype)
    logp, entropy = run(logits, targets, temperature, backend)
    _, ref_logp, ref_entropy = float64_oracle(logits, targets, temperature)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == entropy.shape == (8,)
    tol = forward_tol(logits, temperature)
    assert ((logp - ref_logp).abs() <= tol).all(), (logp - ref_logp).abs()
    assert ((entropy - ref_entropy).abs() <= tol).all(), (entropy - ref_entropy).abs()


@pytest.mark.parametrize("backend", BACKWARD)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("wrt", ["logp", "entropy", "both"])
def test_gradients_match_float64(backend, dtype, wrt):
    # wrt="logp" is the training case: the entropy output gets no gradient at all (None), not a
    # zero one
    logits, targets = trap_rows(dtype, seed=1)
    temperature = 1.3  # not 1: a missing 1/T in the backward shows
    g = torch.Generator().manual_seed(2)
    w_logp, w_entropy = torch.randn(2, 8, generator=g)

    def loss(logp, entropy):
        return ((w_logp * logp).sum() if wrt != "entropy" else 0) + \
            ((w_entropy * entropy).sum() if wrt != "logp" else 0)

    x = logits.clone().requires_grad_()
    loss(*run(x, targets, temperature, backend)).backward()
    x64, *outputs = float64_oracle(logits, targets, temperature)
    loss(*outputs).backward()
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    err = (x.grad.double() - x64.grad).abs()
    assert (err <= GRAD_ATOL + GRAD_RTOL[dtype] * x64.grad.abs()).all(), err.max()


@pytest.mark.needs("logprobs_forward", "logprobs_backward")
def test_logp_only_backward_gets_no_entropy_gradient(monkeypatch):
    # entropy is logged, not in the loss (the paper's objective, Eq. 8, has no entropy term): the
    # backward must then skip its term, not multiply zeros by it
    import dapo_kernels.reference

    seen, real_backward = [], dapo_kernels.reference.backward

    def spy(rows, targets, lse, mean_z, grad_logp, grad_entropy, *rest):
        seen.append(grad_entropy)
        return real_backward(rows, targets, lse, mean_z, grad_logp, grad_entropy, *rest)

    monkeypatch.setattr(dapo_kernels.reference, "backward", spy)
    logits = torch.randn(3, V, requires_grad=True)
    logp, entropy = run(logits, torch.tensor([0, 1, 2]), 1.0, "torch")
    (logp * torch.randn(3)).sum().backward()
    assert seen == [None]


@pytest.mark.parametrize("backend", FORWARD)
def test_uniform_row_has_entropy_log_V(backend):
    logp, entropy = run(torch.full((2, V), -3.0), torch.tensor([0, V - 1]), 1.0, backend)
    assert (entropy - math.log(V)).abs().max() < FWD_ATOL
    assert (logp + math.log(V)).abs().max() < FWD_ATOL


@pytest.mark.parametrize("backend", FORWARD)
def test_shifting_a_row_by_100_changes_nothing(backend):
    logits, targets = torch.randn(2, V) * 2, torch.tensor([5, 2900])
    logp, entropy = run(logits, targets, 1.0, backend)
    logp_shifted, entropy_shifted = run(logits + 100, targets, 1.0, backend)
    # the shifted logits themselves are rounded to fp32's spacing at 100 (8e-6): 2 of those
    tol = 2 * 128 * EPS32
    assert (logp_shifted - logp).abs().max() < tol
    assert (entropy_shifted - entropy).abs().max() < tol


@pytest.mark.parametrize("backend", BACKWARD)
def test_non_contiguous_slice_reads_in_place_and_matches(backend):
    # the training loop's shape: logits (B, T, V) from the model, the last position has no
    # next token
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(2, 5, V, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (2, 4), generator=g)
    logits = full[:, :-1]  # (2, 4, V), strides (5V, V, 1): no reshape(-1, V) without a copy
    assert as_rows(logits).data_ptr() == logits.data_ptr() and not logits.is_contiguous()
    logp, entropy = run(logits, targets, 0.7, backend)
    assert logp.shape == entropy.shape == (2, 4)
    (logp.sum() + entropy.sum()).backward()
    x64, ref_logp, ref_entropy = float64_oracle(logits, targets, 0.7)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    assert (logp - ref_logp).abs().max() < FWD_ATOL
    assert (entropy - ref_entropy).abs().max() < FWD_ATOL
    grad = full.grad.double()
    assert (grad[:, -1] == 0).all()  # the dropped position gets no gradient
    tol = GRAD_ATOL + GRAD_RTOL[torch.bfloat16] * x64.grad.abs()
    assert ((grad[:, :-1] - x64.grad).abs() <= tol).all()


def test_rows_of_common_layouts_are_views_not_copies():
    full = torch.zeros(2, 3, 5, 16)
    for logits, shape in ((full, (1, 30, 16)),  # contiguous: one row stride
                          # the two outer dims step as one, then the sliced one
                          (full[:, :, :-1], (6, 4, 16)),
                          (full[1], (1, 15, 16)),  # one batch entry: an offset view
                          (full[1, :, 1:], (3, 4, 16))):
        rows = as_rows(logits)
        assert rows.shape == shape and rows.data_ptr() == logits.data_ptr()
        assert torch.equal(rows.reshape(logits.shape), logits)


@pytest.mark.parametrize("backend", BACKWARD)
def test_gradient_of_a_plain_sum(backend):
    # logp.sum().backward() hands the backward a stride-0 expanded gradient, not a dense (N,) one
    logits, targets = trap_rows(seed=4)
    x = logits.clone().requires_grad_()
    logp, _ = run(x, targets, 1.0, backend)
    logp.sum().backward()
    x64, ref_logp, _ = float64_oracle(logits, targets, 1.0)
    ref_logp.sum().backward()
    assert (x.grad - x64.grad).abs().max() < GRAD_ATOL


@pytest.mark.needs("logprobs_forward", "logprobs_backward")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_chunk_size_never_changes_the_numbers(dtype):
    # chunks of 1, 3 (straddling the rows of two sequences: the gathered case) and all rows at once
    full = (torch.randn(3, 5, V) * 2).to(dtype)
    logits, targets = full[:, 1:], torch.randint(0, V, (3, 4))
    results = []
    for chunk_rows in (1, 3, 100):
        x = logits.detach().requires_grad_()
        logp, entropy = run(x, targets, 0.7, "torch", chunk_rows=chunk_rows)
        (logp.sum() + (entropy * 0.5).sum()).backward()
        results.append((logp, entropy, x.grad))
    for logp, entropy, grad in results[1:]:
        assert torch.equal(logp, results[0][0]) and torch.equal(entropy, results[0][1])
        assert torch.equal(grad, results[0][2])


@pytest.mark.skipif(triton_logprobs is None or not TRITON_INTERPRET,
                    reason="needs triton under TRITON_INTERPRET=1")
def test_row_offsets_past_2_31_elements():
    # Three rows 2^30 + 8 elements apart: the third starts 2^31 + 16 elements in, where an int32 row
    # offset wraps negative (what 16384 x 151936 logits hit from row 14,135 on). The view starts
    # 2^31 elements into a 2^32-element allocation, so a wrapped offset reads untouched (zero)
    # memory and fails the comparison instead of crashing. torch.empty reserves the 8.6 GB without
    # touching it; only the three rows' pages are ever written.
    stride = 2**30 + 8
    try:
        storage = torch.empty(2**32 + 2 * stride, dtype=torch.bfloat16)
    except RuntimeError:
        pytest.skip("cannot reserve 8.6 GB of virtual memory here")
    logits = storage.as_strided((3, V), (stride, 1), storage_offset=2**31)
    logits.copy_((torch.randn(3, V) * 2).to(torch.bfloat16))
    logits.requires_grad_()
    targets = torch.tensor([10, 20, V - 1])
    logp, entropy = run(logits, targets, 1.0, "triton")
    (logp.sum() + entropy.sum()).backward()
    x64, ref_logp, ref_entropy = float64_oracle(logits, targets, 1.0)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    assert (logp - ref_logp).abs().max() < FWD_ATOL
    assert (entropy - ref_entropy).abs().max() < FWD_ATOL
    grad = logits.grad.double()
    assert ((grad - x64.grad).abs() <= GRAD_ATOL + GRAD_RTOL[torch.bfloat16] * x64.grad.abs()).all()


@pytest.mark.skipif(triton_logprobs is None or not TRITON_INTERPRET,
                    reason="needs triton under TRITON_INTERPRET=1")
def test_kernel_gives_nan_for_a_target_outside_the_vocab():
    logp, entropy = run(torch.randn(2, V), torch.tensor([-100, 3]), 1.0, "triton")
    assert logp[0].isnan() and not logp[1].isnan() and not entropy.isnan().any()


def h100_ptx(kernel_name, dtype, **constexprs):
    """Compile a kernel for sm_90 as a launch on (rows, 151936) logits would (16-divisible pointers
    and strides), through Triton's real compiler and the ptxas bundled with it: no GPU needed.
    -> the PTX. Run it in a process without TRITON_INTERPRET: mixed with the interpreter's patched
    triton.language, compiling fails spuriously."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    fn = getattr(triton_logprobs, kernel_name)
    special = {"logits_ptr": dtype, "grad_logits_ptr": dtype, "targets_ptr": "*i64",
               "inv_temp": "fp32"}
    signature = {name: "constexpr" if name in constexprs
                 else special.get(name, "*fp32" if name.endswith("_ptr") else "i32")
                 for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if signature[name] not in ("constexpr", "fp32") and name != "rows_per_outer"}
    options = {"num_warps": triton_logprobs._num_warps(constexprs["BLOCK_V"])}
    return compile(ASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                   options=options).asm["ptx"]


def test_kernels_compile_for_a_gpu_with_128_bit_accesses():
    # The interpreter runs the kernel as Python and accepts things the GPU compiler rejects (it ran
    # a plain-float global that compiling refuses). This compiles the real thing for an H100/H200
    # without one, and checks that each thread moves 8 bf16 (16 bytes) per access: the kernels are
    # memory-bound, so that is their speed.
    pytest.importorskip("triton.backends.nvidia")
    code = ("import sys; sys.path.insert(0, 'tests')\n"
            "from test_kernels import h100_ptx\n"
            "fwd = h100_ptx('_logprobs_entropy_fwd', '*bf16', BLOCK_V=4096)\n"
            "print(int('ld.global.v4.b32' in fwd), end=' ')\n"
            "for flags in ((True, False), (False, True), (True, True)):\n"
            "    bwd = h100_ptx('_logprobs_entropy_bwd', '*bf16', BLOCK_V=4096,\n"
            "                   HAS_GRAD_LOGP=flags[0], HAS_GRAD_ENTROPY=flags[1])\n"
            "    print(int('ld.global.v4.b32' in bwd and 'st.global.v4.b32' in bwd), end=' ')")
    assert _python(code, TRITON_INTERPRET="0") == "1 1 1 1"


def test_cpu_tensors_take_the_kernel_only_under_the_interpreter(monkeypatch):
    import dapo_kernels.logprobs

    cpu = torch.zeros(1, 4)
    expected = "triton" if triton_logprobs is not None and TRITON_INTERPRET else "torch"
    assert default_backend(cpu) == expected
    # as read at import without the flag
    monkeypatch.setattr(dapo_kernels.logprobs, "TRITON_INTERPRET", False)
    assert default_backend(cpu) == "torch"


@pytest.mark.needs("logprobs_forward")
def test_imports_and_runs_without_triton():
    # sys.modules["triton"] = None makes `import triton` raise ImportError, as on a machine
    # without it
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, dapo_kernels\n"
            "assert dapo_kernels.logprobs.triton_logprobs is None\n"
            "logp, entropy = dapo_kernels.logprobs_and_entropy(torch.zeros(2, 10), "
            "torch.tensor([1, 2]))\n"
            "print(dapo_kernels.default_backend(torch.zeros(1, 4)), round(entropy[0].item(), 4))")
    assert _python(code, TRITON_INTERPRET="1") == f"torch {round(math.log(10), 4)}"


def test_rejects_targets_of_the_wrong_shape():
    with pytest.raises(ValueError, match="targets"):
        logprobs_and_entropy(torch.zeros(2, 3, 10), torch.zeros(2, 2, dtype=torch.long))


def _python(code, **env):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()
