"""
Compute precision: fp32, or bf16 with fp32 master weights (the precision of every GPU run, and of
`--precision bf16` on CPU, where torch's CPU autocast runs the same machinery as CUDA's).

    --precision  one process                        several (FSDP2)
    fp32         fp32 throughout                    fp32 throughout
    bf16         autocast around each forward phase gathered weights and compute in bf16
                 (a rollout, an evaluation, each    (MixedPrecisionPolicy); shards, optimizer
                 micro-batch's forward)             and gradient reduction in fp32
    auto         bf16 on CUDA; on a CPU, bf16 only where it is faster (choose() below)

In one process the weights stay fp32 and autocast casts them to bf16 as each matmul reads them.
Autocast keeps those bf16 copies for the life of the outermost autocast region, so a region must
never hold an optimizer step: forwards after the step, inside the same region, would still read
the copies of the weights from before it (every linear layer; only the embeddings and norms, which
autocast leaves in fp32, would move). Hence autocast() per phase, and check_no_autocast() before
each step: optimizer_step() is dapo.py's guarded step (a NaN or inf gradient skips it, as AMP's
GradScaler skips one).
"""
import contextlib
import math
from dataclasses import dataclass

import torch

from infra import cpu, distributed, health

PRECISIONS = ("auto", "fp32", "bf16")
# bf16 keeps 8 significant bits: a rounding to bf16 is off by at most u = 2^-8 of the value, half
# the gap eps = 2^-7 from 1 to the next bf16 number. The tolerances of bf16 checks count in u
BF16_UNIT_ROUNDOFF = torch.finfo(torch.bfloat16).eps / 2


# On a CPU, --precision auto takes bf16 for a model of cpu.SMALL_MODEL_PARAMS or more where its
# matmuls are at least this much faster than fp32's. With native bf16 (AVX-512 BF16, AMX) they
# were 5-9x faster here; with AVX2 only, 8-40x slower: the margin is wide either way
CPU_BF16_MIN_SPEEDUP = 1.25


@dataclass(frozen=True)
class Choice:
    precision: str  # "fp32" or "bf16"
    why: str  # how it was chosen, for the memory plan's first line


def choose(precision: str, device: str, params: int = 0, world: int = 1) -> Choice:
    """--precision resolved for a model of `params` parameters on `world` processes: fp32 and bf16
    as they are; auto -> bf16 on CUDA, and on a CPU bf16 only where it is faster. bf16 matmuls are
    fast only on CPUs with native bf16 instructions (AVX-512 BF16, AMX); on AVX2, most laptops
    before 2023, they are several times slower than fp32, so a short probe decides (one process
    only: the ranks of a CPU run would have to agree on a timing)."""
    if precision != "auto":
        return Choice(precision, f"--precision {precision}")
    if device.startswith("cuda"):
        return Choice("bf16", "auto: bf16 on CUDA")
    if world > 1:
        return Choice("fp32", "auto: fp32 on CPU in several processes")
    if params < cpu.SMALL_MODEL_PARAMS:  # the same figures on every CPU, as the demo's
        return Choice("fp32", f"auto: fp32 on CPU for a model under "
                              f"{cpu.SMALL_MODEL_PARAMS // 1_000_000}M parameters")
    speedup = cpu.bf16_speedup()
    faster = speedup >= CPU_BF16_MIN_SPEEDUP
    return Choice("bf16" if faster else "fp32",
                  f"auto: bf16 matmuls {speedup:.2g}x as fast as fp32 on this CPU "
                  f"({torch.backends.cpu.get_cpu_capability()})")


def resolve(precision: str, device: str, params: int = 0, world: int = 1) -> str:
    """choose()'s precision alone."""
    return choose(precision, device, params, world).precision


def autocast(precision: str, device: str):
    """The context of one forward phase in `precision` (resolved: "fp32" or "bf16") on `device`:
    bf16 autocast for a bf16 run in one process; nothing for fp32, nor under FSDP2, whose mixed
    precision gathers the weights in bf16 already (launch.load_policy). The rollout's phase passes
    Config.sampler_precision (--rollout-precision: a bf16 sampler beside an fp32 trainer is the
    mismatch infra/rollout_correction.py corrects), the others --precision."""
    if precision != "bf16" or distributed.world_size() > 1:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, torch.bfloat16)


def optimizer_step(opt, model, grad_norm) -> tuple[float, bool]:
    """opt.step(), guarded as mixed precision's steps are (AMP's GradScaler skips a step whose
    gradient is not finite): refused inside an autocast region; skipped, and said, when the
    gradient norm (clip_grad_norm_'s) is NaN or inf, so that the weights stay finite; the weights
    checked finite after it. -> (the norm, whether the step was taken)."""
    grad_norm, finite = gradient_is_finite(grad_norm)
    if finite:
        opt.step()
        health.check_finite(model, "after an optimizer step")
    return grad_norm, finite


def gradient_is_finite(grad_norm) -> tuple[float, bool]:
    """The guard before every optimizer step, given clip_grad_norm_'s norm: refuses a step inside
    an autocast region (check_no_autocast), and says so when the gradient holds a NaN or an inf
    anywhere (then the caller skips the step and the weights stay finite).
    -> (the norm before clipping, whether to step)."""
    check_no_autocast()
    grad_norm = distributed.as_local(grad_norm).item()
    if not math.isfinite(grad_norm):
        distributed.say(f"non-finite gradient norm ({grad_norm}): update skipped")
    return grad_norm, math.isfinite(grad_norm)


def check_no_autocast():
    """Refuse an optimizer step inside an autocast region: the forwards after it in the region
    would read the weights' bf16 copies from before the step (see the module docstring)."""
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        raise RuntimeError("an optimizer step inside an autocast region: the forwards after it "
                           "in the region would use the weights from before it. Enter autocast "
                           "per forward phase (infra/precision.py), never around opt.step()")
