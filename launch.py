"""
Set-up for dapo.py's loop: the processes, the policy, the tokenizer and the data. Nothing here is
DAPO; it is what a run needs before Algorithm 1 starts.

    run(train, cfg)        checks the flags and the files they name, starts torch.distributed
                           under torchrun, picks the compute dtype, prints the memory plan from
                           the model's config.json (--plan: then exits, status 0), checks the
                           lengths against its positions, calls train(cfg), shuts down
    load_policy(cfg)       the policy from --model, from a checkpoint (--resume) or the demo's
    load_data(cfg, tok)    training and held-out rows, from files or the toy task's
    user_errors_in_one_line()  the command line's way to report a user's mistake
"""
import contextlib
import linecache
import logging
import os
import sys

import torch

from config import Config, check_flags
from data import Tokenizer, check_data_file, check_vocab, load_rows, load_tokenizer
from infra import checkpoint, distributed, health, hf_io, memory, precision, trackers, vllm_engine
from infra.files import need_file
from model import ModelConfig, Qwen2
from reward import check_reward_fn, install_reward_fn, uninstall_reward_fn


def run(train, cfg: Config):
    # --plan N: the flags are checked, and the memory planned, for the N processes the plan is for
    planned = cfg.plan if cfg.plan > 0 else distributed.launched_world()
    check_flags(cfg, world=planned)
    if not cfg.plan:  # --plan reads config.json alone
        check_files(cfg)  # before the processes meet and the weights load (minutes for 32B)
    rank, world, cfg.device = distributed.init(cfg.device, timeout_s=cfg.dist_timeout)
    # bf16 compute with fp32 master weights: dapo.py enters autocast per forward phase, never
    # around the whole run (infra/precision.py says why)
    cfg.precision = precision.resolve(cfg.precision, cfg.device)
    # data.py reports through logging: rank 0 shows it, the others only warnings
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    try:
        m, config_json = model_config(cfg)  # from config.json alone, before anything loads
        plan_memory(cfg, m, planned, world)  # a run that cannot fit stops here
        if cfg.plan:
            return None
        check_lengths(cfg, m, config_json)  # before train (open_run) writes anything
        return train(cfg)
    except health.RunStuck as stuck:  # the warnings above name the cause: one line, no traceback
        distributed.say(f"error: {stuck}")
        raise SystemExit(1) from None
    finally:
        trackers.close_all()  # a crash still flushes what the trackers were given
        vllm_engine.close_all()  # before the process group: vLLM's teardown uses it
        distributed.shutdown(after_error=sys.exc_info()[0] is not None)  # an exception in flight


def plan_memory(cfg: Config, m: ModelConfig, planned: int, world: int):
    """The memory plan per process (infra/memory.py) of model m with these flags on `planned`
    processes, printed by rank 0: against this device when they are this launch's `world`, else
    (--plan N) against no device. A run that cannot fit the device stops with the numbers;
    --rollout-slots auto becomes the slots that fit."""
    capacity = memory.device_capacity(cfg.device) if planned == world else 0
    plan = memory.plan(m, cfg, planned, capacity)
    distributed.say(plan.describe(cfg.device if capacity else "a device of any size"))
    if not cfg.plan:
        memory.refuse_if_too_big(plan, cfg.device)
        if cfg.rollout_slots == "auto":
            cfg.rollout_slots = plan.slots


def model_config(cfg: Config) -> tuple[ModelConfig, str | None]:
    """The shape of the policy a run will load, from config.json alone: the checkpoint's
    (--resume), --model's or the demo's. Returns (it, the config.json read, None for the demo)."""
    if cfg.resume or cfg.model:
        model_dir = os.path.join(checkpoint.latest(cfg.out_dir), "model") if cfg.resume else \
            cfg.model
        config_json = need_file(model_dir, "config.json")
        return ModelConfig.from_json(config_json), config_json
    from toy import demo_model_config  # the demo's, imported only where it is chosen
    return demo_model_config(), None


def check_files(cfg: Config):
    """The files the flags name, checked before anything loads: each data file is there and has a
    reader (pyarrow for parquet), and --reward-fn is imported, once, and becomes the verifier of
    the rows it scores (the rows are checked against it as they load)."""
    for flag, path in (("--train-data", cfg.train_data), ("--val-data", cfg.val_data)):
        if path:
            check_data_file(path, flag)
    install_custom_reward(cfg)
    if cfg.rollout_engine == "vllm":  # not installed: one line now, not after the weights load
        vllm_engine.import_vllm()


def load_policy(cfg: Config) -> tuple[Qwen2, Tokenizer, str, str | None]:
    """The policy in fp32 (the master weights) and its tokenizer, from --model, from the latest
    checkpoint with --resume, or the demo's base model; sharded with FSDP2 on several processes.
    Returns (model, tokenizer, the tokenizer's directory, the checkpoint to resume or None)."""
    torch.manual_seed(cfg.seed)
    resume_dir = checkpoint.open_run(cfg)
    sharded = distributed.world_size() > 1
    if resume_dir or cfg.model:
        tok_dir = os.path.join(resume_dir, "model") if resume_dir else cfg.model
        model = load_sharded(tok_dir, cfg) if sharded else \
            Qwen2.from_pretrained(tok_dir, dtype=torch.float32, device=cfg.device)
    else:
        from toy import demo_policy
        tok_dir, model = demo_policy(cfg.out_dir, cfg.device, cfg.seed)
        if sharded:
            distributed.shard(model, mixed_precision=cfg.precision == "bf16")
    tok = load_tokenizer(tok_dir)
    check_vocab(model.config.vocab_size, tok, tok_dir)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.compile:
        model.compile_blocks()
    return model, tok, tok_dir, resume_dir


def rollout_engine(cfg: Config, model: Qwen2):
    """--rollout-engine vllm: this process's vLLM engine with the policy's weights; None for
    sampler.py, which reads the policy's own."""
    if cfg.rollout_engine != "vllm":
        return None
    return vllm_engine.VLLMEngine(cfg, model)


def load_sharded(model_dir: str, cfg: Config) -> Qwen2:
    """The policy in fp32, sharded with FSDP2 (bf16 compute with --precision bf16), without any
    rank ever holding the whole model (a 32B's fp32 weights are 131 GB): built on the meta
    device, sharded, then each rank reads its own rows of every weight from the safetensors
    files."""
    m = ModelConfig.from_json(need_file(model_dir, "config.json"))
    with torch.device("meta"):
        model = Qwen2(m)
    distributed.shard(model, mixed_precision=cfg.precision == "bf16")
    model.to_empty(device=cfg.device)
    with torch.no_grad():  # name -> (rows, the full shape, this rank's tensor)
        hf_io.load_rows_into(model_dir, distributed.local_rows(model), cfg.device,
                             skip=hf_io.tied_keys(m))
    model.inv_freq = model._rope_inv_freq(cfg.device)
    checkpoint.check_finite(model, f"loading {model_dir}")  # every rank stops, naming the weight
    return model


def check_lengths(cfg: Config, m: ModelConfig, config_json: str | None):
    """A prompt and its response must fit the positions of model m, read from config_json (None:
    the demo's), before anything is written (RoPE past its trained range gives garbage,
    silently)."""
    limit = m.max_position_embeddings
    source = f"{config_json} (max_position_embeddings)" if config_json else "the demo model"
    total = cfg.max_prompt_len + cfg.max_response_len
    if total > limit:
        raise ValueError(f"--max-prompt-len {cfg.max_prompt_len} + --max-response-len "
                         f"{cfg.max_response_len} = {total} tokens, more than the {limit} "
                         f"positions of {source}: lower --max-prompt-len or --max-response-len")


def load_data(cfg: Config, tok) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows: DAPO-Math-17k / AIME-2024 files, or the toy task's splits.
    Every row of a file is checked now (a reward function for it, a prompt that renders and
    encodes), not when a step first draws it. --reward-fn was installed by check_files."""
    if cfg.model and not cfg.train_data and not cfg.eval_only:
        distributed.say(f"warning: --model {cfg.model} without --train-data trains on the demo's "
                        "toy sums (pass --train-data, e.g. DAPO-Math-17k's parquet file)")
    if not (cfg.train_data and cfg.val_data):
        from toy import toy_rows  # the demo's task, where a file is not given
    train_rows = load_rows(cfg.train_data, tok) if cfg.train_data else \
        toy_rows(20000, seed=cfg.seed, split="train")
    val_rows = load_rows(cfg.val_data, tok) if cfg.val_data else \
        toy_rows(1000, seed=cfg.seed, split="test")
    if not cfg.eval_only and len(train_rows) < cfg.gen_batch_prompts:
        raise ValueError(f"{cfg.train_data}: {len(train_rows)} usable rows, fewer than "
                         f"{cfg.gen_batch_flag} {cfg.gen_batch_prompts} (the prompts of one "
                         "generation batch)")
    if cfg.reward_fn:  # one call on a real ground truth: a wrong signature stops the run now
        check_reward_fn(train_rows[0]["reward_model"]["ground_truth"])
    return train_rows, val_rows[:cfg.eval_prompts or None]


def install_custom_reward(cfg: Config):
    """--reward-fn, loaded on every rank before the data (whose rows it may be the verifier of)."""
    if cfg.reward_fn_all_rows and not cfg.reward_fn:
        raise ValueError("--reward-fn-all-rows needs --reward-fn FILE.py:NAME")
    uninstall_reward_fn()
    if cfg.reward_fn:
        install_reward_fn(cfg.reward_fn, cfg.reward_fn_all_rows, timeout_s=cfg.reward_timeout)


# A user's mistake (a flag, a path, a file's content, a directory another run holds) is found by
# the checks of config.py, data.py, reward.py and infra/, which raise these with a message that
# names the flag or the file and what to do
USER_ERRORS = (ValueError, OSError, ImportError, RuntimeError)
ROOT = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def user_errors_in_one_line():
    """Around the command line's run: a user's mistake is one line `error: ...`, from rank 0 only,
    exit status 2 (infra/distributed.fail); a traceback is for a bug. A mistake is an error of
    USER_ERRORS that one of this project's `raise` statements made; the same types raised by
    Python or a library (a ValueError of tuple unpacking, torch's RuntimeError of a shape
    mismatch) are bugs."""
    try:
        yield
    except USER_ERRORS as e:
        if not _raised_by_a_check(e):
            raise
        distributed.fail(str(e))


def _raised_by_a_check(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb.tb_next:  # the innermost frame: where it was raised
        tb = tb.tb_next
    file = os.path.abspath(tb.tb_frame.f_code.co_filename)
    ours = file.startswith(ROOT + os.sep) and "site-packages" not in file
    return ours and linecache.getline(file, tb.tb_lineno).lstrip().startswith("raise ")
