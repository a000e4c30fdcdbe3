"""
The two rollout engines on bench_sampler.py's RL-shaped workload: 64 prompts x G = 8 samples at
temperature 1, up to 512 new tokens, 4 of the 512 token ids ending a response (lengths about
geometric, mean ~128, a long tail), on the same random demo-sized model (hidden 128, 2 layers,
head_dim 32). sampler.py with 64 slots (eager) against --rollout-engine vllm's engine
(infra/vllm_engine.py: vLLM in this process, fp32, eager). Useful tokens/s (response tokens up to
the EOS), wall time, best of --rounds after one warm-up each, on one thread each (torch's
threads, which vLLM's CPU worker otherwise resets, printed with the result).

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_vllm.py   # make test-vllm makes it

Without vLLM (`make bench` in .venv) it says it is skipped and exits 0.
"""
import argparse
import importlib.util
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from bench_sampler import (DEMO, RL_EOS, RL_G, RL_NEW, RL_PROMPTS, RL_SLOTS,  # noqa: E402
                           random_model, rl_sequences)
from config import Config  # noqa: E402
from sampler import generate  # noqa: E402


def best_rate(run, rounds: int) -> tuple[float, int]:
    """run() -> tokens; (the best tokens/s over rounds, after one warm-up call, its tokens)."""
    run()
    best = (0.0, 0)
    for _ in range(rounds):
        t0 = time.perf_counter()
        tokens = run()
        best = max(best, (tokens / (time.perf_counter() - t0), tokens))
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory", type=float, default=0.06,
                        help="--vllm-gpu-memory-utilization: on CPU, the share of RAM")
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print("bench_vllm: skipped, vLLM is not installed here (make test-vllm makes .venv-vllm)")
        return
    torch.set_num_threads(1)
    model = random_model(DEMO)  # bench_sampler's, random biases and norms included
    seqs = rl_sequences()

    threads = {}

    def sampler_run():
        threads["sampler.py, 64 slots"] = torch.get_num_threads()
        out = generate(model, seqs, RL_NEW, temperature=1.0, eos_token_ids=RL_EOS,
                       slots=RL_SLOTS, generator=torch.Generator().manual_seed(0))
        return int(out.lengths.sum())

    sampler = best_rate(sampler_run, args.rounds)
    from infra.vllm_engine import VLLMEngine
    cfg = Config(rollout_engine="vllm", vllm_gpu_memory_utilization=args.memory,
                 max_prompt_len=80, max_response_len=RL_NEW)
    engine = VLLMEngine(cfg, model)

    def vllm_run():
        threads["vLLM engine"] = torch.get_num_threads()
        got = engine.generate(model, seqs, RL_NEW, temperature=1.0, top_p=1.0, top_k=0,
                              eos_token_ids=RL_EOS, generator=torch.Generator().manual_seed(0))
        return sum(len(t) for t in got.token_ids)

    vllm = best_rate(vllm_run, args.rounds)
    engine.close()
    print(f"\nRL-shaped rollout: {RL_PROMPTS} prompts x G={RL_G}, temperature 1, up to {RL_NEW} "
          f"new tokens, demo-sized random model, best of {args.rounds}")
    for name, (rate, tokens) in (("sampler.py, 64 slots", sampler), ("vLLM engine", vllm)):
        print(f"  {name:<22} {rate:8.0f} tokens/s  ({tokens} response tokens, "
              f"{threads[name]} torch thread(s))")


if __name__ == "__main__":
    main()
