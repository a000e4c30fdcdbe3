r"""
Several processes, with nothing but PyTorch's own distributed stack. torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK and the rendezvous address; this file turns them into a process group (nccl on GPUs, gloo
on CPU) and shards the model with FSDP2. Every helper is a no-op in a single process, so dapo.py has
one code path:

    python dapo.py ...                                   # one process
    torchrun --nproc_per_node=8 dapo.py ...              # one node, 8 GPUs
    torchrun --nnodes=4 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        dapo.py ...
"""
import contextlib
import datetime
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from infra.errors import UserError

# How long a rank waits in a collective for the others before it gives up. Inside a step the ranks
# meet often: every decode step of a rollout (the sampler's lockstep all-reduce), every FSDP unit of
# every forward and backward, so a 20k-token rollout never leaves a gap of more than a few seconds.
# The long gaps are the ones where one rank works alone: rank 0 writing a checkpoint (a 32B model's
# fp32 weights are 128 GB: ~4 min at 500 MB/s, ~20 min on a slow network filesystem) and loading the
# model before the first collective. 30 minutes covers those; a small model on a local disk can fail
# much faster with a lower value.
DEFAULT_TIMEOUT_S = 1800
_timeout_s = DEFAULT_TIMEOUT_S
_device = "cpu"  # this process's device, set by init(): where the collectives' tensors live
# How long a rank other than 0 waits, on a user's mistake, for rank 0 to report it (fail())
FAIL_WAIT_S = 30


def launched_world() -> int:
    """The processes torchrun started (its WORLD_SIZE), 1 without torchrun: known before init()."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int, str]:
    """-> (rank, world_size, this process's device). A collective that waits longer than timeout_s
    for another rank (stopped, swapping, stuck in I/O) raises instead of blocking forever."""
    global _timeout_s, _device
    world = launched_world()
    _device = device
    if world == 1:
        return 0, 1, device
    if device.startswith("cuda"):
        device = _device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    # NCCL's watchdog ends a timed-out process with SIGABRT, past any Python error handling:
    # faulthandler then prints every thread's Python stack, which shows the waiting line
    faulthandler.enable()
    _timeout_s = timeout_s
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), world, device


def shutdown(after_error: bool = False):
    """Leave the process group: a barrier first, so that no rank tears it down while another
    still needs it. after_error (an exception is on its way out of this rank): no barrier, and
    nothing raised here. Another rank may never arrive (it died, or waits in another collective),
    and the barrier's own failure would be the last error printed, hiding the first."""
    if not dist.is_initialized():
        return
    if after_error:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        return
    barrier("shutdown")
    dist.destroy_process_group()


def exit_after_shutdown(status: int = 0):
    """End a process of several after shutdown(), skipping the interpreter's teardown: on gloo
    (CPU) a process sometimes aborts there ("terminate called without an active exception", about
    1 run in 30 here), after its work is done and saved, and its exit code would then report
    another status. Flushes the output first. A single process just returns."""
    if launched_world() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


@contextlib.contextmanager
def _named(op: str, name: str | None, caller):
    """Re-raise a failed collective naming it (or, unnamed, the line that called it): gloo says only
    "Timed out waiting 1800000ms for recv operation to complete"."""
    try:
        yield
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        what = (f"{op} {name!r}" if name
                else f"{op} at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}")
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise UserError(f"rank {rank()}: {what} timed out after {_timeout_s:g} s: another "
                            "rank stopped or is far behind (raise --dist-timeout if it was only "
                            f"slow) ({e})") from e
        raise UserError(f"rank {rank()}: {what} failed: another rank has probably exited "
                        f"({e})") from e


# What gloo says when the rank at the other end is gone (its tcp/pair.cc: the socket closed or
# reset under it), and NCCL
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
             "remote process exited")


def collective_error(e: BaseException, timeout_s: float) -> UserError | None:
    """A collective's failure that no named helper here caught (one inside FSDP2's forward or
    backward, where gloo says only "Timed out waiting 1800000ms for recv operation to complete"
    or "Connection closed by peer") as one line: a timeout naming --dist-timeout, or another rank
    gone; None for any other error."""
    text = str(e)
    if not isinstance(e, RuntimeError) or "--dist-timeout" in text:
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    where = f"rank {rank()}: a collective (in the model's forward or backward, or torch's own)"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return UserError(f"{where} timed out after {timeout_s:g} s: another rank stopped or is "
                         f"far behind (raise --dist-timeout if it was only slow) ({first})")
    if any(said in text.lower() for said in PEER_GONE):
        return UserError(f"{where} failed: another rank has probably exited ({first})")
    return None


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def launched_rank() -> int:
    """This process's rank as torchrun set it: also before the process group exists."""
    return rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def say(text: str):
    """Print a line on rank 0 only, above the progress bar (also while the flags are parsed,
    before the process group exists: then every rank would be rank 0)."""
    if launched_rank() == 0:
        tqdm.write(text)


def local_shard(t):
    """A sharded tensor (DTensor) as this rank's shard; a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def fail(message: str):
    """Stop on a user's mistake (a flag, a path, a file): one line `error: ...` on stderr and exit
    status 2, as argparse's own errors. Under torchrun every rank finds the same mistake, and rank
    0 alone says it: the others wait, and torchrun ends them once rank 0 has exited. A rank still
    there after the wait found a mistake rank 0 did not, and says it itself. (The rank is read from
    RANK: this may run before the process group exists.)"""
    rank = launched_rank()
    if rank > 0:
        time.sleep(FAIL_WAIT_S)
    print(f"error: {message}" if rank == 0 else f"error: rank {rank}: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if launched_world() > 1:
        os._exit(2)  # as exit_after_shutdown: gloo's teardown can abort after the work
    raise SystemExit(2)


def all_reduce(values, op="sum", name: str | None = None):
    """Sum (or min, max) a number or a list of numbers over ranks; returns the same kind. Identity
    in one process.
    name: what is reduced ("dynamic-sampling count"), for the error if a rank never arrives."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values if isinstance(values, (list, tuple)) else [values], dtype=torch.float64,
                     device=_device)
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    with _named("all_reduce", name, sys._getframe(1)):
        dist.all_reduce(t, op=ops[op])
        out = t.tolist()  # on a GPU the wait ends here
    return out if isinstance(values, (list, tuple)) else type(values)(out[0])


def barrier(name: str | None = None):
    if dist.is_initialized():
        with _named("barrier", name, sys._getframe(1)):
            dist.barrier()


def shard(model, mixed_precision: bool):
    """FSDP2: each decoder block is one unit (its weights are gathered just before it runs and freed
    after), the root holds the embedding, the final norm and the head. With mixed precision (GPU),
    the gathered weights and the compute are bf16 while the sharded master weights, the optimizer
    and the gradient reduction stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mixed_precision else MixedPrecisionPolicy())
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def local_rows(model) -> dict:
    """{name: (the rows of dim 0 this rank holds, the full shape, its local tensor)} for each
    parameter of a model that shard() has sharded: FSDP2 cuts dim 0 as torch.chunk does (rank r
    holds rows [r c, r c + c), c = ceil(rows / world); the last ranks may hold fewer, or none)."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local()
        start = min(rank() * -(-p.shape[0] // world_size()), p.shape[0])
        out[name] = slice(start, start + local.shape[0]), p.shape, local
    return out


def is_sharded(model) -> bool:
    """Whether shard() has sharded the model (FSDP2), in one process or several."""
    return bool(_fsdp_modules(model))


def _fsdp_modules(model):
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model):
    """Full weights for the whole rollout: one all-gather per unit for all the tokens generated,
    instead of one per unit per token (which is what FSDP would otherwise do in every decode
    step's forward)."""
    units = _fsdp_modules(model)
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def full_state_dict(model) -> dict:
    """The model's full (unsharded) weights on CPU: on rank 0 only under FSDP (empty elsewhere), as
    is otherwise."""
    if not _fsdp_modules(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def local_optimizer_state(opt) -> dict:
    """The optimizer state with each sharded tensor replaced by this rank's shard: plain tensors, so
    the file loads with torch.load(weights_only=True). Restored by load_local_optimizer_state on the
    same world size."""
    from torch.distributed.tensor import DTensor
    sd = opt.state_dict()
    sd["state"] = {i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()}
                   for i, s in sd["state"].items()}
    return sd


def load_local_optimizer_state(opt, sd):
    from torch.distributed.tensor import DTensor
    opt.load_state_dict(sd)
    # wrap this rank's shards back into sharded tensors like their parameters
    for p, s in opt.state.items():
        if isinstance(p, DTensor):
            for k, v in s.items():
                if torch.is_tensor(v) and not isinstance(v, DTensor) and v.dim() > 0:
                    s[k] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                              stride=p.stride())


def as_local(t):
    """A DTensor (a sharded parameter's norm, say) as a plain tensor; a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def all_gather_object(obj, name: str | None = None) -> list:
    """[rank 0's obj, rank 1's obj, ...]: any picklable object (tensors on the CPU: a CUDA tensor
    would be unpickled on the sender's device). [obj] in one process."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * world_size()
    with _named("all_gather_object", name, sys._getframe(1)):
        dist.all_gather_object(out, obj)
    return out


def check_same(values: dict, what: str):
    """Raise on every rank, naming each key whose value is not the same on every rank and the
    ranks that hold each value, in one line: values {name: something comparable}, this rank's
    (e.g. its flags, as ranks started with their own command lines, one per node, may differ).
    Nothing in one process."""
    if not dist.is_initialized():
        return
    problems = disagreements(all_gather_object(values, name=what))
    if problems:
        raise UserError(f"the ranks disagree on {what}: " + "; ".join(problems))


def disagreements(per_rank: list[dict]) -> list[str]:
    """'KEY: VALUE on ranks 0-2, VALUE on rank 3' for each key whose value differs between the
    ranks (per_rank[r]: rank r's values; a key a rank lacks is None there)."""
    problems = []
    for key in dict.fromkeys(k for values in per_rank for k in values):
        holders: dict[str, list[int]] = {}
        for r, values in enumerate(per_rank):
            holders.setdefault(repr(values.get(key)), []).append(r)
        if len(holders) > 1:
            problems.append(f"{key}: " + ", ".join(f"{value} on {_ranks(ranks)}"
                                                   for value, ranks in holders.items()))
    return problems


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-63, 65' (ranks sorted)."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def share_in_order(kept: dict, n_wanted: int, per_step: int) -> list:
    """This rank's share of the first n_wanted items kept over all ranks, in the order of their
    numbers (kept: {global number: item with a .to(device)}, on the rank that made it), so that N
    ranks train on exactly the items one process would: the responses of dynamic sampling's
    groups, numbered in the order one process would have generated them. Each run of per_step
    items (a global mini-batch) is split evenly between the ranks, and an item moves to another
    rank only when its own holds more than its share (a response is token ids: cheap to send);
    moved items fill one rank after another, so a group's responses stay together where the share
    allows. In one process: the first n_wanted items, in order."""
    me, world = rank(), world_size()
    owners = all_gather_object(sorted(kept), name="kept responses")
    first = sorted((g, r) for r, numbers in enumerate(owners) for g in numbers)[:n_wanted]
    share = per_step // world  # items per rank in each run of per_step
    destination = {}
    for start in range(0, n_wanted, per_step):
        step = first[start:start + per_step]
        count = [0] * world
        for g, owner in step:  # first every rank keeps its own, up to its share...
            if count[owner] < share:
                destination[g], count[owner] = owner, count[owner] + 1
        for g, _ in step:  # ...then the rest go where there is room, a rank at a time
            if g not in destination:
                r = next(r for r in range(world) if count[r] < share)
                destination[g], count[r] = r, count[r] + 1
    incoming = {}
    if world > 1:  # CPU tensors: a CUDA tensor would be unpickled on the sender's device
        outgoing = {g: kept[g].to("cpu") for g, r in destination.items()
                    if g in kept and r != me}
        for sent in all_gather_object(outgoing, name="responses rebalanced"):
            incoming |= {g: item for g, item in sent.items() if destination[g] == me}
    return [kept[g] if g in kept else incoming[g].to(_device)
            for g, _ in first if destination[g] == me]
