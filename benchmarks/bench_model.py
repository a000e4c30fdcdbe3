"""Forward+backward tokens/s of model.py's Qwen2 against transformers' Qwen2ForCausalLM, same
weights, same batch, CPU.

    .venv/bin/python -m benchmarks.bench_model [--hidden 256 --layers 4 --batch 8 --seq 256
                                                --iters 5]
"""
import argparse
import tempfile
import time

import torch

from benchmarks.common import timed_rounds
from model import Transformer, preset


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    import transformers

    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=args.vocab, hidden_size=args.hidden,
                 intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.hidden // 64, num_key_value_heads=2)
    ours = Transformer(cfg)
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        theirs = transformers.Qwen2ForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                               attn_implementation="sdpa")
    x = torch.randint(0, args.vocab, (args.batch, args.seq))

    def step_ours():
        ours.zero_grad(set_to_none=True)
        ours(x).logsumexp(-1).mean().backward()

    def step_theirs():
        theirs.zero_grad(set_to_none=True)
        theirs(x).logits.logsumexp(-1).mean().backward()

    with torch.no_grad():
        err = (ours(x) - theirs(x).logits).abs().max().item()
    n = args.batch * args.seq
    for step in (step_ours, step_theirs):
        step()  # warm-up: allocator, first-call dispatch
    # each step's fastest of interleaved repeats (wall time): on a shared machine other work only
    # ever slows a step down, so the minimum is the fair comparison
    timed = timed_rounds(args.iters, {"ours": step_ours, "theirs": step_theirs},
                         timer=time.perf_counter)
    t_ours, t_theirs = (min(seconds for seconds, _ in rounds) for rounds in timed.values())
    r_ours, r_theirs = n / t_ours, n / t_theirs
    print(f"model fwd+bwd  hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
          f"batch={args.batch}x{args.seq} threads={torch.get_num_threads()}  "
          f"max|logit diff|={err:.1e}")
    print(f"  ours {r_ours:9.0f} tok/s   transformers {r_theirs:9.0f} tok/s   "
          f"ratio {r_ours / r_theirs:.2f}x")


if __name__ == "__main__":
    main()
