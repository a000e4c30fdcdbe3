"""
Set-up for dapo.py's loop: the processes, the policy, the tokenizer and the data. Nothing here is
DAPO; it is what a run needs before Algorithm 1 starts.

    with session(cfg) as cfg:  the flags checked, torch.distributed started under torchrun, the
                               names on the Hub fetched, the files and directories the flags
                               name checked (every rank with the same flags and files),
                               logging; on the way out, the trackers flushed and the processes
                               shut down
    plan(cfg)                  the compute precision and a CPU's threads chosen, and the memory
                               plan from the model's config.json, printed (--plan N: then
                               dapo.py stops, status 0)
    setup(cfg)                 the lengths checked against the positions, the verifier, the
                               policy, its tokenizer, the training and held-out rows (a Setup)
    user_errors_in_one_line()  the command line's way to report a user's mistake (a UserError)
    rollout_engine(cfg, ...)   what dapo.rollout() samples with: SamplerRollout (sampler.py's
                               generate under FSDP's gather and the sampler's autocast) or, with
                               --rollout-engine vllm, VLLMRollout

Each step returns a new Config where it resolves a flag, never edits the caller's: session the
Hub names, the device (--device auto); plan --precision auto and --rollout-slots auto.
"""
import contextlib
import hashlib
import logging
import os
import sys
from dataclasses import asdict, dataclass, replace

import torch

import sampler
from config import Config, check_flags
from data import Tokenizer, check_data_file, check_vocab, load_rows, load_tokenizer
from infra import (checkpoint, cpu, distributed, files, health, hf_io, hub, interrupt, memory,
                   precision, trackers, vllm_engine)
from infra.errors import UserError
from infra.files import need_file
from infra.reward_fn import reward_fn_file
from model import ModelConfig, Transformer, rope_inv_freq
from reward import Verifier
from sampler import Rollout


@contextlib.contextmanager
def session(cfg: Config):
    """A run's processes, around dapo.py's work: yields cfg with the device resolved. Whatever
    happens inside, the trackers are flushed and the processes shut down; a run stuck says so in
    one line (exit status 1), a rank that timed out inside FSDP2's collectives names
    --dist-timeout."""
    # --plan N: the flags are checked, and the memory planned, for the N processes the plan is for
    check_flags(cfg, world=planned_world(cfg))
    rank, _, device = distributed.init(cfg.device, timeout_s=cfg.dist_timeout)
    # names on the Hugging Face Hub become paths in its cache
    cfg = fetch_hub_names(cfg)
    # --plan reads config.json alone; a run checks every file before the weights load (minutes
    # for 32B) and every directory it writes before the first save, not after a step of the run
    if not cfg.plan:
        check_files(cfg)
        check_writable_dirs(cfg)
    check_ranks_agree(cfg)  # ranks started with their own command lines (one per node)
    cfg = replace(cfg, device=device)
    # data.py reports through logging: rank 0 shows it, the others only warnings
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    try:
        yield cfg
    except health.RunStuck as stuck:  # the warnings above name the cause: one line, no traceback
        distributed.say(f"error: {stuck}")
        raise SystemExit(1) from None
    except RuntimeError as e:  # a rank stopped or died while this one was in FSDP2's collectives
        said = distributed.collective_error(e, cfg.dist_timeout)
        if said is None:
            raise
        raise said from e
    finally:
        interrupt.restore()  # the signal handlers of dapo.py's loop
        trackers.close_all()  # a crash still flushes what the trackers were given
        vllm_engine.close_all()  # before the process group: vLLM's teardown uses it
        distributed.shutdown(after_error=sys.exc_info()[0] is not None)  # an exception in flight


def plan(cfg: Config) -> Config:
    """The compute precision (--precision auto: bf16 on CUDA, and on a CPU where it is faster), a
    CPU's threads (one for a small model), and the memory plan per process (infra/memory.py) of
    the policy's config.json with these flags, printed by rank 0 with the precision's reason in
    its first line, against this device unless --plan N plans another number of processes. A run
    that cannot fit the device stops with the numbers. Returns cfg with --precision and
    --rollout-slots auto resolved."""
    planned = planned_world(cfg)
    model_cfg = model_config(cfg)[0]
    params = memory.parameter_count(model_cfg)
    # bf16 compute with fp32 master weights: dapo.py enters autocast per forward phase, never
    # around the whole run (infra/precision.py says why)
    chosen = precision.choose(cfg.precision, cfg.device, params, planned)
    cfg = replace(cfg, precision=chosen.precision)
    capacity = memory.device_capacity(cfg.device) if planned == distributed.world_size() else 0
    memory_plan = memory.plan(model_cfg, cfg, planned, capacity)
    where = cfg.device if capacity else "a device of any size"
    if cfg.device == "cpu":  # one thread for a small model (infra/cpu.py says why)
        threads = cpu.set_threads(params)
        where += f", {threads} thread(s)" if capacity else ""
    distributed.say(memory_plan.describe(where, chosen.why))
    if cfg.plan:
        return cfg
    memory.refuse_if_too_big(memory_plan, cfg.device)
    return replace(cfg, rollout_slots=memory_plan.slots) if cfg.rollout_slots == "auto" else cfg


def planned_world(cfg: Config) -> int:
    """The processes a run is planned for: --plan N's N, else (a bare --plan too) this launch's."""
    return cfg.plan if cfg.plan > 0 else distributed.launched_world()


@dataclass
class Setup:
    """What the loop starts from."""
    model: Transformer  # the policy, fp32 master weights (sharded with FSDP2 on several processes)
    tok: Tokenizer
    tok_dir: str  # the tokenizer's directory, copied into every checkpoint
    resume_dir: str | None  # the checkpoint --resume continues from
    train_rows: list[dict]
    val_rows: list[dict]
    verifier: Verifier  # the built-in scorers and --reward-fn's function
    engine: "SamplerRollout | VLLMRollout"  # sampler.py's, or --rollout-engine vllm's


def setup(cfg: Config) -> Setup:
    """The lengths checked against the policy's positions (before anything is written), the
    verifier (a broken --reward-fn fails before the weights load), the policy, its tokenizer and
    the data."""
    check_lengths(cfg, *model_config(cfg))
    verifier = load_verifier(cfg)
    model, tok, tok_dir, resume_dir = load_policy(cfg)
    return Setup(model, tok, tok_dir, resume_dir, *load_data(cfg, tok, verifier), verifier,
                 rollout_engine(cfg, model, tok))


def demo():
    """toy.py, the demo's task, tokenizer and base model, for a run without --model (or without
    --train-data / --val-data). Imported here, where such a run takes it, and only then: the
    algorithm never imports the demo."""
    import toy
    return toy


def model_config(cfg: Config) -> tuple[ModelConfig, str | None]:
    """The shape of the policy a run will load, from config.json alone: the checkpoint's
    (--resume), --model's or the demo's. Returns (it, the config.json read, None for the demo)."""
    if cfg.resume or cfg.model:
        if cfg.resume:
            model_dir = os.path.join(checkpoint.latest(cfg.out_dir), "model")
        else:
            model_dir = cfg.model
        config_json = need_file(model_dir, "config.json")
        return ModelConfig.from_json(config_json), config_json
    return demo().demo_model_config(), None


HUB_FLAGS = {"--model": "model", "--train-data": "dataset", "--val-data": "dataset"}


def fetch_hub_names(cfg: Config) -> Config:
    """cfg with --model, --train-data and --val-data given as names on the Hugging Face Hub
    replaced by their paths in its cache, which name the commit (infra/hub.py; under torchrun one
    process downloads); local paths as they are. --resume fetches the commits the checkpoint's
    paths name. --plan and --resume read the model's config.json alone (the checkpoint holds the
    weights), and --plan no data."""
    names = {flag: hub.parse(getattr(cfg, _field(flag)), kind) for flag, kind in HUB_FLAGS.items()
             if not (cfg.plan and kind == "dataset")}
    names = {flag: name for flag, name in names.items() if name}
    if not names:
        return cfg
    if cfg.resume:
        saved = checkpoint.saved_config(checkpoint.latest(cfg.out_dir))
        names = {flag: hub.at_commit_of(name, saved.get(_field(flag)), flag)
                 for flag, name in names.items()}
    paths = hub.fetch_once(names, config_only=bool(cfg.plan or cfg.resume))
    return replace(cfg, **{_field(flag): path for flag, path in paths.items()})


def _field(flag: str) -> str:
    return flag[2:].replace("-", "_")  # --train-data -> train_data


def check_files(cfg: Config):
    """The files the flags name, checked before anything loads: each data file is there and has a
    reader (pyarrow for parquet), and so is --reward-fn's (load_verifier imports it)."""
    for flag, path in (("--train-data", cfg.train_data), ("--val-data", cfg.val_data)):
        if path:
            check_data_file(path, flag)
    if cfg.reward_fn_all_rows and not cfg.reward_fn:
        raise UserError("--reward-fn-all-rows needs --reward-fn FILE.py:NAME")
    if cfg.reward_fn:
        # the file must exist now; load_verifier imports it once the checks have passed
        reward_fn_file(cfg.reward_fn)
    # vLLM not installed is said in one line now, not after the weights load
    if cfg.rollout_engine == "vllm":
        vllm_engine.import_vllm()


def input_files(cfg: Config) -> dict[str, str]:
    """The files a run reads, by the flag that names them ("" where not given): the data and
    --reward-fn's file (the --model directory aside)."""
    reward_file = reward_fn_file(cfg.reward_fn)[0] if cfg.reward_fn else ""
    return {"--train-data": cfg.train_data, "--val-data": cfg.val_data, "--reward-fn": reward_file}


# Flags that name a path, which may differ from node to node (a local copy, another mount point
# of the shared filesystem): their files are compared by content instead (--out-dir not at all)
PATH_FLAGS = ("model", "train_data", "val_data", "reward_fn", "out_dir")


def check_ranks_agree(cfg: Config):
    """Every rank runs the same flags on files of the same content. Ranks started with their own
    command lines (torchrun on each node) that differ would train different things (another
    --lr, a node's stale copy of the data) or wait in a collective until --dist-timeout (another
    --steps): each difference is named with its ranks, on every rank, before anything loads.
    Compared by content: the data, --reward-fn's file and function, --model's config.json (its
    weights are not hashed: minutes for a 32B)."""
    if distributed.world_size() == 1:
        return
    flags = {f"--{k.replace('_', '-')}": v for k, v in asdict(cfg).items() if k not in PATH_FLAGS}
    contents = {f"{flag}'s file (sha256)": _sha256(path)
                for flag, path in input_files(cfg).items() if path}
    if cfg.model:
        contents["--model's config.json (sha256)"] = _sha256(os.path.join(cfg.model,
                                                                         "config.json"))
    if cfg.reward_fn:
        contents["--reward-fn's function"] = reward_fn_file(cfg.reward_fn)[1]
    distributed.check_same(flags | contents, "the run (every rank must run the same command "
                                             "line, on the same files)")


def _sha256(path: str) -> str:
    """The file's sha256 (16 hex digits), or "missing"."""
    if not os.path.isfile(path):
        return "missing"
    digest = hashlib.sha256()
    with open(path, "rb") as f:  # hashlib.file_digest is Python 3.11's; 3.10 runs this too
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def check_writable_dirs(cfg: Config):
    """The directories a run writes (--out-dir; its checkpoints/ unless --eval-only), checked
    writable by every rank (each writes its optimizer shard) now, not at the first save (with
    --save-every 0, the end of the run)."""
    files.check_writable(cfg.out_dir, "--out-dir")
    if not cfg.eval_only:
        files.check_writable(os.path.join(cfg.out_dir, "checkpoints"), "--out-dir's checkpoints")


def open_run(cfg: Config) -> str | None:
    """The checkpoint a run continues from (--resume) or None, with --out-dir ready for it
    (--eval-only writes nothing there). A resume that would change the algorithm is refused."""
    if cfg.eval_only:
        resume_dir = checkpoint.latest(cfg.out_dir) if cfg.resume else None
    else:  # never silently reuse a directory that holds a run, nor delete what the run reads
        resume_dir = checkpoint.prepare_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite,
                                                inputs={"--model": cfg.model, **input_files(cfg)})
    if resume_dir:
        checkpoint.check_resume_config(checkpoint.saved_config(resume_dir), asdict(cfg),
                                       where=resume_dir)
    return resume_dir


def load_policy(cfg: Config) -> tuple[Transformer, Tokenizer, str, str | None]:
    """The policy in fp32 (the master weights) and its tokenizer, from --model, from the latest
    checkpoint with --resume, or the demo's base model; sharded with FSDP2 on several processes.
    Returns (model, tokenizer, the tokenizer's directory, the checkpoint to resume or None)."""
    torch.manual_seed(cfg.seed)
    resume_dir = open_run(cfg)
    sharded = distributed.world_size() > 1
    if resume_dir or cfg.model:
        tok_dir = os.path.join(resume_dir, "model") if resume_dir else cfg.model
        tok = load_tokenizer(tok_dir)  # a broken tokenizer file is said before the weights load
        if sharded:
            model = load_sharded(tok_dir, cfg)
        else:
            model = Transformer.from_pretrained(tok_dir, dtype=torch.float32, device=cfg.device)
    else:
        tok_dir, model = demo().demo_policy(cfg.out_dir, cfg.device, cfg.seed)
        if sharded:
            distributed.shard(model, mixed_precision=cfg.precision == "bf16")
        tok = load_tokenizer(tok_dir)
    check_vocab(model.config.vocab_size, tok, tok_dir)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.compile:
        model.compile_blocks()
    return model, tok, tok_dir, resume_dir


def rollout_engine(cfg: Config, model: Transformer,
                   tok: Tokenizer) -> "SamplerRollout | VLLMRollout":
    """sampler.py's engine, which reads the policy's own weights, or with --rollout-engine vllm
    this process's vLLM engine, given the policy's weights."""
    if cfg.rollout_engine == "vllm":
        return VLLMRollout(cfg, vllm_engine.VLLMEngine(cfg, model), tok.pad_token_id)
    return SamplerRollout(cfg, tok.pad_token_id)


class SamplerRollout:
    """What dapo.rollout() samples with by default: sampler.generate() with the run's settings,
    under FSDP's gather (once for all the tokens) and the sampler's autocast. VLLMRollout (for
    --rollout-engine vllm) has the same two methods and returns the same Rollout."""

    def __init__(self, cfg, pad_token_id: int):
        self.cfg, self.pad_token_id = cfg, pad_token_id

    def generate(self, model, prompts: list[list[int]], **settings) -> Rollout:
        cfg = self.cfg
        # --rollout-slots 0 is a slot for every sequence (slots=None)
        with distributed.gathered(model), precision.autocast(cfg.sampler_precision, cfg.device):
            return sampler.generate(model, prompts, cfg.max_response_len, **settings,
                                    pad_token_id=self.pad_token_id,
                                    slots=cfg.rollout_slots or None, compile=cfg.compile)

    def updating(self, model):
        """Around the policy update: this engine reads the policy's own weights, so nothing to
        do (an engine with weights of its own takes the new ones after it)."""
        return contextlib.nullcontext()


class VLLMRollout:
    """--rollout-engine vllm behind SamplerRollout's two methods: the token lists of `vllm` (an
    infra/vllm_engine.VLLMEngine) become the sampler's Rollout, and around each policy update the
    engine sleeps (on a GPU), then takes the new weights."""

    def __init__(self, cfg: Config, vllm, pad_token_id: int):
        self.cfg, self.vllm, self.pad_token_id = cfg, vllm, pad_token_id

    def generate(self, model, prompts: list[list[int]], **settings) -> Rollout:
        sampled = self.vllm.generate(model, prompts, self.cfg.max_response_len, **settings)
        return Rollout.from_responses(prompts, sampled.token_ids, sampled.logprobs,
                                      sampled.truncated, self.pad_token_id, self.cfg.device)

    def updating(self, model):
        return vllm_engine.updating(self.vllm, model)


def load_sharded(model_dir: str, cfg: Config) -> Transformer:
    """The policy in fp32, sharded with FSDP2 (bf16 compute with --precision bf16), without any
    rank ever holding the whole model (a 32B's fp32 weights are 131 GB): built on the meta
    device, sharded, then each rank reads its own rows of every weight from the safetensors
    files."""
    model_cfg = ModelConfig.from_json(need_file(model_dir, "config.json"))
    with torch.device("meta"):
        model = Transformer(model_cfg)
    distributed.shard(model, mixed_precision=cfg.precision == "bf16")
    model.to_empty(device=cfg.device)
    # each rank reads only the rows of every weight that it holds
    with torch.no_grad():
        hf_io.load_rows_into(model_dir, distributed.local_rows(model), cfg.device,
                             skip=hf_io.tied_keys(model_cfg))
    model.inv_freq = rope_inv_freq(model.config, cfg.device)
    health.check_finite(model, f"loading {model_dir}")  # every rank stops, naming the weight
    return model


def check_lengths(cfg: Config, model_cfg: ModelConfig, config_json: str | None):
    """A prompt and its response must fit the positions of model_cfg, read from config_json (None:
    the demo's), before anything is written (RoPE past its trained range gives garbage,
    silently)."""
    limit = model_cfg.max_position_embeddings
    source = f"{config_json} (max_position_embeddings)" if config_json else "the demo model"
    total = cfg.max_prompt_len + cfg.max_response_len
    if total > limit:
        raise UserError(f"--max-prompt-len {cfg.max_prompt_len} + --max-response-len "
                        f"{cfg.max_response_len} = {total} tokens, more than the {limit} "
                        f"positions of {source}: lower --max-prompt-len or --max-response-len")


def load_data(cfg: Config, tok, verifier: Verifier) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows: DAPO-Math-17k / AIME-2024 files, or the toy task's splits.
    Every row of a file is checked now (the verifier has a scorer for it, a prompt that renders
    and encodes), not when a step first draws it."""
    if cfg.model and not cfg.train_data and not cfg.eval_only:
        distributed.say(f"warning: --model {cfg.model} without --train-data trains on the demo's "
                        "toy sums (pass --train-data, e.g. DAPO-Math-17k's parquet file)")
    if cfg.train_data:
        train_rows = load_rows(cfg.train_data, tok, rewarded=verifier.rewards,
                               known_data_sources=verifier.built_in_data_sources())
    else:
        train_rows = demo().toy_rows(20000, seed=cfg.seed, split="train")
    if cfg.val_data:
        val_rows = load_rows(cfg.val_data, tok, rewarded=verifier.rewards,
                             known_data_sources=verifier.built_in_data_sources())
    else:
        val_rows = demo().toy_rows(1000, seed=cfg.seed, split="test")
    if not cfg.eval_only and len(train_rows) < cfg.gen_batch_prompts:
        raise UserError(f"{cfg.train_data}: {len(train_rows)} usable rows, fewer than "
                        f"{cfg.gen_batch_flag} {cfg.gen_batch_prompts} (the prompts of one "
                        "generation batch)")
    val_rows = val_rows[:cfg.eval_prompts or None]
    # one call on the ground truth of a row it will score: a wrong signature stops the run now
    scored = (row for row in ([] if cfg.eval_only else train_rows) + val_rows
              if verifier.verifies_with_reward_fn(row["data_source"]))
    if example := next(scored, None):
        verifier.check(example["reward_model"]["ground_truth"])
    return train_rows, val_rows


def load_verifier(cfg: Config) -> Verifier:
    """The run's verifier: the built-in ones, and --reward-fn's function, imported once on every
    rank, before the weights load and the data (whose rows it may be the verifier of)."""
    if not cfg.reward_fn:
        return Verifier()
    return Verifier.load(cfg.reward_fn, cfg.reward_fn_all_rows, cfg.reward_timeout)


@contextlib.contextmanager
def user_errors_in_one_line():
    """Around the command line's run: a user's mistake (a UserError, whose message names the flag
    or the file and what to do) is one line `error: ...` from rank 0, exit status 2
    (infra/distributed.fail); a Ctrl-C that stops at once (infra/interrupt.py) one line, exit
    status 130. Any other exception is a bug and keeps its traceback."""
    try:
        yield
    except UserError as e:
        distributed.fail(str(e))
    except KeyboardInterrupt:  # a Ctrl-C before the loop, or a second one in it
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        raise SystemExit(130) from None
    except SystemExit as e:
        # a run stopped by a signal (130, 143) or stuck (1) exits with that status
        distributed.exit_after_shutdown(e.code if isinstance(e.code, int) else
                                        0 if e.code is None else 1)
        raise
