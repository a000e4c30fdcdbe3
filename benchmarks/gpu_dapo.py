"""
GPU check: a few DAPO steps of a random Qwen2.5-0.5B-shaped model (bf16 compute, fp32 master
weights) on one GPU, printing generation tokens/s, training tokens/s and peak memory. Not part of
`make bench` (no GPU there).

    python benchmarks/gpu_dapo.py [--steps 3 --prompts 64 --group-size 8 --max-response-len 1024]

A random model never says "Answer:", so every group is all-wrong: dynamic sampling is off here (it
would filter the whole batch), and every response runs to --max-response-len, which makes the token
counts exact.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dapo  # noqa: E402
from toy import make_toy_tokenizer  # noqa: E402
from model import Qwen2, num_params, preset  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda",
                   help="cpu runs the same script as a smoke test (--preset tiny)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_dapo.py needs a CUDA GPU (none found); the CPU demo is `make run`")
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        model_dir = os.path.join(d, "model")
        model = Qwen2(preset(args.preset))
        where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"{args.preset}: {num_params(model) / 1e6:.0f}M parameters on {where}")
        model.save_pretrained(model_dir)
        del model
        make_toy_tokenizer(model_dir)
        cfg = dapo.Config(model=model_dir, out_dir=os.path.join(d, "run"), device=args.device,
                          steps=args.steps, train_prompts=args.prompts, gen_prompts=args.prompts,
                          group_size=args.group_size, mini_batch_prompts=args.prompts,
                          micro_batch_size=args.micro_batch_size,
                          max_response_len=args.max_response_len,
                          overlong_buffer=args.max_response_len // 4, dynamic_sampling=False,
                          eval_every=0, lr=1e-6, warmup_steps=1)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        dapo.main(cfg)
        wall = time.time() - t0
        rows = [json.loads(line) for line in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]
    n_seq = args.prompts * args.group_size
    print(f"{'step':>4} {'gen s':>7} {'gen tok/s':>10} {'train s':>8} {'train tok/s':>12} "
          f"{'resp len':>9}")
    for r in rows:
        gen_s, train_s = r["timing/gen_s"], r["timing/train_s"]
        gen_tokens = r["response_length/mean"] * n_seq  # generated tokens
        # prompt + response tokens through fwd + bwd
        train_tokens = r["perf/tokens_per_s"] * (gen_s + train_s)
        print(f"{r['step']:4d} {gen_s:7.1f} {gen_tokens / gen_s:10.0f} {train_s:8.1f} "
              f"{train_tokens / train_s:12.0f} {r['response_length/mean']:9.0f}")
    peak = (f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; "
            if args.device == "cuda" else "")
    print(f"{peak}wall {wall:.0f}s for {args.steps} steps (the first step includes start-up)")


if __name__ == "__main__":
    main()
