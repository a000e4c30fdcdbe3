"""
The whole RL step, this project against TRL's GRPOTrainer: the same base model, prompts, reward,
G, lengths and batch, on CPU in fp32, one thread by default, timed in CPU time.

    make bench-step                                   # creates .venv-bench/ (TRL) once, runs this
    .venv-bench/bin/python benchmarks/bench_step.py   # 1 warm-up, 5 timed rounds, 1 profiled step
    .venv-bench/bin/python benchmarks/bench_step.py --slots 128 --micro-batch-tokens 0 --no-profile

What a step is, on both sides: one rollout and one optimizer step. 32 toy prompts x G = 8
responses of up to 40 tokens at temperature 1; each scored by math_dapo (reward.score_response)
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
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dapo  # noqa: E402
from common import FixedRows, clock  # noqa: E402
from config import Config  # noqa: E402
from data import load_tokenizer  # noqa: E402
from model import Qwen2  # noqa: E402
from reward import Verifier, overlong_penalty, score_response  # noqa: E402
from toy import demo_base_model, make_toy_tokenizer, toy_rows  # noqa: E402

PROMPTS, G, MAX_LEN, BUFFER, MICRO, LR = 32, 8, 40, 16, 64, 1e-6
OURS, TRL = ("ours, defaults", "ours, eager", "ours, compiled"), "TRL"
PHASES = ("generate", "reward", "rollout other", "update")


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

    def __init__(self, base, phases, **flags):
        self.cfg = Config(train_prompts=PROMPTS, gen_prompts=PROMPTS, group_size=G,
                          dynamic_sampling=False, max_response_len=MAX_LEN,
                          overlong_buffer=BUFFER, mini_batch_prompts=PROMPTS,
                          micro_batch_size=MICRO, lr=LR, device="cpu", **flags)
        self.model = Qwen2.from_pretrained(base, dtype=torch.float32)
        if self.cfg.compile:  # as launch.load_policy does
            self.model.compile_blocks()
        self.tok = load_tokenizer(base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.999),
                                     weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(0)
        self.phases = phases
        self.verifier = Verifier()  # math_dapo; its scoring is the "reward" phase
        self.verifier.score_responses = phases.wrap("reward", self.verifier.score_responses)

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


def trl_trainer(base, rows, max_steps, micro, out_dir, phases, tokens):
    """GRPOTrainer on `rows` in order, G x 32 prompts per step; appends each step's generated
    tokens to `tokens`."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    def math_dapo(completions, completion_ids, reward_model, data_source, **_):
        """The verifier both sides use, plus the overlong penalty of dapo.shape_rewards."""
        tokens.append(sum(len(ids) for ids in completion_ids))  # EOS included, as ours
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score_response(src, text, rm["ground_truth"])["score"]
                + overlong_penalty(len(ids), MAX_LEN, BUFFER)
                for text, ids, rm, src in zip(texts, completion_ids, reward_model, data_source)]

    steps_per_generation = PROMPTS * G // micro
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, activation_checkpointing=False,
        loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, num_generations=G,
        per_device_train_batch_size=micro, gradient_accumulation_steps=steps_per_generation,
        steps_per_generation=steps_per_generation, num_iterations=1,
        max_completion_length=MAX_LEN, temperature=1.0, top_p=1.0, top_k=0, use_vllm=False,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, max_grad_norm=1.0, max_steps=max_steps, shuffle_dataset=False,
        report_to="none", save_strategy="no", logging_steps=10**6, disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(
        model=transformers.Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32),
        reward_funcs=math_dapo, args=args, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=transformers.AutoTokenizer.from_pretrained(base))
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

    def __init__(self, args):
        self.args, self.rounds, self.profiles = args, {n: [] for n in (*OURS, TRL)}, {}

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


def report(record):
    args = record.args
    micro = f"{args.micro_batch_tokens} tokens" if args.micro_batch_tokens else f"{MICRO} rows"
    print(f"\nthe whole step, median of {args.rounds} rounds, CPU seconds\n"
          f"ours, defaults: dapo.py's flags ({PROMPTS * G} slots, micro-batches of {MICRO} rows); "
          f"ours, eager/compiled: {args.slots} slots, micro-batches of {micro}; TRL: micro-batches "
          f"of {args.trl_micro_batch} rows")
    print(f"{'':>15} {'s/step':>7} {'tokens':>7} {'ms/token':>8} {'TRL/this':>12} | "
          + " ".join(f"{p:>13}" for p in PHASES))
    med = {}
    for name, rounds in record.rounds.items():
        med[name] = (statistics.median(r[0] for r in rounds),
                     statistics.median(r[1] for r in rounds),
                     statistics.median(r[0] / r[1] for r in rounds),
                     {p: statistics.median(r[2][p] for r in rounds) for p in PHASES})
    for name, (seconds, tokens, per_token, spent) in med.items():
        ratios = f"{med[TRL][0] / seconds:.2f}x/{med[TRL][2] / per_token:.2f}x"
        print(f"{name:>15} {seconds:7.2f} {tokens:7.0f} {1e3 * per_token:8.3f} {ratios:>12} | "
              + " ".join(f"{spent[p]:13.3f}" for p in PHASES))
    print("TRL/this: TRL's seconds per step over this side's / the same per generated token; "
          "phases: medians")
    for name, (ops, total) in record.profiles.items():
        print(f"\nprofile, {name}: one step, {total:.2f} s of torch ops (profiler overhead "
              f"included); the top {len(ops)} by self CPU time")
        for key, seconds, share in ops:
            print(f"  {key[:56]:<56} {seconds:7.3f} s {100 * share:5.1f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads, the same on every side")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, each side once (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (compile, set-up)")
    # measured best on this CPU for the toy shape (64 of 32/64/128/256 slots, 1024 of 512-4096)
    ap.add_argument("--slots", type=int, default=64,
                    help="ours, eager/compiled: KV-cache slots (dapo.py's --rollout-slots)")
    ap.add_argument("--micro-batch-tokens", type=int, default=1024,
                    help="ours, eager/compiled: micro-batches by token budget (0: 64 rows each)")
    ap.add_argument("--trl-micro-batch", type=int, default=MICRO,
                    help="TRL: per_device_train_batch_size, rows per micro-batch (divides 256)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="one more step per side under torch.profiler, outside the table")
    ap.add_argument("--top", type=int, default=12, help="ops listed per side in the profile")
    args = ap.parse_args()
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
    rows = toy_rows(PROMPTS * n_steps, seed=0)  # TRL takes them in order: step i, chunk i
    chunks = [rows[i * PROMPTS:(i + 1) * PROMPTS] for i in range(n_steps)]
    phases, tokens, record = Phases(), [], Record(args)
    # dapo.py's own name for the sampler, wrapped to count the phase (OurSide wraps the verifier)
    dapo.generate = phases.wrap("generate", dapo.generate)
    with tempfile.TemporaryDirectory() as root:
        base = base_model_dir(root)
        tuned = dict(rollout_slots=args.slots, micro_batch_tokens=args.micro_batch_tokens)
        # dapo.py's own flags: --rollout-slots 512 (so 256 slots here), 64-row micro-batches
        ours = {OURS[0]: OurSide(base, phases),
                OURS[1]: OurSide(base, phases, **tuned),
                OURS[2]: OurSide(base, phases, **tuned, compile=True)}
        trainer = trl_trainer(base, rows, n_steps, args.trl_micro_batch, os.path.join(root, "trl"),
                              phases, tokens)
        torch.set_num_threads(args.threads)  # whatever the trainer's set-up did
        trainer.add_callback(alternating_callback(record, ours, chunks, phases, tokens))
        trainer.train()
    report(record)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
