"""dapo_kernels/linear.py: linear_logprobs_and_entropy (the output layer fused into the
log-prob/entropy kernel) against the unfused `logits = hidden @ weight.T` then
logprobs_and_entropy, and against float64 autograd; its memory; and the settings it trains under: a
tied embedding, padding, autocast, activation checkpointing, FSDP2 on two ranks."""
import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from dapo_kernels import linear_logprobs_and_entropy, logprobs_and_entropy
from dapo_kernels.logprobs import TRITON_INTERPRET, triton_logprobs
from model import Transformer, preset
from rendezvous import file_init

N, C, V = 12, 16, 3001  # tokens, hidden size, vocab (not a multiple of the Triton block below)
BLOCK = 512
# The fp32 kernel against another fp32 computation or float64, in another order. Log-probs and
# entropies here reach ~16 in size; a logit is a C-term dot product and lse a V-term sum, each
# rounded in fp32: 8 ulps of 16 is their room.
EPS32 = torch.finfo(torch.float32).eps
FWD_TOL = 8 * 16 * EPS32  # absolute, 1.5e-5
# max |error| / max |reference| of a gradient: the entries are V-term (d hidden) or N-term
# (d weight) sums in which the one-hot cancels against p, so round-off relative to the largest
# entry grows with the number of terms: 2^10 eps is a third of V eps
GRAD_RTOL = 2**10 * EPS32  # 1.2e-4
# The same computation split another way (chunks, ranks, checkpointing), both in float64: they
# differ by float64 round-off, ~1e-15 relative
EXACT_RTOL = 1e-9

# the fused head against other computations, and a few cheap checks of its interface
pytestmark = pytest.mark.parity


def inputs(n=N, seed=0, dtype=torch.float32):
    """hidden (n, C), weight (V, C), targets (n,), and the upstream gradients (2, n) a loss would
    send back."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, C, generator=g, dtype=torch.float64)
    weight = torch.randn(V, C, generator=g, dtype=torch.float64) * 0.5  # logits ~ N(0, 2^2)
    targets = torch.randint(0, V, (n,), generator=g)
    return hidden.to(dtype), weight.to(dtype), targets, torch.randn(2, n, generator=g)


def fused(hidden, weight, targets, temperature=1.0, **kw):
    backend = kw.pop("backend", "torch")
    return linear_logprobs_and_entropy(hidden, weight, targets, temperature, backend=backend, **kw)


def unfused(hidden, weight, targets, temperature=1.0, **kw):
    return logprobs_and_entropy(hidden @ weight.T, targets, temperature, backend="torch", **kw)


def float64_textbook(hidden, weight, targets, temperature=1.0):
    logits = hidden.double() @ weight.double().T  # (..., V)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def outputs_and_grads(head, hidden, weight, targets, upstream, wrt="both", **kw):
    """Runs head(hidden, weight, targets) and back-propagates sum(g_logp * logp)
    (+ sum(g_ent * entropy) unless wrt == "logp": the training case, where the entropy is only
    logged) -> logp, entropy, d hidden, d weight."""
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logp, entropy = head(h, w, targets, **kw)
    loss = (upstream[0].to(logp.dtype) * logp).sum()
    if wrt == "both":
        loss = loss + (upstream[1].to(entropy.dtype) * entropy).sum()
    loss.backward()
    return logp, entropy, h.grad, w.grad


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


# one token, a ragged last chunk, one chunk for all
@pytest.mark.needs("logprobs_forward", "logprobs_backward")
@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])
@pytest.mark.parametrize("wrt", ["logp", "both"])
def test_matches_the_unfused_path_in_fp32(chunk_tokens, wrt):
    hidden, weight, targets, upstream = inputs()
    got = outputs_and_grads(fused, hidden, weight, targets, upstream, wrt, temperature=0.7,
                            chunk_tokens=chunk_tokens)
    want = outputs_and_grads(unfused, hidden, weight, targets, upstream, wrt, temperature=0.7)
    for name, a, b in zip(("logp", "entropy"), got[:2], want[:2]):
        assert a.dtype == torch.float32 and a.shape == (N,)
        assert (a - b).abs().max() < FWD_TOL, name
    for name, a, b in zip(("d hidden", "d weight"), got[2:], want[2:]):
        assert a.dtype == torch.float32 and rel_err(a, b) < GRAD_RTOL, (name, rel_err(a, b))


@pytest.mark.needs("logprobs_forward", "logprobs_backward")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_float64_autograd(temperature):
    hidden, weight, targets, upstream = inputs(seed=1)
    got = outputs_and_grads(fused, hidden, weight, targets, upstream, temperature=temperature,
                            chunk_tokens=5)
    want = outputs_and_grads(float64_textbook, hidden.double(), weight.double(), targets,
                             upstream.double(), temperature=temperature)
    assert (got[0] - want[0]).abs().max() < FWD_TOL and (got[1] - want[1]).abs().max() < FWD_TOL
    assert rel_err(got[2], want[2]) < GRAD_RTOL and rel_err(got[3], want[3]) < GRAD_RTOL


@pytest.mark.needs("logprobs_forward", "logprobs_backward")
def test_a_tied_weight_gets_both_gradients():
    # Qwen2.5-0.5B's head is its embedding: the weight's gradient is the embedding's plus the head's
    # (in float64: fused and unfused sum the same products in another order)
    _, weight, targets, upstream = inputs(seed=2, dtype=torch.float64)
    ids = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))

    # embed -> a nonlinearity -> the same matrix as the output layer
    def weight_grad(head, embed=True, **kw):
        w = weight.detach().requires_grad_()
        hidden = torch.tanh((w if embed else w.detach())[ids]) * 2  # (N, C)
        logp, entropy = head(hidden, w, targets, 0.7, **kw)
        ((upstream[0] * logp).sum() + (upstream[1] * entropy).sum()).backward()
        return w.grad

    tied = weight_grad(fused, chunk_tokens=5)
    assert rel_err(tied, weight_grad(unfused)) < EXACT_RTOL
    # the embedding's part is there
    assert rel_err(tied, weight_grad(fused, embed=False, chunk_tokens=5)) > 1e-2


@pytest.mark.needs("logprobs_forward", "logprobs_backward")
def test_masked_positions_are_skipped():
    # (B, R) right-padded responses: padding positions get logp = entropy = 0 and no gradient, and
    # their targets (here -100, outside the vocab) are never read; float64, against the real rows
    # alone, in one matmul
    hidden, weight, targets, upstream = inputs(n=2 * 6, seed=4, dtype=torch.float64)
    hidden, targets, upstream = hidden.view(2, 6, C), targets.view(2, 6), upstream.view(2, 2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    targets = targets.masked_fill(~mask, -100)
    logp, entropy, d_hidden, d_weight = outputs_and_grads(
        fused, hidden, weight, targets, upstream, mask=mask, chunk_tokens=3)
    real = outputs_and_grads(unfused, hidden[mask], weight, targets[mask], upstream[:, mask])
    assert logp.shape == entropy.shape == (2, 6)
    assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all() and (d_hidden[~mask] == 0).all()
    assert rel_err(logp[mask], real[0]) < EXACT_RTOL
    assert rel_err(entropy[mask], real[1]) < EXACT_RTOL
    assert rel_err(d_hidden[mask], real[2]) < EXACT_RTOL
    assert rel_err(d_weight, real[3]) < EXACT_RTOL


def test_an_all_padding_micro_batch_gives_zero_gradients():
    # a stand-in micro-batch, which every FSDP rank must still run through forward and backward
    hidden, weight, targets, upstream = inputs(n=4, seed=10)
    mask = torch.zeros(4, dtype=torch.bool)
    logp, entropy, d_hidden, d_weight = outputs_and_grads(
        fused, hidden, weight, targets, upstream, mask=mask)
    assert all((t == 0).all() for t in (logp, entropy, d_hidden, d_weight))


@pytest.mark.needs("logprobs_forward")
def test_outputs_are_their_own_tensors_not_views():
    # FSDP2 hooks the root's forward outputs, and warns that in-place ops on a view would lose
    # the hooks
    hidden, weight, targets, _ = inputs(n=12)
    for mask in (None, torch.arange(12).view(3, 4) < 10):
        logp, entropy = fused(hidden.view(3, 4, C).requires_grad_(), weight, targets.view(3, 4),
                              mask=mask)
        assert logp.shape == entropy.shape == (3, 4)
        assert logp._base is None and entropy._base is None


@pytest.mark.skipif(triton_logprobs is None or not TRITON_INTERPRET,
                    reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_triton_path_matches_float64_autograd():
    hidden, weight, targets, upstream = inputs(n=5, seed=5)
    got = outputs_and_grads(fused, hidden, weight, targets, upstream, temperature=0.7,
                            chunk_tokens=2, backend="triton", block_v=BLOCK)
    want = outputs_and_grads(float64_textbook, hidden.double(), weight.double(), targets,
                             upstream.double(), temperature=0.7)
    assert (got[0] - want[0]).abs().max() < FWD_TOL and (got[1] - want[1]).abs().max() < FWD_TOL
    assert rel_err(got[2], want[2]) < GRAD_RTOL and rel_err(got[3], want[3]) < GRAD_RTOL


@pytest.mark.needs("logprobs_forward", "logprobs_backward")
def test_a_bf16_weight_gradient_is_summed_in_fp32():
    # 64 chunks of one token. Summed in fp32 and rounded once, d weight is within one bf16 ulp
    # (<= 2^-7 relative) of the unfused single matmul's, which sums in fp32 internally; summed in
    # bf16 (rounded after every chunk) it is thousands of ulps off on the small entries
    hidden, weight, targets, upstream = inputs(n=64, seed=6, dtype=torch.bfloat16)
    *_, got = outputs_and_grads(fused, hidden, weight, targets, upstream, "logp", chunk_tokens=1)
    *_, want = outputs_and_grads(unfused, hidden, weight, targets, upstream, "logp")
    assert got.dtype == torch.bfloat16
    ulp = 2**-7 * want.float().abs() + torch.finfo(torch.bfloat16).tiny
    assert ((got.float() - want.float()).abs() <= ulp).all()


@pytest.mark.needs("logprobs_forward", "logprobs_backward")
def test_autocast_bf16_runs_the_matmul_in_bf16_like_the_unfused_path():
    hidden, weight, targets, upstream = inputs(seed=7)
    results = {}
    runs = (("fused", fused, {"chunk_tokens": 5}), ("unfused", unfused, {}), ("fp32", unfused, {}))
    for name, head, kw in runs:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name != "fp32"):
            results[name] = outputs_and_grads(head, hidden, weight, targets, upstream, **kw)
    fused_ac, unfused_ac, fp32 = results["fused"], results["unfused"], results["fp32"]
    # bf16 logits move log-probs by ~1e-2 from fp32 ones: equal to the unfused autocast path, not
    # to fp32
    assert (unfused_ac[0] - fp32[0]).abs().max() > 1e-3
    assert (fused_ac[0] - unfused_ac[0]).abs().max() < FWD_TOL
    assert (fused_ac[1] - unfused_ac[1]).abs().max() < FWD_TOL
    # fp32 gradients of fp32 inputs, through the bf16 casts
    for got, want in zip(fused_ac[2:], unfused_ac[2:]):
        assert got.dtype == torch.float32 and rel_err(got, want) < 2**-7


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns, other than the weight's size (its transpose, its
    gradient)."""

    def __init__(self, weight):
        super().__init__()
        self.skip, self.numel = weight.numel(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() != self.skip:
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.needs("logprobs_forward", "logprobs_backward")
def test_no_op_creates_more_than_a_chunk_of_logits():
    hidden, weight, targets, upstream = inputs(n=64, seed=8)
    with LargestTensor(weight) as fused_mode:
        outputs_and_grads(fused, hidden, weight, targets, upstream, chunk_tokens=5)
    with LargestTensor(weight) as unfused_mode:
        outputs_and_grads(unfused, hidden, weight, targets, upstream)
    assert fused_mode.numel <= 5 * V
    assert unfused_mode.numel >= 64 * V  # the probe sees the full logits where they exist


def saved_bytes(head, hidden, weight, targets, **kw):
    """Bytes of every tensor autograd saves for the backward during head(...)."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head(hidden.requires_grad_(), weight.requires_grad_(), targets, **kw)
    return sum(sizes)


@pytest.mark.needs("logprobs_forward")
def test_saved_state_holds_no_vocab_sized_tensor():
    hidden, weight, targets, _ = inputs(n=64, seed=9)
    inputs_bytes = hidden.nbytes + weight.nbytes  # alive anyway: the activations and the parameter
    fused_saved = saved_bytes(fused, hidden, weight, targets, chunk_tokens=5)
    unfused_saved = saved_bytes(unfused, hidden, weight, targets)
    # per token: its target (8 bytes), lse and E[z] (4 + 4)
    assert fused_saved - inputs_bytes <= 16 * 64
    # the (N, V) fp32 logits: what the fused path avoids
    assert unfused_saved - inputs_bytes >= 64 * V * 4


@pytest.mark.needs("logprobs_forward", "logprobs_backward", "rope", "attention")
def test_activation_checkpointing_changes_no_gradient():
    # float64: fused and checkpointed against unfused and not, the same sums in another order
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=V)).double().train()
    ids = torch.randint(0, V, (2, 9))
    upstream = torch.randn(2, 8)

    def head_loss(model, use_fused):
        def head(h, w):  # predict token t + 1 from position t, as dapo.response_logprobs does
            if use_fused:
                return linear_logprobs_and_entropy(h[:, :-1], w, ids[:, 1:], 0.7, chunk_tokens=5,
                                                   backend="torch")
            return logprobs_and_entropy(h[:, :-1] @ w.T, ids[:, 1:], 0.7, backend="torch")
        logp, _ = model(ids, head=head)
        return (upstream * logp).sum()

    reference = copy.deepcopy(model)
    model.activation_checkpointing = True
    head_loss(model, True).backward()
    head_loss(reference, False).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, q.grad) < EXACT_RTOL, name


def test_rejects_mismatched_shapes():
    hidden, weight, targets, _ = inputs()
    with pytest.raises(ValueError, match="weight"):
        fused(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match="targets"):
        fused(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="mask must be bool"):
        fused(hidden, weight, targets, mask=torch.ones(N, dtype=torch.long))


# --------------------------------------------------------------------------------------------------
# FSDP2 on two gloo ranks: the head runs inside model.forward, where FSDP has gathered the weight;
# its gradient must reach the sharded parameter, tied to the embedding or not

FSDP_BATCH, FSDP_LEN = 4, 9


def _fsdp_worker(rank, world_size, init_method, out_dir):
    # FSDP2 as dapo.py shards: one unit per block, the root holds embedding and head
    from infra.distributed import shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        results = {}
        for tied in (True, False):
            torch.manual_seed(0)  # the same model and batch on every rank
            # float64: 2 ranks and 1 process sum the same gradient terms in another order
            config = preset("tiny", vocab_size=V, tie_word_embeddings=tied)
            model = Transformer(config).double().train()
            ids = torch.randint(0, V, (FSDP_BATCH, FSDP_LEN))
            upstream = torch.randn(FSDP_BATCH, FSDP_LEN - 1)

            # the token-level sum over this rank's rows, divided by the global count
            def loss(model, rows):
                def head(h, w):
                    return linear_logprobs_and_entropy(h[:, :-1], w, ids[rows, 1:], chunk_tokens=5,
                                                       backend="torch")
                logp, _ = model(ids[rows], head=head)
                return (upstream[rows] * logp).sum() / upstream.numel()

            one = copy.deepcopy(model)  # one process, the whole batch
            loss(one, slice(None)).backward()
            shard(model, mixed_precision=False)
            model.activation_checkpointing = True
            half = FSDP_BATCH // world_size
            # FSDP2 averages gradients over ranks: x world size makes it the sum of the ranks' parts
            (loss(model, slice(rank * half, (rank + 1) * half)) * world_size).backward()
            # full_tensor: a collective, every rank calls it
            errors = {name: rel_err(p.grad.full_tensor(), q.grad)
                      for (name, p), q in zip(model.named_parameters(), one.parameters())}
            results["tied" if tied else "untied"] = errors
        torch.save(results, os.path.join(out_dir, f"errors{rank}.pt"))
        dist.barrier()  # both files are written before either rank starts tearing gloo down
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_errors(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp")
    spawn = mp.get_context("spawn")
    init_method = file_init(out_dir)  # not a port: two suites on one machine cannot collide
    ranks = [spawn.Process(target=_fsdp_worker, args=(r, 2, init_method, str(out_dir)))
             for r in range(2)]
    for p in ranks:
        p.start()
    # a rank out of lockstep leaves the other blocked in a collective
    deadline = time.monotonic() + 120
    for p in ranks:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in ranks:
        if p.is_alive():
            p.kill()
    # The results, not the exit codes: gloo on CPU sometimes aborts in its teardown ("terminate
    # called without an active exception", ~1 run in 40 here), after the barrier that follows both
    # ranks' results
    files = [out_dir / f"errors{r}.pt" for r in range(2)]
    assert all(f.exists() for f in files), \
        f"a rank failed or hung: exit codes {[p.exitcode for p in ranks]}"
    results = [torch.load(f, weights_only=True) for f in files]
    assert results[0] == results[1]  # each rank compared the full (gathered) gradients
    return results[0]


@pytest.mark.needs("logprobs_forward", "logprobs_backward", "rope", "attention")
@pytest.mark.parametrize("head", ["tied", "untied"])
def test_fsdp2_gradients_equal_one_process(fsdp_errors, head):
    errors = fsdp_errors[head]
    # a tied head is the embedding's parameter
    assert ("lm_head.weight" in errors) == (head == "untied")
    assert max(errors.values()) < EXACT_RTOL, errors
