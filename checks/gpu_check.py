"""
The GPU check in one call: what a CPU cannot show of the GPU path, each part a script in its own
subprocess with a timeout, and one markdown report of what each printed, its exit status and its
time.

    python -m checks.gpu_check [--out runs/gpu_check.md]    # one H100/H200: ~7 min, <= 560 s
    python -m checks.gpu_check --smoke                      # CPU, tiny shapes, a few minutes
    python -m checks.gpu_check --smoke --only canary dapo   # some parts (names below)

The parts, in order (exit 1 if one fails):
    canary    the learning canary in bf16: after one update with a planted advantage, the
              sampler's log-probs move as the trainer's do (a rollout on stale weights fails)
    dapo      dapo.py in bf16 with real advantages (lengths and rewards that vary), then a resume
              that must redo the last step (weights, optimizer, RNG state round-trip)
    parity    a checkpoint that transformers wrote in bf16, loaded by model.py: the same logits
    sampler   the rollout engine: eager against compiled (CUDA graphs) by teacher-forced
              log-probs, then tokens/s against transformers' generate
    fsdp      FSDP2 in one process against the one-GPU path
    kernels   the fused log-prob kernels and head: correctness, speed, memory
    canary-2, dapo-2   the canary and dapo.py on 2 processes (FSDP2, NCCL): on a machine with 2
              GPUs or more, else reported as skipped
Each GPU part's timeout is about 1.4 x its estimate; the one-GPU parts' timeouts add up to 560 s
(9.3 minutes). The estimates are not measurements: no part has yet run on a GPU here (the
report gives each part's time: replace them with what it says).

The smoke run is the same code path (the same scripts, called the same way, the 2-process parts
on gloo) with only the sizes and the device changed, bf16 through CPU autocast where the script
takes --precision, so that a GPU run does not fail on a typo; the CUDA-only parts (Triton, CUDA
graphs, GPU memory statistics) are skipped by the scripts themselves there.
"""
import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN_2 = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
TINY = ("--device", "cpu", "--preset", "tiny")


@dataclass
class Check:
    name: str  # for --only
    title: str
    module: str  # of checks/: run as python -m checks.<module>
    gpu_args: tuple  # "{tmp}" is the run's scratch directory
    smoke_args: tuple
    estimate_s: int  # on one H100, guessed (see the report's times for measured ones)
    timeout_s: int  # on the GPU; the smoke run allows SMOKE_SLACK x this
    gpus: int = 1
    launcher: tuple = ()  # python's arguments before -m: torchrun's


DAPO_SMOKE = (*TINY, "--precision", "bf16", "--prompts", "4", "--group-size", "4",
              "--max-response-len", "16", "--micro-batch-tokens", "1024")
# the demo's shape: at Qwen2.5-0.5B's, one step at any --lr from 1e-6 to 1e-3 changes most greedy
# responses of the canary's random model, and it compares none (measured on CPU)
CANARY_GPU = ("--device", "cuda", "--precision", "bf16", "--preset", "demo")
CANARY_SMOKE = ("--device", "cpu", "--precision", "bf16", "--preset", "tiny")
# Estimates for one H100, not measurements (no GPU here), from: ~10 s to start a process (torch, a
# CUDA context); canary: a demo-sized model, 2 greedy rollouts of 12 tokens, one update; dapo: a
# 0.5B model written (2 GB), 2 + 1 steps of 64 responses <= 256 tokens (~256 eager decode steps at
# ~20 ms: 24 layers of kernels launched from Python) and 3 checkpoints of 6 GB each (fp32 weights,
# AdamW's moments); parity: transformers' random 0.5B init on CPU, 4 loads, 4 forwards; sampler:
# the 24-layer decode step's compile (~60 s, the least known), then ~600 eager and ~600 graphed
# decode steps, 512 lockstep ones and 512 of transformers' generate; fsdp: its own ~1 minute;
# kernels: Triton JIT, 2 torch.compile and do_bench over 5 GB of logits
CHECKS = [
    Check("canary", "learning canary, bf16, one process", "canary",
          (*CANARY_GPU, "--dir", "{tmp}/canary"), (*CANARY_SMOKE, "--dir", "{tmp}/canary"),
          20, 35),
    Check("dapo", "dapo.py in bf16, 2 steps with real advantages, then a resume of the second",
          "gpu_dapo", (), DAPO_SMOKE, 100, 140),
    Check("parity", "a transformers-made bf16 checkpoint: logits against transformers'",
          "gpu_parity", (), TINY, 30, 45),
    Check("sampler", "rollout engine: eager vs compiled (teacher-forced), tokens/s vs transformers",
          "gpu_sampler", ("--prompts", "32", "--max-new", "512", "--hf-batches", "1"),
          (*TINY, "--prompts", "2", "--max-new", "16", "--slots", "4", "--hf-batches", "1"),
          120, 160),
    Check("fsdp", "FSDP2 on one process against the one-GPU path", "gpu_fsdp", (),
          (*TINY, "--prompts", "2", "--group-size", "2", "--max-response-len", "8"), 45, 70),
    Check("kernels", "fused kernels and head: correctness, speed, memory (16k tokens)",
          "gpu_kernels", ("--rows", "16384", "--block-v", "4096", "8192"), ("--smoke",),
          80, 110),
    Check("canary-2", "learning canary, bf16, 2 processes (FSDP2)", "canary",
          (*CANARY_GPU, "--dir", "{tmp}/canary-2"), (*CANARY_SMOKE, "--dir", "{tmp}/canary-2"),
          45, 70, gpus=2, launcher=TORCHRUN_2),
    Check("dapo-2", "dapo.py in bf16 on 2 processes (FSDP2), then a resume", "gpu_dapo",
          ("--nproc", "2"), (*DAPO_SMOKE, "--nproc", "2"), 120, 160, gpus=2),
]
SMOKE_SLACK = 3  # a CPU compile (the sampler) takes minutes on a loaded machine


def run_check(command, timeout_s) -> tuple[int, float, str]:
    """-> (exit status, wall seconds, combined output); 124 for a timeout, as timeout(1). A part
    runs in a process group of its own: at its timeout the whole group gets SIGTERM (torchrun
    then stops its workers, which run in sessions of their own), and SIGKILL 15 s later, so that
    no orphan keeps a GPU busy during the next part."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, status = proc.communicate(timeout=timeout_s)[0], proc.returncode
    except subprocess.TimeoutExpired:
        output = stop(proc) + f"\n(timed out after {timeout_s} s)"
        status = 124
    return status, time.perf_counter() - t0, as_seen(output)


def stop(proc) -> str:
    """SIGTERM, then SIGKILL, to proc's process group -> what it printed (up to then: a worker
    that outlived its torchrun would hold the pipe open)."""
    output = ""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone
            pass
        try:
            return proc.communicate(timeout=15)[0] or ""
        except subprocess.TimeoutExpired as e:
            output = e.output or ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def as_seen(output: str) -> str:
    """What a terminal shows of each line: the last of its carriage-return rewrites (tqdm's)."""
    return "\n".join(line.split("\r")[-1] for line in output.split("\n"))


def machine() -> str:
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        where = f"{torch.cuda.device_count()} x {', '.join(sorted(names))}, CUDA " \
                f"{torch.version.cuda}"
    else:
        where = f"no GPU, {platform.processor() or platform.machine()}"
    return f"{where}; torch {torch.__version__}, Python {platform.python_version()}"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the scripts run")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=[c.name for c in CHECKS],
                   help="run only these parts (e.g. canary dapo), as the smoke test does")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_check.md"))
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA GPU (none found); --smoke runs it on CPU")
    gpus = torch.cuda.device_count()
    mode = "CPU smoke run (tiny shapes; CUDA-only parts skipped)" if args.smoke else "GPU run"
    summary, sections, failed = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for check in CHECKS:
            if args.only and check.name not in args.only:
                summary.append((check, "skipped (--only)", None, None))
                continue
            if not args.smoke and check.gpus > gpus:
                summary.append((check, f"skipped: needs {check.gpus} GPUs, this machine has "
                                       f"{gpus}", None, None))
                continue
            script_args = [a.replace("{tmp}", tmp)
                           for a in (check.smoke_args if args.smoke else check.gpu_args)]
            command = [sys.executable, *check.launcher,
                       "-m", f"checks.{check.module}", *script_args]
            timeout_s = check.timeout_s * (SMOKE_SLACK if args.smoke else 1)
            status, wall_s, output = run_check(command, timeout_s)
            result = "ok" if status == 0 else "TIMED OUT" if status == 124 else \
                f"FAILED (exit {status})"
            if status:
                failed.append(check.name)
            summary.append((check, result, wall_s, timeout_s))
            shown = " ".join(["python", *command[1:]]).replace(tmp, "$TMP")
            sections += [f"## {check.name}: {check.title}", "", f"`{shown}`: {result}, "
                         f"{wall_s:.0f} s (timeout {timeout_s} s)", "", "```",
                         output.strip()[-6000:], "```", ""]
            print(f"{check.name}: {result}, {wall_s:.0f} s", flush=True)
    lines = [f"# GPU check: {mode}", "", f"Machine: {machine()}.", "",
             "| part | result | seconds | timeout s | estimate s (one H100, not measured) |",
             "| --- | --- | --- | --- | --- |"]
    for check, result, wall_s, timeout_s in summary:
        seconds, timeout = ("", "") if wall_s is None else (f"{wall_s:.0f}", str(timeout_s))
        lines.append(f"| {check.name} | {result} | {seconds} | {timeout} | "
                     f"{check.estimate_s} |")
    lines += ["", *sections,
              f"failed: {', '.join(failed)}" if failed else "all parts that ran passed"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"report: {args.out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
