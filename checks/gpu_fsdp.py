"""
GPU check: FSDP2 on one process. The multi-GPU path (the model sharded by infra.distributed.shard,
bf16 weights for compute by FSDP's mixed-precision policy, fp32 master weights and reductions,
NCCL) otherwise first runs on an 8-GPU job; here it runs in a process group of one rank on one
GPU, against the one-GPU path (fp32 weights, bf16 compute by autocast) on the same weights and the
same batch, and against fp32. Not part of `make bench` (no GPU there).

    python -m checks.gpu_fsdp                          # Qwen2.5-0.5B shape, one GPU, ~1 min
    python -m checks.gpu_fsdp --device cpu --preset tiny   # smoke: gloo, fp32 on both sides

What it checks, each a line of the table (exit 1 if one fails):
- full weights: distributed.full_state_dict of the sharded model equals the model's own weights;
- log-probs: response_logprobs (the trainer's forward) on the batch, sharded against one-GPU;
- gradient: the gradient dapo.update_policy takes its step with (micro-batches, the token count
  over ranks, the loss scaled by the world size), by its cosine to the one-GPU path's and its
  norm's ratio, each path also against fp32;
- rollout: a rollout of the sharded model inside distributed.gathered (the weights gathered once
  for the whole rollout), and the gap between the sampler's log-probs and the trainer's on its
  tokens (update_policy's training/rollout_logp_diff_mean).
The advantages are drawn at random: a random model answers nothing right, and its groups' real
advantages are all 0 (no gradient). On CPU both sides compute in fp32, so the bounds are fp32
round-off; on a GPU they compute in bf16 in two ways (bf16 weights against autocast), so the
bounds are loose: they catch a weight that gets no gradient, a gradient or a weight in the wrong
dtype, or a sampler reading other weights than the trainer, not rounding.
"""
import argparse
import copy
import sys
import tempfile
from dataclasses import replace

import torch
import torch.distributed as dist

import dapo
from data import load_tokenizer
from infra import distributed, precision
from model import Transformer, num_params, preset
from logprobs import response_logprobs
from reward import Verifier
from toy import make_toy_tokenizer, toy_rows


class KeepGradient(torch.optim.Optimizer):
    """An optimizer whose step keeps the gradient it is given (flat, fp32, on the CPU) and changes
    no weight: update_policy's own gradient, taken where it would step."""

    def __init__(self, params):
        super().__init__(params, {})
        self.gradient, self.missing = None, 0  # missing: weights without a gradient (as zeros)

    @torch.no_grad()
    def step(self):
        params = [p for group in self.param_groups for p in group["params"]]
        self.missing = sum(p.grad is None for p in params)
        self.gradient = torch.cat([
            torch.zeros(p.numel(), dtype=torch.float64) if p.grad is None
            else distributed.as_local(p.grad).flatten().double().cpu() for p in params])


def gradient(model, batch, cfg):
    opt = KeepGradient(model.parameters())
    dapo.update_policy(model, opt, batch, cfg)  # cfg.precision: its autocast
    return opt.gradient, opt.missing


def cosine(a, b):
    return float(a @ b / (a.norm() * b.norm()))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-response-len", type=int, default=256)
    p.add_argument("--device", default="cuda",
                   help="cpu runs the same script as a smoke test (--preset tiny)")
    args = p.parse_args()
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("gpu_fsdp.py needs a CUDA GPU (none found)")
    device = torch.device(args.device, 0) if on_gpu else torch.device("cpu")
    with tempfile.TemporaryDirectory() as d:
        # a process group of one rank: distributed's helpers then run their collectives
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{d}/rendezvous",
                                rank=0, world_size=1, device_id=device if on_gpu else None)
        distributed._device = str(device)  # where all_reduce puts its tensors (set by init())
        try:
            failed = run(args, device, d)
        finally:
            dist.destroy_process_group()
    sys.exit(1 if failed else 0)


def run(args, device, d) -> list[str]:
    on_gpu = device.type == "cuda"
    make_toy_tokenizer(d)
    tok = load_tokenizer(d)
    torch.manual_seed(0)
    one = Transformer(preset(args.preset)).to(device)
    sharded = distributed.shard(copy.deepcopy(one), mixed_precision=on_gpu)
    where = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(f"{args.preset}: {num_params(one) / 1e6:.0f}M parameters on {where}; one-GPU side "
          f"{'fp32 weights, bf16 autocast' if on_gpu else 'fp32'}, sharded side "
          f"{'bf16 weights (MixedPrecisionPolicy)' if on_gpu else 'fp32'}")
    cfg = dapo.Config(device=args.device, train_prompts=args.prompts, gen_prompts=args.prompts,
                      group_size=args.group_size, mini_batch_prompts=args.prompts,
                      max_response_len=args.max_response_len,
                      overlong_buffer=args.max_response_len // 4, dynamic_sampling=False,
                      grad_clip=1e9)  # no clipping: the gradient as computed
    # the one-GPU side: bf16 autocast per forward phase (dapo.py's, from --precision); the sharded
    # side: no autocast, FSDP's policy gathers bf16 weights; and fp32, the reference
    one_gpu_cfg, fp32 = replace(cfg, precision="bf16" if on_gpu else "fp32"), \
        replace(cfg, precision="fp32")
    rows = toy_rows(args.prompts, seed=0)
    g = torch.Generator(device).manual_seed(0)

    def rollout(model, run_cfg):
        batch = dapo.rollout(model, rows, tok, run_cfg, Verifier(), group_size=cfg.group_size,
                             temperature=1.0, top_p=1.0, top_k=0, generator=g)  # gathered inside
        adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
        return replace(batch, adv=adv.to(device))

    checks = []  # (what, measured, bound, passed)
    full, own = distributed.full_state_dict(sharded), one.state_dict()
    worst = max(float((full[k].to(device) - v).abs().max()) for k, v in own.items())
    checks.append(("full weights: max |sharded - one-GPU|", worst, 0.0, worst == 0.0))

    batch = rollout(one, one_gpu_cfg)  # one batch, the same tokens for every side below
    with torch.no_grad():
        with precision.autocast(one_gpu_cfg.precision, one_gpu_cfg.device):
            ref, _ = response_logprobs(one, batch, cfg.temperature)
        # gathered, as the project's no-grad forwards outside update_policy are: FSDP2 does not
        # reshard the root after a forward (its backward would gather it again), so after a bare
        # no-grad one parameters() lists the root's unsharded weights, and an optimizer built
        # then (KeepGradient, below) holds tensors that never get a gradient. dapo.py builds its
        # optimizer before any forward
        with distributed.gathered(sharded):
            logp, _ = response_logprobs(sharded, batch, cfg.temperature)
    gap = float(((logp - ref).abs() * batch.response_mask).sum() / batch.response_mask.sum())
    bound = 0.05 if on_gpu else 1e-5
    checks.append(("log-probs: mean |sharded - one-GPU| (nats)", gap, bound, gap <= bound))

    g_one, _ = gradient(one, batch, one_gpu_cfg)
    g_sharded, missing = gradient(sharded, batch, fp32)
    g_fp32, _ = gradient(one, batch, fp32)
    checks.append(("gradient: sharded weights without one", missing, 0, missing == 0))
    cos, ratio = cosine(g_sharded, g_one), float(g_sharded.norm() / g_one.norm())
    bound = 0.98 if on_gpu else 1 - 1e-6
    checks.append(("gradient: cosine sharded / one-GPU", cos, bound, cos >= bound))
    bound = 0.05 if on_gpu else 1e-5
    checks.append(("gradient: |norm ratio - 1| sharded / one-GPU", abs(ratio - 1), bound,
                   abs(ratio - 1) <= bound))
    for name, grad in (("sharded", g_sharded), ("one-GPU", g_one)):
        checks.append((f"  (information) cosine {name} / fp32", cosine(grad, g_fp32), None, True))

    own_batch = rollout(sharded, fp32)
    stats = dapo.update_policy(sharded, KeepGradient(sharded.parameters()), own_batch, fp32)
    drift = stats["training/rollout_logp_diff_mean"]
    bound = 0.05 if on_gpu else 1e-5  # the run's own warning is at 0.05 nats
    checks.append(("rollout in gathered(): sampler vs trainer log-prob gap (nats)", drift, bound,
                   drift <= bound))

    print(f"{'check':<64} {'measured':>12} {'bound':>10}  result")
    for what, measured, bound, passed in checks:
        limit = "" if bound is None else f"{bound:10.3g}"
        print(f"{what:<64} {measured:12.4g} {limit:>10}  {'ok' if passed else 'FAILED'}")
    return [what for what, _, _, passed in checks if not passed]


if __name__ == "__main__":
    main()
