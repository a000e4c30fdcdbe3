"""
The GPU check in one call: the four GPU scripts (the fused kernels and head against their
references, then speed and memory; the RL-shaped rollout, eager vs compiled vs transformers'
generate; FSDP2 on one process against the one-GPU path; a few DAPO steps of dapo.py) on one GPU,
each in its own subprocess, and one markdown report of what each printed, its exit status and its
time.

    python benchmarks/gpu_check.py [--out runs/gpu_check.md]    # one H100/H200, ~8 minutes
    python benchmarks/gpu_check.py --smoke                      # CPU, tiny shapes, seconds

The smoke run is the same code path (the same scripts, called the same way) with only the sizes
and the device changed, so that a GPU run does not fail on a typo; the CUDA-only parts (Triton,
CUDA graphs, GPU memory statistics) are skipped by the scripts themselves there, and the report
says it is a smoke run.
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, GPU arguments, smoke arguments, timeout s on the GPU): the timeouts add up to 10
# minutes, for a run sized to ~8 (not yet timed on a GPU)
CHECKS = [
    ("fused kernels and head: correctness, speed, memory (16k tokens)", "gpu_kernels.py",
     ["--rows", "16384"], ["--smoke"], 150),
    ("RL-shaped rollout, Qwen2.5-0.5B shape, bf16: eager / compiled / transformers",
     "gpu_sampler.py", [], ["--device", "cpu", "--preset", "tiny", "--prompts", "2",
                            "--max-new", "16", "--slots", "4", "--hf-batches", "1"], 210),
    ("FSDP2 on one process against one GPU's autocast and fp32: weights, log-probs, gradient, "
     "rollout", "gpu_fsdp.py", [], ["--device", "cpu", "--preset", "tiny", "--prompts", "2",
                                    "--group-size", "2", "--max-response-len", "8"], 90),
    ("3 DAPO steps of dapo.py, Qwen2.5-0.5B shape", "gpu_dapo.py",
     ["--steps", "3", "--prompts", "16", "--max-response-len", "512"],
     ["--device", "cpu", "--preset", "tiny", "--steps", "1", "--prompts", "2",
      "--group-size", "2", "--max-response-len", "8", "--micro-batch-size", "4"], 150),
]


def run_check(script, args, timeout_s):
    """-> (exit status, wall seconds, combined output); 124 for a timeout, as timeout(1)."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", script), *args]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() + (e.stderr or b"").decode()
        status, output = 124, output + f"\n(timed out after {timeout_s} s)"
    return status, time.perf_counter() - t0, output


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script runs")
    p.add_argument("--only", nargs="+", metavar="SCRIPT",
                   help="run only these scripts (e.g. gpu_dapo.py), as the smoke test does")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_check.md"))
    args = p.parse_args()
    mode = "CPU smoke run (tiny shapes; CUDA-only parts skipped)" if args.smoke else "GPU run"
    lines = [f"# GPU check: {mode}", ""]
    failed = []
    for name, script, gpu_args, smoke_args, timeout_s in CHECKS:
        if args.only and script not in args.only:
            lines += [f"## {name}", "", "skipped (--only)", ""]
            continue
        script_args = smoke_args if args.smoke else gpu_args
        # the smoke run's CPU compile (gpu_sampler.py) takes minutes on a loaded machine
        timeout_s *= 3 if args.smoke else 1
        status, wall_s, output = run_check(script, script_args, timeout_s)
        if status:
            failed.append(script)
        lines += [f"## {name}", "",
                  f"`python benchmarks/{script} {' '.join(script_args)}`: exit {status}, "
                  f"{wall_s:.0f} s", "", "```", output.strip()[-6000:], "```", ""]
        print(f"{script}: exit {status}, {wall_s:.0f} s", flush=True)
    lines.append(f"failed: {', '.join(failed)}" if failed else "all checks exited 0")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"report: {args.out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
