"""
Training checkpoints: data, not code, written so that a crash at any moment leaves the previous one
intact.

    out_dir/checkpoints/
        step_000040/
            model/            a Hugging Face model directory (config.json, safetensors, tokenizer
                              files): transformers, vLLM and dapo.py load it
            trainer.json      step, data-iterator position, config, world size
            trainer_rank0.pt  optimizer state (this rank's shard under FSDP), RNG states: tensors
                              and numbers only, read with torch.load(weights_only=True)
        latest                the name of the newest complete checkpoint

Everything is written into step_N.tmp/, flushed to disk (fsync) and renamed to step_N/ once
complete; `latest` is replaced atomically after. A checkpoint is deleted (a step a resumed run
saves again, one beyond --keep-checkpoints) by renaming it step_N.old/ first, so a kill at any
moment leaves `latest` naming a complete checkpoint, and nothing the next start does not delete.
A failed write (a full disk) removes step_N.tmp/ and raises on every rank, naming the file;
`latest` still points to the previous checkpoint. A checkpoint never holds a NaN or an inf.
Under FSDP, rank 0 writes the full model and every rank its own optimizer shard (resume needs the
same world size; the model directory itself loads anywhere). Several nodes need a shared
filesystem for out_dir.

The run directory: prepare_out_dir() refuses to start a new run over an old one unless told to,
check_resume_config() a resume that would change the algorithm; resume() restores the trainer's
state and drops the metrics the resumed run will log again.
"""
import itertools
import json
import os
import pickle
import re
import shutil
import zipfile
import zlib

import torch
from safetensors import SafetensorError, safe_open

from infra import distributed, files, health, hub
from infra.errors import UserError
from infra.hf_io import checkpoint_files, save_hf_checkpoint


def save(out_dir, step, model, tok_dir, opt, prompt_iter, generator, config: dict,
         keep_last: int = 0) -> str:
    """Write checkpoint step_N (every rank calls this: the full weights are gathered collectively).
    keep_last > 0 then deletes the oldest complete checkpoints beyond the newest keep_last (never
    the one `latest` names)."""
    rank, world = distributed.rank(), distributed.world_size()
    ckpts = os.path.join(out_dir, "checkpoints")
    final = os.path.join(ckpts, f"step_{step:06d}")
    tmp = final + ".tmp"
    health.check_finite(model, f"not saving checkpoint step {step}")
    weights = distributed.full_state_dict(model)  # a collective under FSDP: every rank takes part
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # the remains of a save that crashed
            # refuses NaN/inf as well; with the tokenizer, a self-contained model directory:
            # --eval-only --model, transformers and vLLM can point at it
            save_hf_checkpoint(weights, model.config, os.path.join(tmp, "model"),
                               tokenizer_dir=tok_dir)
            files.write_json(os.path.join(tmp, "trainer.json"),
                       {"step": step, "world_size": world, "data": prompt_iter.state_dict(),
                        "config": config})
        except (OSError, ValueError) as e:
            error = e
    _raise_together(error, out_dir, tmp, step)
    file = os.path.join(tmp, f"trainer_rank{rank}.pt")
    try:
        with files.writing(file):
            torch.save({"optimizer": distributed.local_optimizer_state(opt),
                        "generator": generator.get_state(),
                        "torch_rng": torch.get_rng_state()}, file)
            files.fsync(file)
    except (OSError, UserError) as e:  # files.writing names the file in a UserError
        error = e
    _raise_together(error, out_dir, tmp, step)
    if rank == 0:
        files.fsync(os.path.join(tmp, "model"))
        # every file and name of the checkpoint is on disk before the rename makes it visible
        files.fsync(tmp)
        # a step_N already there is one a resumed run saves again: `latest` names an earlier
        # step (the one resumed from, or a later one this run saved), so it can go first
        if os.path.lexists(final):
            _discard(final)
        os.replace(tmp, final)
        files.fsync(ckpts)
        files.write_atomic(os.path.join(ckpts, "latest"), os.path.basename(final))
        if keep_last > 0:
            _delete_old(ckpts, keep_last)
    distributed.barrier("checkpoint saved")
    return final


def _raise_together(error, out_dir, tmp, step):
    """A write that failed on one rank fails the save on every rank (the others would otherwise wait
    for it in the next collective until the timeout). The half-written step directory is removed."""
    if not distributed.all_reduce(float(error is not None), "max",
                                  name=f"checkpoint step {step}"):
        return
    if distributed.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    pointer = os.path.join(out_dir, "checkpoints", "latest")
    kept = (f"latest still names {_read(pointer)}" if os.path.isfile(pointer)
            else "there is no earlier one")
    if error is None:
        raise UserError(f"checkpoint step {step} not saved: another rank failed to write "
                        f"its part ({kept})")
    raise UserError(f"{error}. Checkpoint step {step} not saved ({kept})") from error


def _discard(step_dir: str):
    """Delete a checkpoint directory so that a kill at any moment leaves it whole or gone, never
    half-deleted under its name: renamed to step_N.old first (what a killed discard left there
    goes before), then deleted; the next start deletes a step_N.old that remains."""
    trash = step_dir + ".old"
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(step_dir, trash)
    shutil.rmtree(trash)


def _read(path) -> str:
    with open(path) as f:
        return f.read().strip()


def step_number(name: str) -> int | None:
    """N of a directory named step_N, else None."""
    return int(name[5:]) if re.fullmatch(r"step_\d+", name) else None


def step_dirs(ckpts: str) -> list[str]:
    """The names of the step_N directories in ckpts, oldest first."""
    return sorted((n for n in os.listdir(ckpts) if step_number(n) is not None), key=step_number)


def _delete_old(ckpts, keep_last):
    """Delete complete step_N directories beyond the newest keep_last, by step; never the one
    `latest` names."""
    current = _read(os.path.join(ckpts, "latest"))
    for name in step_dirs(ckpts)[:-keep_last]:
        if name != current:
            _discard(os.path.join(ckpts, name))


def latest(out_dir) -> str:
    """The checkpoint `latest` names, checked complete (every file there and readable: the same
    answer on every rank, before any collective, so a broken one fails every rank at once)."""
    pointer = os.path.join(out_dir, "checkpoints", "latest")
    if not os.path.isfile(pointer):
        raise UserError(f"--resume: {out_dir} holds no checkpoint to continue from "
                        f"({pointer} does not exist); start without --resume (with "
                        "--overwrite if the directory holds a run)")
    name = _read(pointer)
    # a path (absolute, or ../other-run/...) would resume another run's checkpoint, silently
    if step_number(name) is None:
        raise UserError(f"--resume: {pointer} holds {name!r}, not the name of a checkpoint of "
                        f"this run (a step_N directory beside it). {_way_back(out_dir)}")
    ckpt = os.path.join(out_dir, "checkpoints", name)
    problem = incomplete(ckpt)
    if problem:
        raise UserError(f"--resume: {pointer} names {ckpt}, which is not a complete "
                        f"checkpoint: {problem}. {_way_back(out_dir, ckpt)}")
    return ckpt


def incomplete(ckpt) -> str | None:
    """What is missing or unreadable in checkpoint directory ckpt, or None. Cheap: reads
    trainer.json, config.json and tokenizer.json (as JSON), and only the headers of the other
    files (a truncated zip lacks its end record, a truncated safetensors file is shorter than its
    header says)."""
    try:
        meta = files.read_json(os.path.join(ckpt, "trainer.json"))
        for rank in range(meta["world_size"]):
            file = os.path.join(ckpt, f"trainer_rank{rank}.pt")
            if not os.path.isfile(file):
                return f"{file} is missing"
            if not zipfile.is_zipfile(file):
                return f"{file} is truncated or corrupt"
        model_dir = os.path.join(ckpt, "model")
        for name in ("config.json", "tokenizer.json"):
            files.read_json(files.need_file(model_dir, name))
        for file in checkpoint_files(model_dir):
            try:
                with safe_open(file, framework="pt"):
                    pass
            except SafetensorError as e:
                return f"{file} is truncated or corrupt ({e})"
    except (OSError, ValueError) as e:
        return str(e)
    except (KeyError, TypeError) as e:
        return f"{os.path.join(ckpt, 'trainer.json')} lacks {e}"
    return None


def _way_back(out_dir, broken: str | None = None) -> str:
    """How to resume from the newest complete checkpoint (before the broken one, if given)."""
    ckpts = os.path.join(out_dir, "checkpoints")
    earlier = [n for n in reversed(step_dirs(ckpts))
               if not broken or step_number(n) < step_number(os.path.basename(broken))]
    for name in earlier:
        if incomplete(os.path.join(ckpts, name)) is None:
            remove = f"remove {broken} and " if broken else ""
            return (f"{name} is complete: to resume from it, {remove}write {name} "
                    f"into {os.path.join(ckpts, 'latest')}")
    return (f"No {'earlier ' if broken else ''}checkpoint is complete: start again with "
            "--overwrite (or restore the missing files)")


def load_trainer_state(ckpt, opt, prompt_iter, generator, model=None) -> int:
    """Restore the optimizer, the data position and the RNG states; returns the step to
    continue from. The optimizer state is checked against the parameters of opt (named by
    model's parameter names, when given) first."""
    meta = files.read_json(os.path.join(ckpt, "trainer.json"))
    if meta["world_size"] != distributed.world_size():
        raise UserError(f"{ckpt} was written by {meta['world_size']} processes; resuming it "
                        f"needs the same number (this run has {distributed.world_size()}). "
                        "Its model/ directory loads anywhere.")
    file = os.path.join(ckpt, f"trainer_rank{distributed.rank()}.pt")
    check_crcs(ckpt)
    try:
        state = torch.load(file, weights_only=True)  # tensors and numbers only: no code runs
    except FileNotFoundError:
        raise
    except (RuntimeError, EOFError, OSError) as e:
        # "PytorchStreamReader failed reading zip archive", EINVAL...
        raise UserError(f"{file}: not a readable checkpoint file, truncated or corrupt "
                        f"(a partial copy?): {e}") from None
    except pickle.UnpicklingError as e:
        # torch's text suggests weights_only=False, which would run whatever code the file holds
        raise UserError(f"{file}: holds objects other than tensors and numbers, which no "
                        "checkpoint of this project writes; not loaded (it could run code). "
                        f"torch says: {str(e).splitlines()[0]}") from None
    check_optimizer_state(state["optimizer"], opt, file, model)
    distributed.load_local_optimizer_state(opt, state["optimizer"])
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    try:
        prompt_iter.load_state_dict(meta["data"])
    except ValueError as e:
        raise UserError(f"--resume: {os.path.join(ckpt, 'trainer.json')}: {e}") from None
    return meta["step"]


def check_crcs(ckpt: str):
    """Raise on every rank, naming the file, when a rank's trainer_rank<r>.pt in ckpt holds bytes
    that do not match the CRC-32 its zip records for them (flipped on a disk or in a copy):
    torch.load checks none, and would train on a garbage optimizer state. Each rank reads its own
    file whole (~3 GB/s), then the ranks agree, so that all stop at once. The model's
    safetensors files record no checksum: a flipped weight is found only as a NaN or an inf."""
    mine = os.path.join(ckpt, f"trainer_rank{distributed.rank()}.pt")
    try:
        with zipfile.ZipFile(mine) as archive:
            bad = archive.testzip()  # the first entry whose CRC-32 does not match, or None
            problem = bad and f"its entry {bad} does not match its CRC-32"
    except (OSError, zipfile.BadZipFile, zlib.error) as e:
        problem = str(e)
    for rank, found in enumerate(distributed.all_gather_object(problem, name="CRC check")):
        if found:
            file = os.path.join(ckpt, f"trainer_rank{rank}.pt")
            out_dir = os.path.dirname(os.path.dirname(ckpt))
            raise UserError(f"--resume: {file} is truncated or corrupt ({found}): not loaded. "
                            f"{_way_back(out_dir, ckpt)}")


def check_optimizer_state(saved: dict, opt, file: str, model=None):
    """Raise naming the file and the tensor when the optimizer state saved in `file` does not fit
    the parameters of opt (this rank's shards under FSDP): another number of parameters, or a
    state tensor (AdamW's exp_avg, exp_avg_sq) of another shape than its parameter. A model/
    directory replaced by another model's would otherwise load, run a whole rollout and die in
    opt.step() naming neither."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    params = [p for group in opt.param_groups for p in group["params"]]
    saved_ids = [i for group in saved["param_groups"] for i in group["params"]]
    if len(saved_ids) != len(params):
        raise UserError(f"{file}: optimizer state of {len(saved_ids)} parameters, the model has "
                        f"{len(params)}: the checkpoint's model/ and its optimizer state are of "
                        "different models")
    for number, (i, p) in enumerate(zip(saved_ids, params)):
        local = distributed.local_shard(p)
        for key, t in saved["state"].get(i, {}).items():
            if torch.is_tensor(t) and t.dim() > 0 and t.shape != local.shape:
                name = names.get(id(p), f"number {number}")
                raise UserError(f"{file}: optimizer state {key!r} of parameter {name!r} has "
                                f"shape {tuple(t.shape)}, the parameter {tuple(local.shape)}: "
                                "the checkpoint's model/ and its optimizer state are of "
                                "different models (was model/ replaced?)")


# --------------------------------------------------------------------------------------------------
# The run directory: start, overwrite or resume

def resume(ckpt, model, opt, prompt_iter, generator, metrics_path: str, steps: int,
           eval_every: int = 0) -> int:
    """Restore the trainer of `model` from checkpoint ckpt and drop the rows of metrics.jsonl
    logged after it was saved that the resumed run logs again -> the step to continue from. A
    checkpoint past --steps, or at it with its final evaluation logged, leaves metrics.jsonl
    whole and says there is nothing to do; at --steps without it (the run stopped during its
    final evaluation), the resumed run evaluates."""
    start = load_trainer_state(ckpt, opt, prompt_iter, generator, model)
    due = final_evaluation_due(metrics_path, start, steps, eval_every)
    if start > steps or (start == steps and not due):
        distributed.say(f"--resume: {ckpt} is at step {start} and --steps is {steps}: nothing to "
                        f"do (pass --steps above {start} to train on)")
        return start
    if start == steps:
        distributed.say(f"--resume: {ckpt} is at --steps {steps}, and its final evaluation was "
                        "never logged (the run stopped during it): evaluating")
    if distributed.rank() == 0:  # the evaluation at `start` stays unless the loop makes it again
        trim_metrics(metrics_path, start,
                     keep_eval=not (start < steps and eval_every and start % eval_every == 0))
    return start


def due(step: int, save_every: int, steps: int) -> bool:
    """Whether the loop saves after `step` steps: every --save-every steps (0: never), and at the
    run's end (--steps)."""
    return bool(save_every and step % save_every == 0) or step == steps


def final_evaluation_due(metrics_path: str, start: int, steps: int, eval_every: int) -> bool:
    """Whether a run from step `start` ends with the evaluation at --steps: every run that trains
    (with --eval-every), and a resumed one at --steps whose metrics.jsonl lacks it (read by rank
    0, agreed by all: under FSDP an evaluation is collective)."""
    if not eval_every or start > steps:
        return False
    if start < steps:
        return True
    rows = files.read_jsonl(metrics_path) if distributed.rank() == 0 and \
        os.path.isfile(metrics_path) else []
    logged = any(isinstance(row, dict) and row.get("step") == steps and _is_evaluation(row)
                 for row in rows)
    return not distributed.all_reduce(float(logged), "max", name="final evaluation logged")


def _is_evaluation(row: dict) -> bool:
    return any(k.startswith("val/") for k in row)


def prepare_out_dir(out_dir: str, resume: bool, overwrite: bool,
                    inputs: dict[str, str] | None = None) -> str | None:
    """Make out_dir ready for a run; returns the checkpoint to resume from (with resume) or None.

    A directory that holds a run (a metrics.jsonl or a checkpoints/ directory, not empty) is never
    reused silently: resume continues it, overwrite deletes its metrics.jsonl and checkpoints/
    (nothing else: a plot, notes, the demo's tokenizer stay) and starts again, and with neither this
    raises, naming the directory and both flags. (config.check_flags refuses both at once.)
    overwrite is refused, before anything is deleted, when one of the files the run reads
    (inputs: {flag: path}) lies in what it would delete.
    Rank 0 owns out_dir for the run's life (files.own_dir): a second run on it, even with
    --overwrite, is refused naming the live one's pid. What a save that was interrupted (a kill)
    left is deleted: step_N.tmp/ (a checkpoint being written) and step_N.old/ (one being
    deleted)."""
    ckpts = os.path.join(out_dir, "checkpoints")
    if overwrite:
        refuse_inputs_inside(out_dir, inputs or {})
    if distributed.rank() == 0:
        files.own_dir(out_dir)
        for name in os.listdir(ckpts) if os.path.isdir(ckpts) else []:
            if re.fullmatch(r"step_\d+\.(tmp|old)", name):
                shutil.rmtree(os.path.join(ckpts, name), ignore_errors=True)
    if resume:
        return latest(out_dir)
    metrics = os.path.join(out_dir, "metrics.jsonl")
    held = [p for p in (metrics, ckpts) if (os.path.isfile(p) and _logged(p)) or
            (os.path.isdir(p) and os.listdir(p))]
    if held and not overwrite:
        raise UserError(f"{out_dir} already holds a run "
                        f"({' and '.join(map(os.path.basename, held))}): pass --resume to "
                        "continue it, or --overwrite to delete its metrics and checkpoints "
                        "and start again (or choose another --out-dir)")
    distributed.barrier("prepare_out_dir")  # every rank has looked before rank 0 deletes anything
    if distributed.rank() == 0:
        if overwrite:
            _empty_checkpoints(ckpts)
            if os.path.isfile(metrics):
                os.remove(metrics)
        os.makedirs(out_dir, exist_ok=True)
    distributed.barrier("prepare_out_dir")
    return None


def _logged(metrics: str) -> bool:
    """Whether metrics.jsonl holds more than the settings a run starts with: a run that died
    before its first step or evaluation has nothing to lose, and the next one replaces them."""
    with open(metrics, encoding="utf-8", errors="replace") as f:
        lines = [line for line in itertools.islice(f, 2) if line.strip()]
    try:
        settings_only = len(lines) == 1 and set(json.loads(lines[0])) == {"step", "config"}
    except (ValueError, TypeError):  # not JSON, not an object: a row of something
        settings_only = False
    return bool(lines) and not settings_only


def refuse_inputs_inside(out_dir: str, inputs: dict[str, str]):
    """--overwrite deletes out_dir's metrics.jsonl and what its checkpoints/ holds (through a
    link, what it points to): refuse when a file the run reads lies there, naming the flag.
    `--model OUT/checkpoints/step_N/model --overwrite` (a run's model, trained on with new
    settings) would otherwise delete the model before it loads. Paths are compared resolved, so
    a step directory that is a link to elsewhere is not refused (only the link is deleted)."""
    deleted = [os.path.realpath(os.path.join(out_dir, name))
               for name in ("checkpoints", "metrics.jsonl")]
    for flag, path in inputs.items():
        where = os.path.realpath(path) if path else None
        if where and any(where == d or where.startswith(d + os.sep) for d in deleted):
            raise UserError(f"{flag} {path} lies in {out_dir}, in what --overwrite deletes "
                            "(its checkpoints/ and metrics.jsonl): copy it out first, or choose "
                            "another --out-dir")


def _empty_checkpoints(ckpts: str):
    """--overwrite: delete the old run's checkpoints. A checkpoints/ that is a link (to a bigger
    disk) stays a link and loses what it points to (rmtree refuses a link, and with
    ignore_errors deleted nothing: the old steps stayed beside the new). A failure raises."""
    if not os.path.isdir(ckpts):
        return
    if not os.path.islink(ckpts):
        shutil.rmtree(ckpts)
        return
    for name in os.listdir(ckpts):
        path = os.path.join(ckpts, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def trim_metrics(path: str, step: int, keep_eval: bool = False) -> int:
    """On resume from checkpoint `step`: keep the rows of metrics.jsonl logged before that
    checkpoint was written, up to and including the first row of `step` (its training row), and drop
    the rest (later steps, and an evaluation logged at `step` after the save), which the resumed run
    logs again. keep_eval: the evaluation at `step` stays, as the resumed run does not make it
    again (the final one of a run that ended at `step`). A crash between logging a step and saving
    its checkpoint would otherwise leave steps [1, 2, 2, 3]. Rewritten atomically; returns the
    rows dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    kept, done, torn = [], False, False
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # the last line, cut short by the crash: the resumed run rewrites it (unless it was
            # the row of `step` itself, said below)
            torn = lineno == len(lines)
            if torn:
                continue
            raise UserError(f"{path}:{lineno}: not a JSON row; fix or remove the line, then "
                            "resume") from None
        s = row.get("step") if isinstance(row, dict) else None
        if done and keep_eval and s == step and _is_evaluation(row):
            kept.append(line)
            keep_eval = False  # one
            continue
        if done or (isinstance(s, (int, float)) and s > step):
            continue
        kept.append(line)
        done = s == step
    if torn and not done:
        distributed.say(f"warning: {path} holds no whole row of step {step}, the checkpoint's "
                        "(its last line was cut short by the crash): the resumed run logs from "
                        f"step {step + 1} on")
    dropped = sum(1 for line in lines if line.strip()) - len(kept)
    if dropped:
        files.write_atomic(path, "".join(line + "\n" for line in kept))
    return dropped


# Flags a resumed run may change: what to run for, where and how often to log (and to which
# trackers), evaluate and save, and memory knobs that change no number beyond rounding
# (micro_batch_size) or which random samples are drawn (rollout_slots), and the time a
# --reward-fn call may take (a call that hangs is what makes one stop and resume), and the path of
# the training rows (moved to another disk: their sha256 must be the same). Every other field
# (group size, lengths, lr, eps, batch sizes, seed, data, the technique switches, and any flag
# added later) changes the algorithm: check_resume_config refuses a change to it.
MAY_CHANGE_ON_RESUME = {
    "steps", "out_dir", "resume", "overwrite", "eval_only", "device", "dist_timeout", "save_every",
    "keep_checkpoints", "eval_every", "eval_samples", "eval_temperature", "eval_top_p",
    "eval_prompts", "val_data",
    "rollout_slots", "compile", "micro_batch_size", "micro_batch_tokens", "fused_head",
    "activation_checkpointing", "report_to", "reward_timeout", "train_data",
}


def saved_config(ckpt: str) -> dict:
    """The config a checkpoint was trained with (trainer.json's "config": asdict of dapo.Config)."""
    return files.read_json(os.path.join(ckpt, "trainer.json"))["config"]


def check_resume_config(saved: dict, current: dict, where: str = "the checkpoint"):
    """Refuse to resume with settings that change the algorithm, naming each changed flag with both
    values. A field the checkpoint does not have (a flag added since) is not compared. A path in
    the Hugging Face cache is compared by its repository, commit and file: the same commit read
    from another cache (HF_HUB_CACHE moved, another node) is the same --model."""
    changed = [f"  --{k.replace('_', '-')}: {saved[k]!r} in the checkpoint, {current[k]!r} now"
               for k in current if k in saved and k not in MAY_CHANGE_ON_RESUME
               and not hub.same_files(saved[k], current[k])]
    if changed:
        raise UserError(f"--resume: {where} was trained with other settings, and these change "
                        "the algorithm:\n" + "\n".join(changed) + "\nResume with the checkpoint's "
                        "values, or start a new run (--overwrite, or another --out-dir).")
    if saved.get("train_data", current.get("train_data")) != current.get("train_data"):
        distributed.say(f"note: --resume: {where} was trained on --train-data "
                        f"{saved['train_data']!r}, this run reads {current['train_data']!r} (the "
                        "rows must be the same: their sha256 is checked)")
