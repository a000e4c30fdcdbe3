"""
dapo.py's settings: one dataclass, every field a command-line flag (`python dapo.py --help`).

The defaults run the embedded CPU demo; each flag's help gives the paper's value where it has one,
and the README has the paper's full command line. check_flags() refuses nonsense before anything
is loaded, naming the flag.
"""
import argparse
import math
import re
from dataclasses import dataclass, field, fields

import torch

from infra import distributed, trackers
from infra.errors import UserError
from infra.precision import PRECISIONS
from infra.rollout_correction import MODES as CORRECTION_MODES
from losses import AGGREGATIONS, LOSS_MODES, SCALES


REPORT_TO = ("jsonl", "tensorboard", "wandb", "trackio")  # --report-to, TRL's flag name
ROLLOUT_ENGINES = ("sampler", "vllm")  # --rollout-engine


def _flag(default, help_text, choices=None, **argparse_extra):
    return field(default=default, metadata={"help": help_text, "choices": choices,
                                            "extra": argparse_extra})


def slots_value(text: str) -> int | str:
    """--rollout-slots: a number, or auto. argparse shows an ArgumentTypeError's message as it is
    (a ValueError's as "invalid slots_value value")."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or auto, got {text!r}") from None


PLAN_THIS_LAUNCH = -1  # a bare --plan: for this launch's processes


def plan_value(text: str) -> int:
    """--plan N: a number of processes (0: off); a negative one would read as a bare --plan."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of processes >= 1 (0: off), got {text!r}")
    return value


@dataclass
class Config:
    # what to train (the defaults are the embedded CPU demo; the README gives the paper's settings)
    model: str = _flag("", "Hugging Face directory of a Qwen2/Qwen2.5, Llama or Qwen3, or its "
                           "name on the Hub (ORG/NAME[@REV]); empty: the demo's tiny model "
                           "(paper: Qwen2.5-32B base)")
    train_data: str = _flag("", ".parquet/.jsonl rows, or a dataset on the Hub (ORG/NAME, "
                                "ORG/NAME:SPLIT, ORG/NAME/FILE); empty: the toy task (paper: "
                                "DAPO-Math-17k)")
    val_data: str = _flag("", "as --train-data; empty: the toy task's test split (paper: "
                              "AIME-2024)")
    reward_fn: str = _flag("", "FILE.py:NAME, (response, ground_truth) -> float or {score, acc}: "
                               "the verifier of rows no built-in one knows (plain JSONL rows)")
    reward_fn_all_rows: bool = _flag(False, "--reward-fn scores every row, built-in ones too")
    reward_timeout: float = _flag(0.0, "seconds one --reward-fn call may run before it is "
                                       "scored as a wrong answer; 0 or inf = no limit")
    out_dir: str = _flag("runs/demo", "metrics.jsonl and checkpoints go here")
    resume: bool = _flag(False, "continue from out_dir's latest checkpoint")
    eval_only: bool = _flag(False, "evaluate --model on --val-data and exit")
    plan: int = _flag(0, "print the memory plan per process (weights, KV cache, activations...) "
                         "for N processes (without N: this launch's) and exit; 0 = off",
                      nargs="?", const=PLAN_THIS_LAUNCH, metavar="N", type=plan_value)
    seed: int = _flag(0, "seeds the model init, the data order and the sampling")
    device: str = _flag("cuda" if torch.cuda.is_available() else "cpu",
                        "cpu, cuda or cuda:N; the default is cuda where torch sees a GPU, else cpu")
    precision: str = _flag("auto", "compute precision: fp32, or bf16 with fp32 master weights, "
                                   "optimizer and gradient reduction (autocast in one process, "
                                   "FSDP2's mixed precision in several); auto: bf16 on CUDA, "
                                   "and on a CPU where bf16 matmuls are faster (a 50 ms probe; "
                                   "models of 50M+ parameters, one process), else fp32 "
                                   "(paper: bf16)", choices=PRECISIONS)
    # rollout
    steps: int = _flag(40, "rollout steps (paper: thousands, Fig. 1; verl's script: 1 epoch)")
    train_prompts: int = _flag(32, "prompts per rollout step (paper: 512)")
    gen_prompts: int = _flag(48, "prompts per generation batch (paper: 1536 = 3x)")
    group_size: int = _flag(8, "responses per prompt, G (paper: 16)")
    max_gen_batches: int = _flag(4, "dynamic-sampling cap per step; 0 = no cap (paper: 10)")
    on_gen_cap: str = _flag("train", "at the cap: train on the whole mini-batches kept, or stop "
                                     "with an error (paper: error)", choices=("train", "error"))
    max_prompt_len: int = _flag(64, "prompt tokens; longer prompts lose their start (paper: 2048)")
    max_response_len: int = _flag(40, "response tokens, L_max (paper: 20480)")
    overlong_buffer: int = _flag(16, "soft-penalty zone before L_max, L_cache (paper: 4096)")
    overlong_factor: float = _flag(1.0, "scale of the overlong penalty (paper: 1.0)")
    temperature: float = _flag(1.0, "rollout sampling temperature (paper: 1.0)")
    top_p: float = _flag(1.0, "rollout nucleus sampling, 1 = off (paper: 1.0)")
    top_k: int = _flag(0, "rollout top-k, 0 = off (paper: off)")
    rollout_slots: int | str = _flag(64, "sequences decoding at once per process, the KV "
                                              "cache's rows: bounds its memory (0 = all; auto: "
                                              "as many as the memory plan fits)", type=slots_value)
    compile: bool = _flag(False, "decode with a torch.compile'd step (CUDA graphs on a GPU), and "
                                 "train with torch.compile'd decoder blocks")
    rollout_engine: str = _flag("sampler", "what samples the rollouts: sampler.py, or a vLLM "
                                           "engine beside each process's trainer, its weights "
                                           "synced after every optimizer step (docs/vllm.md)",
                                choices=ROLLOUT_ENGINES)
    vllm_gpu_memory_utilization: float = _flag(0.3, "--rollout-engine vllm: the share of the "
                                                    "device's memory the engine takes (vLLM's "
                                                    "gpu_memory_utilization; on CPU, of RAM)")
    # update
    mini_batch_prompts: int = _flag(8, "prompts per optimizer step (paper: 32)")
    micro_batch_size: int = _flag(64, "sequences per forward/backward when --micro-batch-tokens "
                                      "is 0")
    fused_head: bool = _flag(True, "the output layer inside the log-prob kernel, a chunk of tokens "
                                   "at a time; off: the (B, R, V) logits, for comparison")
    micro_batch_tokens: int = _flag(1024, "micro-batches of length-sorted sequences up to this "
                                          "many padded tokens (0: --micro-batch-size rows) "
                                          "(paper: 22528 = 2048 + 20480)")
    lr: float = _flag(3e-4, "AdamW learning rate (paper: 1e-6)")
    weight_decay: float = _flag(0.0, "AdamW weight decay (paper: 0.1)")
    grad_clip: float = _flag(1.0, "max grad norm (paper: 1.0)")
    warmup_steps: int = _flag(3, "linear lr warm-up from 0, in rollout steps (paper: 20; verl's "
                                 "script: 10)")
    eps_low: float = _flag(0.2, "lower clip range: ratio >= 1 - eps_low (paper: 0.2)")
    eps_high: float = _flag(0.28, "upper clip range with clip-higher (paper: 0.28)")
    dual_clip: float = _flag(0.0, "dual-clip bound c for A < 0; 0 = off (paper: 10, in verl's "
                                  "DAPO)")
    # DAPO's neighbours (losses.py), spelled as verl spells them
    scale_rewards: str = _flag("group", "the advantage's scale: the group's std (Eq. 9), the "
                                        "batch's (TRL), or none (Dr. GRPO, arXiv 2503.20783; "
                                        "verl's norm_adv_by_std_in_grpo=False) (paper: group)",
                               choices=SCALES)
    loss_mode: str = _flag("vanilla", "the policy loss (verl's loss_mode): vanilla, DAPO's clipped "
                                      "token ratio (Eq. 10); gspo, one ratio per response (arXiv "
                                      "2507.18071, clip 3e-4/4e-4 there); cispo, the clipped "
                                      "ratio as a detached weight on log pi (arXiv 2506.13585); "
                                      "kl_cov, a KL penalty on the tokens of highest covariance, "
                                      "no clip (arXiv 2505.22617) (paper: vanilla)",
                           choices=LOSS_MODES)
    kl_cov_ratio: float = _flag(2e-4, "--loss-mode kl_cov: the share of a micro-batch's tokens "
                                      "penalised (verl's default)")
    ppo_kl_coef: float = _flag(0.1, "--loss-mode kl_cov: the penalty's coefficient (verl's "
                                    "default)")
    # the sampler/trainer mismatch (infra/rollout_correction.py); the paper predates it
    rollout_correction: str = _flag(
        "auto", "weigh each token's loss by rho = pi_old / pi_sampler (detached), TRL's modes: "
        "token_truncate clamp(rho, C_min, C_max) (truncated IS; verl's rollout_is token), "
        "token_mask rho, 0 outside [C_min, C_max] (IcePop), sequence_* the same with rho's "
        "product over the response (TRL's default: sequence_mask); none: the paper's; auto: "
        "token_truncate with --rollout-engine vllm, else none (paper: none)",
        choices=("auto",) + CORRECTION_MODES)
    rollout_is_min: float = _flag(0.0, "C_min of --rollout-correction, 0 = none (TRL's default; "
                                       "verl's IcePop example: 0.5)")
    rollout_is_max: float = _flag(2.0, "C_max of --rollout-correction (verl's default; TRL's 3.0; "
                                       "verl's IcePop example: 5.0)")
    rollout_precision: str = _flag("same", "the sampler's precision, when not --precision's: bf16 "
                                           "with an fp32 trainer (vLLM's bf16 against FSDP's fp32) "
                                           "is a real sampler/trainer mismatch; one process only",
                                   choices=("same",) + PRECISIONS[1:])
    # the four techniques, each switchable for the paper's ablation (all off = naive GRPO)
    clip_higher: bool = _flag(True, "technique 1: eps_high; off: symmetric eps_low (paper: on)")
    dynamic_sampling: bool = _flag(True, "technique 2: keep groups with mixed accuracy (paper: on)")
    loss_agg_mode: str = _flag("token-mean", "technique 3, the loss's mean (verl's "
                                             "loss_agg_mode): token-mean over every token (Eq. "
                                             "12); seq-mean-token-mean, naive GRPO's mean of "
                                             "sequence means; seq-mean-token-sum-norm, Dr. "
                                             "GRPO's sums over a constant (--max-response-len) "
                                             "(paper: token-mean)", choices=AGGREGATIONS)
    overlong_shaping: bool = _flag(True, "technique 4: soft overlong punishment (paper: on)")
    overlong_filtering: bool = _flag(False, "mask truncated responses out of the loss (paper: "
                                            "off, an ablation row)")
    # evaluation and checkpoints
    eval_every: int = _flag(10, "evaluate every N steps (and at step 0); 0 = never (paper: 5)")
    eval_samples: int = _flag(4, "k of avg@k and pass@k (paper: 32, AIME's avg@32)")
    eval_temperature: float = _flag(1.0, "evaluation temperature (paper: 1.0)")
    eval_top_p: float = _flag(1.0, "evaluation top-p (paper: 0.7)")
    eval_prompts: int = _flag(128, "held-out problems to evaluate, 0 = all (paper: 0, AIME's 30)")
    save_every: int = _flag(0, "checkpoint every N steps (and at the end); 0 = end only (paper: "
                               "5)")
    keep_checkpoints: int = _flag(0, "keep only the last N checkpoints; 0 = all")
    overwrite: bool = _flag(False, "start again in an --out-dir that holds a run (deletes its "
                                   "metrics and checkpoints)")
    stop_when_stuck: int = _flag(20, "stop (checkpoint, exit 1) after N consecutive steps that "
                                     "trained on nothing or on a dead policy; 0 = never")
    dist_timeout: float = _flag(1800.0, "seconds a rank waits for the others before failing")
    activation_checkpointing: bool = _flag(False, "recompute block activations in the backward: "
                                                  "less memory, ~30% more time (paper: on)")
    report_to: tuple[str, ...] = _flag(("jsonl",), "where the metrics go, one or more of "
                                       "jsonl tensorboard wandb trackio (metrics.jsonl is always "
                                       "written, listed or not)", choices=REPORT_TO)

    def __post_init__(self):
        if self.rollout_correction == "auto":  # vLLM's kernels are not the trainer's: correct
            vllm = self.rollout_engine == "vllm"
            self.rollout_correction = "token_truncate" if vllm else "none"

    @property
    def gen_batch_prompts(self) -> int:
        """Prompts per generation batch: --gen-prompts with dynamic sampling (it draws more than
        it trains on), else the training batch."""
        return self.gen_prompts if self.dynamic_sampling else self.train_prompts

    @property
    def gen_batch_flag(self) -> str:
        """The flag that sets gen_batch_prompts, for the errors that name it."""
        return "--gen-prompts" if self.dynamic_sampling else "--train-prompts"

    @property
    def sampler_precision(self) -> str:
        """The rollout's compute precision (an evaluation's too): --rollout-precision, or with
        "same" --precision's."""
        return self.precision if self.rollout_precision == "same" else self.rollout_precision


# a collective's deadline in nanoseconds must fit an int64 (292 years): 1e9 s is 31 years
MAX_DIST_TIMEOUT_S = 1e9
# numpy's generators take no negative seed (the data order), torch's none past 2**64 - 1 (an
# evaluation's generator is seeded with seed + 1 + rank)
SEED_LIMIT = 2**63


def not_finite(flag: str, value: float, allowed: str = "") -> str | None:
    """The problem of a float flag that is NaN or infinite, or None: a NaN passes every `>= low`
    check, and trains on a NaN loss (or samples from a NaN distribution). Shared with
    tools/chat.py."""
    return None if math.isfinite(value) else f"{flag} must be a finite number{allowed}, got {value}"


def seed_problems(seed: int) -> list[str]:
    """--seed out of the generators' range, said before anything loads (shared with tools/chat.py):
    -1 failed in the data order's numpy generator, after the model had loaded."""
    return [] if 0 <= seed < SEED_LIMIT else [f"--seed must be in [0, 2**63), got {seed}"]


def _non_finite_fields(cfg: Config) -> dict[str, str]:
    """{field: its problem} for each float flag that is NaN or infinite (--reward-timeout inf
    means no limit)."""
    problems = {}
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if not isinstance(f.default, float) or (f.name == "reward_timeout" and value == math.inf):
            continue
        allowed = " or inf (no limit)" if f.name == "reward_timeout" else ""
        if problem := not_finite(f"--{f.name.replace('_', '-')}", value, allowed):
            problems[f.name] = problem
    return problems


def check_flags(cfg: Config, world: int = 1):
    """Refuse flags that make no sense before anything is loaded, naming the flag, one line
    each (a NaN flag once, as not finite)."""
    non_finite = _non_finite_fields(cfg)
    at_least = {"steps": 0, "train_prompts": 1, "gen_prompts": 1, "group_size": 1,
                "max_gen_batches": 0, "max_prompt_len": 1, "max_response_len": 1, "top_k": 0,
                "mini_batch_prompts": 1, "micro_batch_size": 1,
                "micro_batch_tokens": 0, "lr": 0, "warmup_steps": 0, "eps_low": 0,
                "eps_high": 0, "eval_every": 0, "eval_samples": 1, "eval_temperature": 0,
                "eval_prompts": 0, "save_every": 0, "keep_checkpoints": 0, "stop_when_stuck": 0,
                "weight_decay": 0, "reward_timeout": 0, "overlong_factor": 0}
    problems = list(non_finite.values())
    problems += [f"--{k.replace('_', '-')} must be >= {low}, got {getattr(cfg, k)}"
                 for k, low in at_least.items() if k not in non_finite and getattr(cfg, k) < low]
    problems += seed_problems(cfg.seed)
    if not cfg.out_dir:  # os.makedirs("") fails with FileNotFoundError; "." names this directory
        problems.append("--out-dir must name a directory, got ''")
    if cfg.plan < 0 and cfg.plan != PLAN_THIS_LAUNCH:
        problems.append(f"--plan must be a number of processes >= 1 (0: off), got {cfg.plan}")
    if cfg.rollout_slots != "auto" and not (isinstance(cfg.rollout_slots, int)
                                                 and cfg.rollout_slots >= 0):
        problems.append(f"--rollout-slots must be >= 0 or auto, got "
                        f"{cfg.rollout_slots!r}")
    for name, value, ok, need in [
        ("temperature", cfg.temperature, cfg.temperature > 0,
         "> 0 (the policy's log-probs are those of softmax(logits / T))"),
        ("top-p", cfg.top_p, 0 < cfg.top_p <= 1, "in (0, 1]"),
        ("eval-top-p", cfg.eval_top_p, 0 < cfg.eval_top_p <= 1, "in (0, 1]"),
        ("eps-low", cfg.eps_low, cfg.eps_low < 1, "< 1"),
        ("grad-clip", cfg.grad_clip, cfg.grad_clip > 0, "> 0"),
        ("dual-clip", cfg.dual_clip, cfg.dual_clip == 0 or cfg.dual_clip > 1, "0 (off) or > 1"),
        ("dual-clip", cfg.dual_clip, cfg.dual_clip == 0 or cfg.loss_mode == "vanilla",
         "0 with --loss-mode " + cfg.loss_mode + " (verl's dual clip bounds vanilla's alone)"),
        ("kl-cov-ratio", cfg.kl_cov_ratio, 0 < cfg.kl_cov_ratio <= 1, "in (0, 1]"),
        ("ppo-kl-coef", cfg.ppo_kl_coef, cfg.ppo_kl_coef >= 0, ">= 0"),
        # rho = 1 (the sampler agrees) must keep its weight 1
        ("rollout-is-min", cfg.rollout_is_min, 0 <= cfg.rollout_is_min <= 1, "in [0, 1]"),
        ("rollout-is-max", cfg.rollout_is_max, cfg.rollout_is_max >= 1, ">= 1"),
        ("dist-timeout", cfg.dist_timeout, 0 < cfg.dist_timeout <= MAX_DIST_TIMEOUT_S,
         f"in (0, {MAX_DIST_TIMEOUT_S:g}] seconds"),
        ("overlong-buffer", cfg.overlong_buffer,
         not cfg.overlong_shaping or 0 < cfg.overlong_buffer <= cfg.max_response_len,
         f"in (0, --max-response-len={cfg.max_response_len}] with overlong shaping on"),
        # (--mini-batch-prompts 0 is said above: no modulo by it)
        ("train-prompts", cfg.train_prompts, cfg.mini_batch_prompts < 1
         or cfg.train_prompts % cfg.mini_batch_prompts == 0,
         f"a multiple of --mini-batch-prompts={cfg.mini_batch_prompts} (whole optimizer steps)"),
    ]:
        if not ok and name.replace("-", "_") not in non_finite:
            problems.append(f"--{name} must be {need}, got {value}")
    if cfg.rollout_precision != "same" and world > 1:  # FSDP2 casts the weights for both
        problems.append(f"--rollout-precision runs in one process only, got {world}: FSDP2's "
                        "mixed precision (--precision) is the sampler's and the trainer's")
    problems += _vllm_problems(cfg)
    if cfg.compile and world > 1:  # FSDP2's hooks on every block are not traceable into it
        problems.append(f"--compile runs in one process only, got {world}: the compiled decode "
                        "step is one graph, and FSDP2's hooks in each block cannot be traced")
    if cfg.gen_batch_prompts % world:  # each rank samples its share of every generation batch
        problems.append(f"{cfg.gen_batch_flag} must be a multiple of the {world} processes, got "
                        f"{cfg.gen_batch_prompts}")
    if cfg.mini_batch_prompts * cfg.group_size % world:  # each rank trains its share of a step
        problems.append(f"--mini-batch-prompts x --group-size must be a multiple of the {world} "
                        f"processes (each trains its share of every optimizer step's responses), "
                        f"got {cfg.mini_batch_prompts} x {cfg.group_size}")
    problems += device_problems(cfg.device)
    problems += [f"--report-to must be among {' '.join(REPORT_TO)}, got {name!r}"
                 for name in cfg.report_to if name not in REPORT_TO]
    problems += trackers.missing(cfg.report_to)  # not installed: refused before the model loads
    if cfg.resume and cfg.overwrite:
        problems.append("--resume continues the run in --out-dir, --overwrite deletes it: pick one")
    if problems:  # one line: the command line shows it as `error: bad flags: ...`
        raise UserError("bad flags: " + "; ".join(problems))


def _vllm_problems(cfg: Config) -> list[str]:
    """vLLM records a token's log-prob before temperature and truncation, or after both
    (infra/vllm_engine.py): with both a temperature and a truncation neither is the trainer's."""
    if cfg.rollout_engine != "vllm":
        return []
    problems = []
    if not 0 < cfg.vllm_gpu_memory_utilization <= 1:
        problems.append(f"--vllm-gpu-memory-utilization must be in (0, 1], got "
                        f"{cfg.vllm_gpu_memory_utilization}")
    if cfg.temperature != 1 and (cfg.top_p < 1 or cfg.top_k > 0):
        problems.append(f"--rollout-engine vllm takes --temperature {cfg.temperature} or "
                        f"--top-p/--top-k, not both: vLLM's log-probs are before both or after "
                        "both, and the trainer's are after the temperature, before truncation")
    return problems


def device_problems(device: str) -> list[str]:
    """--device checked here, not by the first tensor moved there: "foo" would surface as a
    "corrupt" model file, "cuda" without a GPU as a pin_memory error, after --out-dir is made
    (tools/chat.py's, cuda:99, as an AssertionError)."""
    match = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if not match:
        return [f"--device must be cpu, cuda or cuda:N, got {device!r}"]
    count = torch.cuda.device_count() if device.startswith("cuda") else 0
    if device.startswith("cuda") and (count == 0 or int(match.group(1) or 0) >= count):
        return [f"--device must be a CUDA device this machine has (it has "
                f"{count or 'none'}), got {device!r}"]
    return []


# --help's header, between the entry point's own text and the flags
DEFAULTS = """\
Every default below runs the embedded CPU demo (a tiny Qwen2 on a toy task: `make run`).
(paper: X) is the setting of the paper's run, or of its verl script where the paper gives none;
the README has that run's whole command line. --device is cuda where torch sees a GPU, else cpu;
--precision auto is bf16 on CUDA (fp32 master weights); on a CPU, bf16 only where it is faster."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """A bad flag value is one line `error: ...` (argparse's own would print the usage of
        every flag first), from rank 0 only under torchrun, exit status 2."""
        distributed.fail(f"{message} ({self.prog} --help lists the flags)")


def parse_args(argv=None, description: str = "") -> Config:
    parser = _Parser(usage="%(prog)s [--FLAG VALUE ...]",
                     description=f"{description.strip()}\n\n{DEFAULTS}".strip(),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Config):
        help_text = f.metadata["help"].replace("%", "%%") + " (default: %(default)r)"
        if isinstance(f.default, bool):  # --flag / --no-flag
            kind = dict(action=argparse.BooleanOptionalAction)
        elif isinstance(f.default, tuple):  # one or more values: --report-to wandb tensorboard
            kind = dict(nargs="+", type=type(f.default[0]), choices=f.metadata["choices"],
                        metavar="NAME")  # the help lists the choices
        else:
            kind = dict(type=type(f.default), choices=f.metadata["choices"])
        kind.update(f.metadata["extra"])  # e.g. a parser of its own, an optional value
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=help_text,
                            **kind)
    args = vars(parser.parse_args(argv))
    return Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in args.items()})
