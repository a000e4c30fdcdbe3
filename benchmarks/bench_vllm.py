"""
The two rollout engines side by side: sampler.py against --rollout-engine vllm's engine
(infra/vllm_engine.py: vLLM in this process, eager, whole-prompt prefill), on the same token ids,
one thread each, CPU time, the engines alternating round by round; useful tokens/s (response
tokens up to the EOS), min / median over the rounds.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m benchmarks.bench_vllm   # make test-vllm makes it
    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m benchmarks.bench_vllm --workload demo --rounds 3

Workloads (--workload):
- smollm2 (default): `make real`'s two rollouts on SmolLM2-135M-Instruct (converted by
  examples/smollm2.py; skipped, saying so, when absent), the sums of bench_real.py through the
  chat template: 8 prompts x G = 8 and the evaluation's 64 x 4, up to 32 new tokens at temperature
  1, <|im_end|> ending a response; the sampler in make real's 64 slots. --precisions fp32,bf16:
  bf16 is the sampler under bf16 autocast over fp32 weights (make real's) and vLLM's
  dtype=bfloat16.
- demo: bench_sampler.py's RL-shaped workload (64 prompts x G = 8, up to 512 new tokens, 4 of the
  512 ids ending a response: lengths about geometric, mean ~128) on its random demo-sized model
  (hidden 128, 2 layers, head_dim 32), the sampler in 64 slots; fp32.

vLLM's CPU worker sets torch's threads to the machine's cores unless OMP_NUM_THREADS says
otherwise; the threads each side ran with are printed. Without vLLM (`make bench` in .venv) it
says it is skipped and exits 0.
"""
import argparse
import importlib.util
import os
import statistics
import tempfile

import torch

from benchmarks.bench_sampler import (
    DEMO,
    RL_EOS,
    RL_G,
    RL_NEW,
    RL_PROMPTS,
    RL_SLOTS,
    random_model,
    rl_sequences,
)
from benchmarks.common import timed_rounds
from config import Config
from sampler import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Sides:
    """The sampler and a vLLM engine on one model, timed on the same prompts."""

    def __init__(self, model, precision: str, memory: float, max_prompt_len: int, new: int):
        from infra.vllm_engine import VLLMEngine
        self.model, self.precision, self.new, self.threads = model, precision, new, {}
        cfg = Config(rollout_engine="vllm", vllm_gpu_memory_utilization=memory,
                     precision=precision, max_prompt_len=max_prompt_len, max_response_len=new)
        self.engine = VLLMEngine(cfg, model)

    def sampler(self, prompts, eos, slots):
        self.threads["sampler.py"] = torch.get_num_threads()
        with torch.autocast("cpu", torch.bfloat16, enabled=self.precision == "bf16"):
            out = generate(self.model, prompts, self.new, temperature=1.0, eos_token_ids=eos,
                           slots=slots, generator=torch.Generator().manual_seed(0))
        return int(out.lengths.sum())

    def vllm(self, prompts, eos):
        self.threads["vLLM"] = torch.get_num_threads()
        got = self.engine.generate(self.model, prompts, self.new, temperature=1.0, top_p=1.0,
                                   top_k=0, eos_token_ids=eos,
                                   generator=torch.Generator().manual_seed(0))
        return sum(len(t) for t in got.token_ids)

    def compare(self, label: str, prompts, eos, slots, rounds: int):
        self.sampler(prompts, eos, slots)  # a warm-up each: vLLM's first generate is slow
        self.vllm(prompts, eos)
        timed = timed_rounds(rounds, {"sampler.py": lambda: self.sampler(prompts, eos, slots),
                                      "vLLM": lambda: self.vllm(prompts, eos)})
        rates = {name: [tokens / seconds for seconds, tokens in rows]
                 for name, rows in timed.items()}
        ratios = [v / s for s, v in zip(rates["sampler.py"], rates["vLLM"])]
        tokens = {name: rows[0][1] for name, rows in timed.items()}
        print(f"  {label}, {self.precision}: sampler.py {spread(rates['sampler.py'])} tok/s, "
              f"vLLM {spread(rates['vLLM'])} tok/s; vLLM / sampler.py {spread(ratios, '.2f')}x "
              f"(response tokens {tokens}, threads {self.threads})", flush=True)


def spread(values: list[float], fmt: str = ".0f") -> str:
    """min / median of the rounds."""
    return f"{min(values):{fmt}} / {statistics.median(values):{fmt}}"


def smollm2_part(args):
    from benchmarks import bench_real
    from examples import smollm2
    from examples import from_gguf
    from model import Transformer
    if not from_gguf.is_converted(smollm2.OUT):
        print(f"bench_vllm: skipped, no converted model in {smollm2.OUT} (make real, or "
              "python -m examples.smollm2, writes it)")
        return
    model = Transformer.from_pretrained(smollm2.OUT, dtype=torch.float32).eval()
    print(f"make real's rollouts on SmolLM2-135M-Instruct: up to {bench_real.NEW_TOKENS} new "
          f"tokens at temperature 1, the sampler in {bench_real.SLOTS} slots; CPU time, "
          f"{args.rounds} round(s), min / median")
    with tempfile.TemporaryDirectory() as tmp:
        shapes = {shape: bench_real.prompts_of(smollm2.OUT, tmp, *bench_real.SHAPES[shape])
                  for shape in args.shapes.split(",")}
        longest = max(len(p) for prompts, _ in shapes.values() for p in prompts)
        for precision in args.precisions.split(","):
            sides = Sides(model, precision, args.memory, longest, bench_real.NEW_TOKENS)
            for shape, (prompts, tok) in shapes.items():
                samples = bench_real.SHAPES[shape][1]
                sides.compare(f"{shape} ({len(prompts) // samples} prompts x {samples})",
                              prompts, tok.eos_token_ids, bench_real.SLOTS, args.rounds)
            sides.engine.close()


def demo_part(args):
    sides = Sides(random_model(DEMO), "fp32", args.memory, 80, RL_NEW)
    print(f"RL-shaped rollout: {RL_PROMPTS} prompts x G={RL_G}, temperature 1, up to {RL_NEW} "
          f"new tokens, demo-sized random model; CPU time, {args.rounds} round(s), min / median")
    sides.compare("demo", rl_sequences(), RL_EOS, RL_SLOTS, args.rounds)
    sides.engine.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("smollm2", "demo"), default="smollm2")
    parser.add_argument("--shapes", default="rl,eval", help="smollm2 (default: %(default)s)")
    parser.add_argument("--precisions", default="fp32,bf16", help="smollm2 (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--memory", type=float, default=0.1,
                        help="--vllm-gpu-memory-utilization: on CPU, the share of RAM")
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print("bench_vllm: skipped, vLLM is not installed here (make test-vllm makes .venv-vllm)")
        return
    torch.set_num_threads(1)
    (smollm2_part if args.workload == "smollm2" else demo_part)(args)


if __name__ == "__main__":
    main()
