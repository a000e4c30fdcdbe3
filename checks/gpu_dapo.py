"""
GPU check: dapo.py itself, on a random Qwen2.5-0.5B-shaped model in bf16 (--precision auto), a few
steps with real advantages, then a resume. Prints generation and training tokens/s and the peak
GPU memory. Not part of `make bench` (no GPU there).

    python -m checks.gpu_dapo                     # one GPU, ~2 minutes
    python -m checks.gpu_dapo --nproc 2           # FSDP2 on 2 GPUs, under torchrun
    python -m checks.gpu_dapo --device cpu --preset tiny --precision bf16 --prompts 4 \
        --group-size 4 --max-response-len 16         # smoke: the same on CPU (autocast)

A random model says nothing that the toy task's verifier rewards, and it never samples the toy
tokenizer's EOS: every response would run to --max-response-len, every reward and advantage would
be the same, the gradient 0, and no check below could fail. So the run gets two stand-ins:
- lengths: generation_config.json lists 4 V / L token ids as EOS (V the model's vocabulary, L
  --max-response-len), so that lengths are about geometric with mean L/4; the few that reach L
  get the overlong penalty;
- rewards: --reward-fn scores each response by its text, +1 when the text's length is odd, else
  -1. The model's tokens are rarely the toy tokenizer's (287 of V), so most texts are empty and
  some hold a character or a few: the EOS ids include the toy tokenizer's characters.
Groups then hold mixed rewards (dynamic sampling is off: every group is trained on).

What it checks (exit 1 if one fails):
1. run A, --steps steps with a checkpoint after each: every metric finite, the optimizer steps
   taken (2 per rollout step: 2 mini-batches), a gradient norm above 0, groups with mixed
   rewards, lengths that vary, the sampler's log-probs within bf16 rounding of the trainer's;
2. run B, resumed (--resume) from A's checkpoint before the last step, redoing the last step:
   the same rollout and pi_old (its length, reward and entropy equal A's to fp32 round-off: the
   weights, the sampling generator's state and the data position come back exactly, and a GPU's
   inference kernels are deterministic), the same gradient norm (within 1%: backward kernels may
   add in another order) and the same update (B's weights after it within 5% of the update's
   size of A's: the optimizer state came back). A run that keeps autocast's weight copies across
   optimizer steps fails here too: its last step sampled from older weights than B's.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from safetensors import safe_open

import dapo
from config import parse_args
from infra import distributed
from infra.hf_io import checkpoint_files
from infra.precision import BF16_UNIT_ROUNDOFF as U  # a rounding: off by <= u
from model import ModelConfig, Transformer, num_params, preset
from toy import make_toy_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REWARD_FN = '''def score(response, ground_truth):
    """+1 when the text has an odd number of characters: a random model's rewards vary."""
    return 1.0 if len(response) % 2 else -1.0
'''
# the metrics a resumed step must reproduce, and how closely (relative): the rollout and pi_old
# come before any backward (deterministic kernels), the gradient after one
SAME_ROLLOUT = ("rollout/response_length/mean", "rollout/reward/mean", "rollout/acc",
                "actor/entropy", "training/rollout_logp_diff_mean")
ROLLOUT_TOL, GRAD_TOL, UPDATE_TOL = 1e-6, 0.01, 0.05


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2, help="run A's rollout steps (>= 2)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda",
                   help="cpu runs the same script as a smoke test (--preset tiny)")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                   help="dapo.py's --precision (auto: bf16 on CUDA)")
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun), one GPU each")
    p.add_argument("--dapo", nargs=argparse.REMAINDER,
                   help="internal: one dapo.py run with these flags (what the check launches), "
                        "then the peak GPU memory")
    args = p.parse_args()
    if args.dapo is not None:
        return dapo_run(args.dapo)
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"gpu_dapo.py needs {args.nproc} CUDA GPU(s), found "
                         f"{torch.cuda.device_count()}; the CPU demo is `make run`")
    if args.steps < 2 or args.prompts % (2 * args.nproc):
        raise SystemExit("gpu_dapo.py needs --steps >= 2 and --prompts a multiple of 2 x --nproc "
                         "(two mini-batches, whole groups per process)")
    with tempfile.TemporaryDirectory(dir=scratch_dir()) as d:
        failed = check(args, d)
    sys.exit(1 if failed else 0)


def dapo_run(argv):
    """python dapo.py ARGV, and the peak GPU memory of rank 0."""
    cfg = parse_args(argv)
    dapo.main(cfg)
    if cfg.device.startswith("cuda") and int(os.environ.get("RANK", "0")) == 0:
        print(f"peak GPU memory (rank 0): {torch.cuda.max_memory_allocated(cfg.device) / 2**30:.1f}"
              " GiB", flush=True)
    distributed.exit_after_shutdown()


def scratch_dir():
    """/dev/shm when it has room for the model and three checkpoints (16 bytes a parameter
    each: fp32 weights and AdamW's two moments), else the default: the checkpoints are the
    check's slowest writes on a network disk."""
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 32 * 2**30 else None
    except OSError:
        return None


def write_model(d, args) -> str:
    """A random model of --preset with the toy tokenizer, whose generation_config.json lists
    4 V / L EOS ids (see the module docstring); the reward function beside it."""
    model_dir = os.path.join(d, "model")
    torch.manual_seed(0)
    # tiny: a vocabulary of 512, more than half of it the toy tokenizer's (texts that vary)
    sizes = {"vocab_size": 512} if args.preset == "tiny" else {}
    model = Transformer(preset(args.preset, **sizes))
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.preset}: {num_params(model) / 1e6:.1f}M parameters, on {args.nproc} x {where}")
    model.save_pretrained(model_dir)
    vocab, L = model.config.vocab_size, args.max_response_len
    del model
    tok = make_toy_tokenizer(model_dir)
    # the toy tokenizer's EOS and its other characters, then ids it cannot decode, up to 4 V / L
    characters = [i for i in range(tok.vocab_size) if tok.decode([i])]
    others = range(tok.vocab_size, vocab)
    eos = (tok.eos_token_ids + characters + list(others))[:round(4 * vocab / L)]
    config_file = os.path.join(model_dir, "generation_config.json")
    with open(config_file) as f:
        generation = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**generation, "eos_token_id": eos}, f)
    with open(os.path.join(d, "reward.py"), "w") as f:
        f.write(REWARD_FN)
    print(f"{len(eos)} EOS ids of {vocab} (mean length about {vocab / len(eos):.0f} tokens of "
          f"{L}); reward: the parity of the text's length")
    return model_dir


def dapo_flags(args, d, model_dir) -> list[str]:
    P = args.prompts
    return ["--model", model_dir, "--out-dir", os.path.join(d, "run"), "--device", args.device,
            "--precision", args.precision, "--steps", str(args.steps), "--save-every", "1",
            "--train-prompts", str(P), "--mini-batch-prompts", str(P // 2),
            "--group-size", str(args.group_size), "--max-response-len", str(args.max_response_len),
            "--overlong-buffer", str(args.max_response_len // 4), "--no-dynamic-sampling",
            "--eval-every", "0", "--lr", str(args.lr), "--warmup-steps", "0",
            "--rollout-slots", str(P * args.group_size // args.nproc),
            "--micro-batch-tokens", str(args.micro_batch_tokens),
            "--reward-fn", os.path.join(d, "reward.py") + ":score", "--reward-fn-all-rows"]


def run_dapo(args, flags, what) -> float:
    """One dapo.py run (under torchrun with --nproc > 1), its output passed through -> seconds."""
    launcher = [] if args.nproc == 1 else ["-m", "torch.distributed.run", "--standalone",
                                           f"--nproc_per_node={args.nproc}"]
    print(f"\n{what}", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *launcher, "-m", "checks.gpu_dapo", "--dapo", *flags],
                          cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{what}: exit {done.returncode}")
    return time.perf_counter() - t0


def read_metrics(run_dir) -> list[dict]:
    """The step rows of the run's metrics.jsonl (the evaluations are off), without its first row,
    the run's settings ({"step": 0, "config": ...})."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if "config" not in row]


def check(args, d) -> list[str]:
    model_dir = write_model(d, args)
    flags = dapo_flags(args, d, model_dir)
    run_dir = os.path.join(d, "run")
    a_s = run_dapo(args, flags, f"run A: {args.steps} steps, a checkpoint after each")
    a_rows = read_metrics(run_dir)
    print_speed(a_rows, args.prompts * args.group_size, a_s)
    # B redoes A's last step from the checkpoint before it; A's own checkpoint of it moves aside
    ckpts = os.path.join(run_dir, "checkpoints")
    last, before = f"step_{args.steps:06d}", f"step_{args.steps - 1:06d}"
    os.replace(os.path.join(ckpts, last), os.path.join(d, "a_last"))
    with open(os.path.join(ckpts, "latest"), "w") as f:
        f.write(before)
    run_dapo(args, flags + ["--resume"], f"run B: --resume from {before}, step {args.steps} again")
    b_row = read_metrics(run_dir)[-1]
    vocab = ModelConfig.from_json(os.path.join(model_dir, "config.json")).vocab_size
    checks = []
    for row in a_rows + [b_row]:
        checks += step_checks(row, "A" if row is not b_row else "B", vocab)
    checks += resume_checks(a_rows[-1], b_row, os.path.join(ckpts, before, "model"),
                            os.path.join(d, "a_last", "model"), os.path.join(ckpts, last, "model"))
    print(f"\n{'check':<66} {'measured':>11} {'bound':>10}  result")
    for what, measured, bound, passed in checks:
        print(f"{what:<66} {measured:11.4g} {bound:>10}  {'ok' if passed else 'FAILED'}")
    return [what for what, _, _, passed in checks if not passed]


def step_checks(row, run, vocab) -> list[tuple]:
    """(what, measured, bound as text, passed) for one step's metrics."""
    s = f"{run} step {row['step']}:"
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    mixed = 1 - row["rollout/frac_all_correct"] - row["rollout/frac_all_wrong"]
    # the sampler's and the trainer's log-probs of the same tokens, both in bf16: each off by
    # bf16's rounding of its hidden states; one bf16 ulp of a log-prob of size log V on the mean
    # (0.047 nats at V = 151936; the run's own warning is at 0.05). Measured on CPU (autocast,
    # this 0.5B shape, 4 x 32 tokens): mean 0.0037, max 0.012
    gap, tol = row["training/rollout_logp_diff_mean"], math.log(vocab) * U
    return [
        (f"{s} metrics not finite ({', '.join(bad) or 'none'})", len(bad), "0", not bad),
        (f"{s} optimizer steps taken (skipped {row['train/skipped_updates']})",
         row["train/updates"], "2", row["train/updates"] == 2),
        (f"{s} gradient norm", row["actor/grad_norm"], "> 0", row["actor/grad_norm"] > 0),
        (f"{s} groups with mixed rewards", mixed, "> 0", mixed > 0),
        (f"{s} responses cut at --max-response-len", row["rollout/truncated"], "< 0.5",
         row["rollout/truncated"] < 0.5),
        (f"{s} sampler vs trainer log-prob gap, mean (nats)", gap, f"{tol:.3g}", gap <= tol),
    ]


def resume_checks(a_row, b_row, before_dir, a_dir, b_dir) -> list[tuple]:
    """The resumed step (B) against the straight run's (A), and the weights after it."""
    checks = []
    for name in SAME_ROLLOUT:
        rel = relative(abs(b_row[name] - a_row[name]), abs(a_row[name]))
        checks.append((f"resume: {name}, |B - A| / |A|", rel, f"{ROLLOUT_TOL:g}",
                       rel <= ROLLOUT_TOL))
    rel = relative(abs(b_row["actor/grad_norm"] - a_row["actor/grad_norm"]),
                   a_row["actor/grad_norm"])
    checks.append(("resume: gradient norm, |B - A| / A", rel, f"{GRAD_TOL:g}", rel <= GRAD_TOL))
    apart, update = weight_distances(before_dir, a_dir, b_dir)
    rel = relative(apart, update)
    checks.append(("resume: weights after, |B - A| / |A - before|", rel, f"{UPDATE_TOL:g}",
                   rel <= UPDATE_TOL and update > 0))
    return checks


def relative(gap: float, scale: float) -> float:
    """gap / scale; a gap from nothing is infinitely large, none is 0."""
    return gap / scale if scale else 0.0 if gap == 0 else math.inf


def weight_distances(before_dir, a_dir, b_dir) -> tuple[float, float]:
    """-> (||B - A||, ||A - before||) over every weight, in float64, one tensor at a time."""
    sums = [0.0, 0.0]
    for file, keys in checkpoint_files(a_dir).items():
        name = os.path.basename(file)
        with safe_open(file, "pt") as fa, \
                safe_open(os.path.join(b_dir, name), "pt") as fb, \
                safe_open(os.path.join(before_dir, name), "pt") as f0:
            for key in keys or fa.keys():
                a = fa.get_tensor(key).double()
                sums[0] += float((fb.get_tensor(key).double() - a).square().sum())
                sums[1] += float((a - f0.get_tensor(key).double()).square().sum())
    return math.sqrt(sums[0]), math.sqrt(sums[1])


def print_speed(rows, n_seq, wall_s):
    print(f"\n{'step':>4} {'gen s':>7} {'gen tok/s':>10} {'train s':>8} {'train tok/s':>12} "
          f"{'resp len':>9}")
    for r in rows:
        gen_s, train_s = r["timing/gen_s"], r["timing/train_s"]
        gen_tokens = r["rollout/response_length/mean"] * n_seq  # generated tokens
        # prompt + response tokens through fwd + bwd
        train_tokens = r["perf/tokens_per_s"] * (gen_s + train_s)
        print(f"{r['step']:4d} {gen_s:7.1f} {gen_tokens / gen_s:10.0f} {train_s:8.1f} "
              f"{train_tokens / train_s:12.0f} {r['rollout/response_length/mean']:9.1f}")
    print(f"run A: {wall_s:.0f} s in all (start-up, {len(rows)} steps, their checkpoints)")


if __name__ == "__main__":
    main()
