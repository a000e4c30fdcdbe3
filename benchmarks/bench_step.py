"""
The whole RL step, this project against TRL's GRPOTrainer: the same base model, prompts, reward,
G, lengths and batch, on CPU, one thread by default, timed in CPU time.

    make bench-step                                   # creates .venv-bench/ (TRL) once, runs this
    .venv-bench/bin/python -m benchmarks.bench_step   # 1 warm-up, 5 timed rounds, 1 profiled step
    .venv-bench/bin/python -m benchmarks.bench_step --slots 128 --micro-batch-tokens 0 --no-profile
    .venv-bench/bin/python -m benchmarks.bench_step --workload smollm2 --precision bf16 --rounds 3

Two workloads (--workload): "demo" (below) and "smollm2", `make real`'s step on
SmolLM2-135M-Instruct (converted by examples/smollm2.py; skipped, saying so, when absent): 8 sums
x G = 8 responses of up to 32 tokens, the sums verifier (examples/sums.py) plus the overlong
penalty (8-token buffer), lr 1e-5 and the rest of experiments/real.py's settings, one optimizer
step a rollout and dynamic sampling off; ours is dapo.py with those flags, and again with
--micro-batch-tokens 0 (micro-batches of 64 rows: whole groups); TRL's micro-batches 16 rows.
--precision bf16: bf16 autocast over fp32 weights on both sides (TRL's bf16=True; `make real`'s
precision). The demo workload is fp32 only.

What a step is, on both sides: one rollout and one optimizer step. 32 toy prompts x G = 8
responses of up to 40 tokens at temperature 1; each scored by math_dapo (reward.verify_built_in)
plus DAPO's overlong penalty (reward.overlong_penalty, 16-token buffer); group advantages; the
clipped token-level loss (eps 0.2 / 0.28, no KL) over all 256 responses, in micro-batches (below);
one AdamW step (lr 1e-6, grad-norm clip 1). The base model is the embedded demo's (toy.py: a tiny
Qwen2 warmed up on the toy task, so responses end with an EOS at varied lengths and the rewards are
mixed; trained once, then cached in runs/demo-base), saved as one Hugging Face directory with the
toy tokenizer, which both sides load.

- ours: dapo.collect_batch (sampler.generate: continuous batching over KV-cache slots),
  group_advantages and update_policy, called directly, three ways, each on its own copy of the
  model: "defaults" with dapo.py's flags (--rollout-slots 512, so all 256 sequences at once,
  and micro-batches of 64 rows); "eager" and "compiled" (the torch.compile'd decode step) with
  --slots 64 and micro-batches by a budget of 1024 padded tokens (dapo.py's --micro-batch-tokens),
  the best measured here ("compiled" also trains with compiled decoder blocks, as dapo.py
  --compile does). Dynamic sampling is off: TRL has none, and a step must be one rollout.
- TRL: GRPOTrainer(loss_type="dapo", beta=0, epsilon=0.2, epsilon_high=0.28), generating with
  transformers' generate (no vLLM). per_device_train_batch_size 64 x gradient_accumulation_steps 4,
  with steps_per_generation 4: one generation of 256 completions per optimizer step, and no
  separate pi_old forward (TRL skips it when the two line up, as dapo.update_policy does with one
  step). Activation checkpointing and bf16, on by default in TRL's configs, are off here.

The sides alternate inside one process: a TrainerCallback times TRL's step from on_step_begin
to on_step_end (its rollout runs in between, inside _prepare_inputs) and then, at on_step_end,
runs our three steps on the same 32 prompts. Each side samples its own responses, so
the lengths differ by chance: the table gives seconds per generated token (EOS included) too.
Phases: generate = sampler.generate / TRL's _generate_single_turn (transformers' generate);
reward = the verifier; rollout other = the rest of the rollout (decoding text, padding,
advantages); update = forward, backward and the optimizer step. The profiled step (an extra one,
under torch.profiler, not in the table) lists each side's top torch ops by self CPU time.

TRL is no dependency of the project: requirements-bench.txt installs it into .venv-bench/. With the
project's own venv (`make bench`) this script says it is skipped and exits 0.
"""
import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import warnings
from dataclasses import dataclass, replace
from typing import Callable

import torch

import dapo
import sampler
from benchmarks.common import FixedRows, clock
from config import Config, parse_args
from data import load_rows, load_tokenizer
from examples import smollm2, sums
from experiments import real
from examples import from_gguf
from launch import load_verifier
from model import Transformer
from reward import overlong_penalty, verify_built_in
from toy import demo_base_model, make_toy_tokenizer, toy_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRL = "TRL"
PHASES = ("generate", "reward", "rollout other", "update")


@dataclass
class Workload:
    """What both sides train on, and our sides' flags."""
    base: str  # a Hugging Face directory: the base model and its tokenizer
    rows: list[dict]  # dapo.py rows, in the order TRL takes them: step i, chunk i
    prompts: int  # per step
    group: int  # G
    cfg: Config  # ours (the first side's flags); its lengths, lr and weight decay are TRL's too
    sides: dict  # our side's name -> its flags over cfg
    score: Callable  # (response text, ground truth, data_source) -> the correctness reward
    trl_micro_batch: int  # TRL's per_device_train_batch_size
    micro: str  # our micro-batches, in words

    def chunks(self, n_steps: int) -> list[list[dict]]:
        return [self.rows[i * self.prompts:(i + 1) * self.prompts] for i in range(n_steps)]


class Phases:
    """Seconds spent inside wrapped functions, per phase, since the last reset()."""

    def __init__(self):
        self.spent, self.depth = dict.fromkeys(PHASES, 0.0), 0

    def wrap(self, phase, fn):
        def timed(*args, **kwargs):
            self.depth += 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:  # a wrapped call inside another counts once, in the outer one
                    self.spent[phase] += clock() - t0
        return timed

    def rollout_other(self, fn):
        """fn is a whole rollout: what it spends outside generate and reward is "rollout other"."""
        def timed(*args, **kwargs):
            t0, inner = clock(), self.spent["generate"] + self.spent["reward"]
            out = fn(*args, **kwargs)
            inner = self.spent["generate"] + self.spent["reward"] - inner
            self.spent["rollout other"] += clock() - t0 - inner
            return out
        return timed

    def reset(self):
        self.spent = dict.fromkeys(PHASES, 0.0)


def base_model_dir(root):
    """The demo's base model and the toy tokenizer in one Hugging Face directory."""
    out = os.path.join(root, "base")
    tok = make_toy_tokenizer(os.path.join(root, "tokenizer"))
    demo_base_model(tok).save_pretrained(out)  # trained once, later loaded from runs/demo-base
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(root, "tokenizer", name), out)
    return out


class OurSide:
    """A copy of the policy with its optimizer, stepped by dapo.py's own functions."""

    def __init__(self, work: Workload, phases, **flags):
        self.cfg = replace(work.cfg, **flags)
        self.model = Transformer.from_pretrained(work.base, dtype=torch.float32)
        if self.cfg.compile:  # as launch.load_policy does
            self.model.compile_blocks()
        self.tok = load_tokenizer(work.base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, betas=(0.9, 0.999),
                                     weight_decay=self.cfg.weight_decay)
        self.generator = torch.Generator().manual_seed(0)
        self.phases = phases
        self.verifier = load_verifier(self.cfg)  # its scoring is the "reward" phase
        self.verifier.verify_rollout = phases.wrap("reward", self.verifier.verify_rollout)

    def step(self, rows):
        """One rollout and one optimizer step on these prompts -> response tokens generated."""
        cfg = self.cfg
        batch, _ = self.phases.rollout_other(self.rollout)(rows)
        t0 = clock()
        dapo.update_policy(self.model, self.opt, batch, cfg)
        self.phases.spent["update"] += clock() - t0
        return int(batch.response_mask.sum())

    def rollout(self, rows):
        collected = dapo.collect_batch(self.model, FixedRows(rows), self.tok, self.cfg,
                                       self.verifier, self.generator)
        return collected.to_train, collected.metrics  # its advantages computed


def math_dapo_score(text: str, truth: str, source: str) -> float:
    return verify_built_in(source, text, truth)["score"]


def sums_score(text: str, truth: str, source: str) -> float:
    return sums.score(text, truth)["score"]


def demo_workload(root, args) -> Workload:
    """32 toy prompts x G = 8, math_dapo: ours three ways (the module docstring)."""
    prompts, G, max_len, micro = 32, 8, 40, 64
    cfg = Config(train_prompts=prompts, gen_prompts=prompts, group_size=G,
                 dynamic_sampling=False, max_response_len=max_len, overlong_buffer=16,
                 mini_batch_prompts=prompts, micro_batch_size=micro, lr=1e-6, device="cpu")
    tuned = dict(rollout_slots=args.slots, micro_batch_tokens=args.micro_batch_tokens)
    n_steps = args.warmup + args.rounds + args.profile
    budget = args.micro_batch_tokens
    micro_words = f"{budget} tokens" if budget else f"{micro} rows"
    return Workload(
        base=base_model_dir(root), rows=toy_rows(prompts * n_steps, seed=0), prompts=prompts,
        group=G, cfg=cfg, score=math_dapo_score, trl_micro_batch=args.trl_micro_batch or micro,
        # dapo.py's own flags: --rollout-slots 512 (so 256 slots here), 64-row micro-batches
        sides={"ours, defaults": {}, "ours, eager": tuned,
               "ours, compiled": dict(tuned, compile=True)},
        micro=(f"ours, defaults: dapo.py's flags ({prompts * G} slots, micro-batches of {micro} "
               f"rows); ours, eager/compiled: {args.slots} slots, micro-batches of {micro_words}"))


def smollm2_workload(root, args) -> Workload | None:
    """make real's step on SmolLM2-135M-Instruct (None when the converted model is absent)."""
    if not from_gguf.is_converted(smollm2.OUT):
        return None
    train, val = sums.write_task(root)
    cfg = parse_args(real.dapo_argv(smollm2.OUT, real.Task(train, val), root, seed=0))
    # one optimizer step a rollout, one generation batch a step: TRL's step
    cfg = replace(cfg, device="cpu", dynamic_sampling=False, precision=args.precision,
                  gen_prompts=cfg.train_prompts, mini_batch_prompts=cfg.train_prompts)
    verifier = load_verifier(cfg)
    rows = load_rows(train, load_tokenizer(smollm2.OUT), rewarded=verifier.rewards)
    n_steps = args.warmup + args.rounds + args.profile
    if len(rows) < cfg.train_prompts * n_steps:
        raise SystemExit(f"bench_step: {len(rows)} training sums hold fewer than {n_steps} steps")
    micro = (f"{cfg.micro_batch_tokens} tokens" if cfg.micro_batch_tokens
             else f"{cfg.micro_batch_size} rows")
    return Workload(
        base=smollm2.OUT, rows=rows, prompts=cfg.train_prompts, group=cfg.group_size, cfg=cfg,
        score=sums_score,
        trl_micro_batch=args.trl_micro_batch or 16,
        # the second side's micro-batch is the whole mini-batch: its groups stay whole, so each
        # prompt goes through the update's forward once (logprobs.shared_prompt_logprobs)
        sides={"ours": {}, "ours, 64 rows": dict(micro_batch_tokens=0)},
        micro=(f"ours: make real's flags ({cfg.rollout_slots} slots, micro-batches of {micro}, "
               f"length-sorted); ours, 64 rows: micro-batches of {cfg.micro_batch_size} rows"))


def trl_trainer(work: Workload, max_steps, out_dir, phases, tokens):
    """GRPOTrainer on the workload's rows in order, G x its prompts per step; appends each step's
    generated tokens to `tokens`."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer
    cfg = work.cfg

    def reward(completions, completion_ids, reward_model, data_source, **_):
        """The verifier both sides use, plus the overlong penalty of dapo.shape_rewards."""
        tokens.append(sum(len(ids) for ids in completion_ids))  # EOS included, as ours
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [work.score(text, rm["ground_truth"], source)
                + overlong_penalty(len(ids), cfg.max_response_len, cfg.overlong_buffer)
                for text, ids, rm, source in zip(texts, completion_ids, reward_model, data_source)]

    steps_per_generation = work.prompts * work.group // work.trl_micro_batch
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=cfg.precision == "bf16", fp16=False,
        activation_checkpointing=False, loss_type="dapo", beta=0.0, epsilon=cfg.eps_low,
        epsilon_high=cfg.eps_high, num_generations=work.group,
        per_device_train_batch_size=work.trl_micro_batch,
        gradient_accumulation_steps=steps_per_generation,
        steps_per_generation=steps_per_generation, num_iterations=1,
        max_completion_length=cfg.max_response_len, temperature=1.0, top_p=1.0, top_k=0,
        use_vllm=False, learning_rate=cfg.lr, lr_scheduler_type="constant",
        weight_decay=cfg.weight_decay, adam_beta1=0.9, adam_beta2=0.999,
        max_grad_norm=cfg.grad_clip, max_steps=max_steps, shuffle_dataset=False,
        report_to="none", save_strategy="no", logging_steps=10**6, disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(work.base, dtype=torch.float32),
        reward_funcs=reward, args=args, train_dataset=datasets.Dataset.from_list(work.rows),
        processing_class=transformers.AutoTokenizer.from_pretrained(work.base))
    assert not trainer.args.gradient_checkpointing, "TRL would recompute activations"
    trainer.remove_callback(transformers.PrinterCallback)  # its end-of-training metrics line
    # TRL's phases, by the methods it calls on itself
    trainer._generate_single_turn = phases.wrap("generate", trainer._generate_single_turn)
    trainer._calculate_rewards = phases.wrap("reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = phases.rollout_other(
        trainer._generate_and_score_completions)
    return trainer


def profiler():
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def top_ops(prof, n):
    """-> ([(op, seconds, share)] for the n ops with the most self CPU time, total seconds)."""
    events = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                    key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [(e.key, e.self_cpu_time_total / 1e6, e.self_cpu_time_total / total)
            for e in events[:n]], total / 1e6


class Record:
    """Per side: (seconds, tokens, {phase: seconds}) of each timed round, and the profile."""

    def __init__(self, args, sides):
        self.args, self.rounds, self.profiles = args, {n: [] for n in (*sides, TRL)}, {}

    def timed(self, step):
        return self.args.warmup <= step < self.args.warmup + self.args.rounds

    def profiled(self, step):
        return self.args.profile and step == self.args.warmup + self.args.rounds

    def add(self, name, step, seconds, tokens, spent, prof):
        if prof:
            self.profiles[name] = top_ops(prof, self.args.top)
        elif self.timed(step):
            self.rounds[name].append((seconds, tokens, spent))
        what = "profiled" if prof else "timed" if self.timed(step) else "warm-up"
        print(f"step {step} ({what}): {name:<15} {seconds:6.2f} s  {tokens:5d} tokens", flush=True)


def alternating_callback(record, ours, chunks, phases, tokens):
    """A TrainerCallback that times each TRL step, then runs our sides on the same prompts."""
    import transformers

    class Alternate(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.prof = profiler() if record.profiled(state.global_step) else None
            if self.prof:
                self.prof.__enter__()
            phases.reset()
            self.t0 = clock()

        def on_step_end(self, args, state, control, **kwargs):
            seconds, step = clock() - self.t0, state.global_step - 1
            if self.prof:
                self.prof.__exit__(None, None, None)
            spent = dict(phases.spent)  # the update is what the rollout leaves of the step
            spent["update"] = seconds - sum(spent[p] for p in PHASES[:3])
            record.add(TRL, step, seconds, tokens[-1], spent, self.prof)
            for name, side in ours.items():
                phases.reset()
                prof = profiler() if record.profiled(step) else None
                t0 = clock()
                with prof or contextlib.nullcontext():
                    n = side.step(chunks[step])
                record.add(name, step, clock() - t0, n, dict(phases.spent), prof)

    return Alternate()


def report(record, work: Workload):
    args = record.args
    print(f"\nthe whole step, {args.workload}, {work.cfg.precision}, median of {args.rounds} "
          f"rounds (min in brackets), CPU seconds\n{work.micro}; TRL: micro-batches of "
          f"{work.trl_micro_batch} rows")
    print(f"{'':>15} {'s/step (min)':>15} {'tokens':>7} {'ms/token':>8} {'TRL/this':>12} | "
          + " ".join(f"{p:>13}" for p in PHASES))
    med = {}
    for name, rounds in record.rounds.items():
        med[name] = (statistics.median(r[0] for r in rounds),
                     statistics.median(r[1] for r in rounds),
                     statistics.median(r[0] / r[1] for r in rounds),
                     {p: statistics.median(r[2][p] for r in rounds) for p in PHASES})
    for name, (seconds, tokens, per_token, spent) in med.items():
        ratios = f"{med[TRL][0] / seconds:.2f}x/{med[TRL][2] / per_token:.2f}x"
        seconds_min = min(r[0] for r in record.rounds[name])
        print(f"{name:>15} {seconds:7.2f} ({seconds_min:.2f}) {tokens:7.0f} {1e3 * per_token:8.3f} "
              f"{ratios:>12} | " + " ".join(f"{spent[p]:13.3f}" for p in PHASES))
    print("TRL/this: TRL's seconds per step over this side's / the same per generated token; "
          "phases: medians")
    for name, (ops, total) in record.profiles.items():
        print(f"\nprofile, {name}: one step, {total:.2f} s of torch ops (profiler overhead "
              f"included); the top {len(ops)} by self CPU time")
        for key, seconds, share in ops:
            print(f"  {key[:56]:<56} {seconds:7.3f} s {100 * share:5.1f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--workload", choices=("demo", "smollm2"), default="demo",
                    help="the demo's toy step, or make real's (default: %(default)s)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="smollm2: both sides' (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, the same on every side")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, each side once (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (compile, set-up)")
    # measured best on this CPU for the toy shape (64 of 32/64/128/256 slots, 1024 of 512-4096)
    ap.add_argument("--slots", type=int, default=64,
                    help="demo, ours eager/compiled: KV-cache slots (dapo.py's --rollout-slots)")
    ap.add_argument("--micro-batch-tokens", type=int, default=1024,
                    help="demo, ours eager/compiled: micro-batches by token budget (0: 64 rows)")
    ap.add_argument("--trl-micro-batch", type=int, default=0,
                    help="TRL: per_device_train_batch_size, dividing the rows of a step "
                         "(default: 64 demo, 16 smollm2)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="one more step per side under torch.profiler, outside the table")
    ap.add_argument("--top", type=int, default=12, help="ops listed per side in the profile")
    args = ap.parse_args()
    if args.workload == "demo" and args.precision != "fp32":
        ap.error("--precision bf16 is for --workload smollm2")
    try:
        import trl
    except ImportError:
        print("bench_step: skipped, trl is not installed here (it is no dependency of the "
              "project); `make bench-step` runs this in .venv-bench/")
        return
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # TRL 1.16 still reads transformers 5's deprecated gradient_checkpointing names
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl "
          f"{trl.__version__}, {torch.get_num_threads()} thread(s), "
          f"{'CPU' if args.threads == 1 else 'wall'} time, load average {os.getloadavg()[0]:.1f}",
          flush=True)

    n_steps = args.warmup + args.rounds + args.profile
    phases, tokens = Phases(), []
    # the sampler, under the name Engine.generate calls, wrapped to count the phase (OurSide
    # wraps the verifier)
    sampler.generate = phases.wrap("generate", sampler.generate)
    with tempfile.TemporaryDirectory() as root:
        work = (demo_workload if args.workload == "demo" else smollm2_workload)(root, args)
        if work is None:
            print(f"bench_step: skipped, no converted model in {smollm2.OUT} (make real, or "
                  "python -m examples.smollm2, writes it)")
            return
        record = Record(args, work.sides)
        ours = {name: OurSide(work, phases, **flags) for name, flags in work.sides.items()}
        trainer = trl_trainer(work, n_steps, os.path.join(root, "trl"), phases, tokens)
        torch.set_num_threads(args.threads)  # whatever the trainer's set-up did
        trainer.add_callback(alternating_callback(record, ours, work.chunks(n_steps), phases,
                                                  tokens))
        trainer.train()
    report(record, work)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
