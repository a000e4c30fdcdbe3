"""checkpoint.py in one process: no NaN ever saved, a full disk loses nothing, old checkpoints
pruned, and the run directory: a new run never destroys an old one, a resume drops the metrics it
will log again and keeps the algorithm."""
import errno
import itertools
import json
import os
import re
import shutil
import struct
import zipfile

import pytest
import torch

from config import Config, check_flags
from data import PromptIterator
from infra import checkpoint, files, health, hf_io, metrics
from infra.errors import UserError
from model import Transformer, preset


def save(out_dir, step, model, tok_dir, keep_last=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return checkpoint.save(str(out_dir), step, model, tok_dir, opt,
                           PromptIterator([{"x": 1}], 1, 0), torch.Generator(), {"lr": 1e-3},
                           keep_last=keep_last)


def listing(out_dir):
    return sorted(os.listdir(out_dir / "checkpoints"))


@pytest.fixture
def model(tiny_model_dir):
    return Transformer.from_pretrained(tiny_model_dir)


# --- non-finite weights ---------------------------------------------------------------------------

def test_check_finite_names_the_first_parameter_with_a_nan(model):
    health.check_finite(model, "after step 1")  # finite: nothing happens
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.bias[2] = float("nan")
        model.model.norm.weight[0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"after step 7: parameter "
                                                 r"'model\.layers\.1\.self_attn\.k_proj\.bias' "
                                                 r"holds 1 NaN and 0 inf value\(s\)"):
        health.check_finite(model, "after step 7")


def test_a_checkpoint_with_a_nan_is_never_written(tmp_path, model, tiny_model_dir):
    save(tmp_path, 1, model, tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight[5, 5] = float("nan")  # tied: the embedding is the same tensor
    with pytest.raises(FloatingPointError, match=r"not saving checkpoint step 2: parameter "
                                                 r"'model\.embed_tokens\.weight' holds 1 NaN"):
        save(tmp_path, 2, model, tiny_model_dir)
    assert listing(tmp_path) == ["latest", "step_000001"]


# --- a full disk ----------------------------------------------------------------------------------

def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def torch_save_on_a_full_disk(*args, **kwargs):
    # what torch.save says
    raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 64 vs 0")


@pytest.mark.parametrize("target,fake,file", [
    (hf_io, "save_file", r"step_000002\.tmp/\.tmp-ckpt-\w+/model\.safetensors"),
    (checkpoint.torch, "save", r"step_000002\.tmp/trainer_rank0\.pt"),
], ids=["weights", "optimizer"])
def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(
        tmp_path, model, tiny_model_dir, monkeypatch, target, fake, file):
    save(tmp_path, 1, model, tiny_model_dir)
    monkeypatch.setattr(target, fake,
                        no_space if fake == "save_file" else torch_save_on_a_full_disk)
    with pytest.raises(UserError, match=rf"could not write .*{file}: the disk is full .*Checkpoint "
                                        r"step 2 not saved \(latest still names step_000001\)"):
        save(tmp_path, 2, model, tiny_model_dir)
    monkeypatch.undo()
    # no half-written step_000002.tmp left taking space
    assert listing(tmp_path) == ["latest", "step_000001"]
    assert checkpoint.latest(str(tmp_path)).endswith("step_000001")
    Transformer.from_pretrained(str(tmp_path / "checkpoints" / "step_000001" / "model"))


@pytest.mark.parametrize("resume", [True, False])
def test_an_out_dir_on_a_full_disk_is_named_and_its_checkpoint_kept(tmp_path, model, tiny_model_dir,
                                                                    monkeypatch, resume):
    # before: "OSError: [Errno 28] No space left on device" from writing the lock file's pid (the
    # writability probe, an empty file, needs no space)
    save(tmp_path, 1, model, tiny_model_dir)
    monkeypatch.setattr(files.os, "pwrite", no_space)
    with pytest.raises(UserError, match=rf"^could not write {tmp_path}/run\.lock: the disk is "
                                        r"full \(OSError: \[Errno 28\] No space left on device\)$"):
        checkpoint.prepare_out_dir(str(tmp_path), resume=resume, overwrite=not resume)
    monkeypatch.undo()
    assert listing(tmp_path) == ["latest", "step_000001"]
    assert checkpoint.latest(str(tmp_path)).endswith("step_000001")


def test_checkpoint_files_are_readable_and_synced_before_the_rename(tmp_path, model, tiny_model_dir,
                                                                    monkeypatch):
    events = []
    fsync, replace = files.fsync, os.replace
    monkeypatch.setattr(files, "fsync", lambda p: (events.append(("fsync", p)), fsync(p)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", a)), replace(a, b)))
    final = save(tmp_path, 1, model, tiny_model_dir)
    tmp = final + ".tmp"
    last_sync_of_tmp = max(i for i, e in enumerate(events) if e == ("fsync", tmp))
    assert (events.index(("fsync", os.path.join(tmp, "trainer_rank0.pt")))
            < last_sync_of_tmp < events.index(("rename", tmp)))
    assert os.stat(os.path.join(final, "model", "model.safetensors")).st_mode & 0o777 == 0o644
    assert "tokenizer.json" in os.listdir(os.path.join(final, "model"))  # --model can point at it


# --- a kill at any moment of a save ---------------------------------------------------------------

class Killed(BaseException):
    """The process killed here: a BaseException, which no `except` of the save catches."""


# what a save does to the disk, each a moment a kill can come (os and torch patched for one save)
FILESYSTEM_OPERATIONS = [(os, "replace"), (shutil, "rmtree"), (files, "fsync"),
                         (files, "write_json"), (files, "write_atomic"),
                         (checkpoint, "save_hf_checkpoint"), (torch, "save")]


def save_killed_at(out_dir, step, model, tok_dir, kill_at: int) -> bool:
    """Save checkpoint `step` (keeping 1) with the process killed at its kill_at-th filesystem
    operation (a deletion killed halfway: one file gone) -> whether it was killed (False: the save
    has fewer operations)."""
    done = 0

    def killable(name, real):
        def operation(*args, **kwargs):
            nonlocal done
            done += 1
            if done == kill_at:
                if name == "rmtree" and os.path.isdir(args[0]):  # a deletion half done
                    os.remove(next(os.path.join(d, f[0]) for d, _, f in os.walk(args[0]) if f))
                raise Killed
            return real(*args, **kwargs)
        return operation

    with pytest.MonkeyPatch.context() as patch:
        for module, name in FILESYSTEM_OPERATIONS:
            patch.setattr(module, name, killable(name, getattr(module, name)))
        try:
            save(out_dir, step, model, tok_dir, keep_last=1)
        except Killed:
            return True
    return False


def resume_step(out_dir) -> int:
    """What the next start does (leftovers deleted, `latest` checked complete) -> its step."""
    ckpt = checkpoint.prepare_out_dir(str(out_dir), resume=True, overwrite=False)
    return checkpoint.step_number(os.path.basename(ckpt))


def kill_each_moment(run, model, tok_dir):
    """For each moment of the save that the next start makes in a copy of run: a copy killed
    there and started again (what it saves: the step after the one it resumes)."""
    for moment in itertools.count(1):
        killed = run.with_name(f"{run.name}-{moment}")
        shutil.copytree(run, killed)
        if not save_killed_at(killed, resume_step(killed) + 1, model, tok_dir, moment):
            return
        resume_step(killed)  # `latest` names a complete checkpoint (or this raises)
        yield killed


def state(run):
    ckpts = run / "checkpoints"
    return tuple(sorted(os.listdir(ckpts))), (ckpts / "latest").read_text()


def test_any_two_kills_during_saves_leave_a_directory_that_resumes(tmp_path, model,
                                                                   tiny_model_dir, monkeypatch):
    # before: a kill between renaming step_2.tmp and writing `latest`, twice (the resumed run
    # saves step 2 again), left step_2 and step_2.old, and every resume died in the next save:
    # "OSError: Directory not empty: step_2 -> step_2.old"; a step_N.old half deleted stayed
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # a kill, not a power cut: 10x faster
    save(tmp_path / "run", 1, model, tiny_model_dir)
    after_one_kill = {state(run): run for run in kill_each_moment(tmp_path / "run", model,
                                                                   tiny_model_dir)}
    for run in after_one_kill.values():
        for killed in kill_each_moment(run, model, tiny_model_dir):
            step = resume_step(killed)
            save(killed, step + 1, model, tiny_model_dir, keep_last=1)  # and training goes on
            assert resume_step(killed) == step + 1
            assert state(killed) == (("latest", f"step_{step + 1:06d}"), f"step_{step + 1:06d}")
    print(f"{len(after_one_kill)} states after one kill: {list(after_one_kill)}")


def test_keep_last_deletes_old_checkpoints_but_never_the_latest(tmp_path, model, tiny_model_dir):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, model, tiny_model_dir, keep_last=2)
    assert listing(tmp_path) == ["latest", "step_000003", "step_000004"]
    # a run resumed from an older one: `latest` is step 2
    save(tmp_path, 2, model, tiny_model_dir, keep_last=1)
    assert listing(tmp_path) == ["latest", "step_000002", "step_000004"]


def test_a_truncated_optimizer_file_is_named_on_resume(tmp_path, model, tiny_model_dir):
    final = save(tmp_path, 1, model, tiny_model_dir)
    file = os.path.join(final, "trainer_rank0.pt")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"step_000001/trainer_rank0\.pt is truncated or "
                                         r"corrupt \(File is not a zip file\)"):
        checkpoint.load_trainer_state(final, opt, PromptIterator([{"x": 1}], 1, 0),
                                      torch.Generator())


def flip_tensor_bytes(file, count: int):
    """Invert `count` bytes in the middle of the largest tensor of a torch.save file (a zip), as a
    bad disk or copy would."""
    with zipfile.ZipFile(file) as archive:
        entry = max(archive.infolist(), key=lambda e: e.file_size)
    with open(file, "r+b") as f:
        f.seek(entry.header_offset + 26)  # the local header: the name's and the extra's lengths
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(entry.header_offset + 30 + name_len + extra_len + (entry.file_size - count) // 2)
        data = f.read(count)
        f.seek(-count, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


def test_flipped_bytes_in_the_optimizer_file_are_named_on_resume(tmp_path, model,
                                                                 tiny_model_dir):
    # before: 2,000 bytes flipped in the optimizer's tensors loaded silently (torch.load checks
    # no CRC-32) and the run trained on a garbage optimizer state
    for step in (1, 2):
        final = save(tmp_path, step, model, tiny_model_dir)
    flip_tensor_bytes(os.path.join(final, "trainer_rank0.pt"), 2000)
    torch.load(os.path.join(final, "trainer_rank0.pt"), weights_only=True)  # not a word
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(UserError, match=r"^--resume: .*step_000002/trainer_rank0\.pt is "
                                        r"truncated or corrupt \(its entry trainer_rank0/data/"
                                        r"\d+ does not match its CRC-32\): not loaded\. "
                                        r"step_000001 is complete: to resume from it"):
        checkpoint.load_trainer_state(final, opt, PromptIterator([{"x": 1}], 1, 0),
                                      torch.Generator())



def cut_in_half(file):
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


@pytest.mark.parametrize("broken,problem", [
    ("trainer_rank0.pt", r"trainer_rank0\.pt is missing"),
    ("model/model.safetensors", r"model\.safetensors is truncated or corrupt"),
    ("trainer.json", r"trainer\.json: not valid JSON"),
    ("model/tokenizer.json", r"tokenizer\.json: not valid JSON"),
])
def test_a_broken_latest_checkpoint_names_the_earlier_complete_one(tmp_path, model,
                                                                   tiny_model_dir, broken,
                                                                   problem):
    for step in (2, 3, 4):
        save(tmp_path, step, model, tiny_model_dir)
    cut_in_half(tmp_path / "checkpoints" / "step_000003" / "trainer_rank0.pt")
    latest = tmp_path / "checkpoints" / "step_000004"
    if broken.endswith(".pt"):
        os.remove(latest / broken)
    else:
        cut_in_half(latest / broken)
    with pytest.raises(UserError, match=rf"step_000004, which is not a complete "
                       rf"checkpoint: .*{problem}.*step_000002 is complete: to resume from it, "
                       r"remove .*step_000004 and write step_000002 into .*latest"):
        checkpoint.prepare_out_dir(str(tmp_path), resume=True, overwrite=False)


def test_a_broken_only_checkpoint_says_to_start_again(tmp_path, model, tiny_model_dir):
    cut_in_half(os.path.join(save(tmp_path, 1, model, tiny_model_dir), "trainer_rank0.pt"))
    with pytest.raises(UserError, match=r"trainer_rank0\.pt is truncated or corrupt\. No "
                                        r"earlier checkpoint is complete: .*--overwrite"):
        checkpoint.latest(str(tmp_path))

# --- the run directory ----------------------------------------------------------------------------

def test_a_new_run_refuses_a_directory_that_holds_one(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(UserError, match=rf"{tmp_path} already holds a run "
                                        r"\(metrics.jsonl\): pass --resume .*or --overwrite"):
        checkpoint.prepare_out_dir(str(tmp_path), resume=False, overwrite=False)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


def test_overwrite_deletes_the_old_runs_metrics_and_checkpoints_only(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    assert checkpoint.prepare_out_dir(str(tmp_path), resume=False, overwrite=True) is None
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "run.lock", "tokenizer"]


def test_a_fresh_or_empty_directory_needs_no_flag(tmp_path):
    assert checkpoint.prepare_out_dir(str(tmp_path / "new"), resume=False, overwrite=False) is None
    assert os.path.isdir(tmp_path / "new")
    # a run that stopped before logging anything
    (tmp_path / "new" / "metrics.jsonl").write_text("")
    assert checkpoint.prepare_out_dir(str(tmp_path / "new"), resume=False, overwrite=False) is None


def test_a_run_that_logged_only_its_settings_needs_no_flag(tmp_path):
    # a run begins metrics.jsonl with its settings: one that died before its first step or
    # evaluation has nothing to lose (the next run replaces that row)
    settings = json.dumps({"step": 0, "config": {"seed": 0}}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(settings)
    assert checkpoint.prepare_out_dir(str(tmp_path), resume=False, overwrite=False) is None
    (tmp_path / "metrics.jsonl").write_text(settings + '{"step": 0, "val/acc": 0.5}\n')
    with pytest.raises(UserError, match="already holds a run"):
        checkpoint.prepare_out_dir(str(tmp_path), resume=False, overwrite=False)


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(UserError, match=rf"--resume: {tmp_path} holds no checkpoint to "
                                        r"continue from"):
        checkpoint.prepare_out_dir(str(tmp_path), resume=True, overwrite=False)
    with pytest.raises(ValueError, match="--resume .* --overwrite"):  # refused with the flags
        check_flags(Config(resume=True, overwrite=True))


def test_resume_returns_the_latest_checkpoint(tmp_path, model, tiny_model_dir):
    final = save(tmp_path, 3, model, tiny_model_dir)
    assert checkpoint.prepare_out_dir(str(tmp_path), resume=True, overwrite=False) == final


def test_trim_metrics_drops_the_rows_a_resumed_run_logs_again(tmp_path):
    # logged: eval 0, steps 1-2, eval at 2, step 3 (its checkpoint never written: a crash), and a
    # torn last line
    rows = [{"step": 0, "val/acc": 0.1}, {"step": 1, "acc": 0.2}, {"step": 2, "acc": 0.3},
            {"step": 2, "val/acc": 0.4}, {"step": 3, "acc": 0.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "ac')
    assert checkpoint.trim_metrics(str(path), 2) == 3
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    assert checkpoint.trim_metrics(str(path), 2) == 0  # nothing more to drop
    assert checkpoint.trim_metrics(str(tmp_path / "none.jsonl"), 2) == 0


def test_trim_metrics_names_a_broken_line_in_the_middle(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": \n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON row"):
        checkpoint.trim_metrics(str(path), 2)


def test_resume_refuses_settings_that_change_the_algorithm(tmp_path):
    saved = {"group_size": 8, "lr": 3e-4, "eps_high": 0.28, "steps": 40, "eval_every": 10,
             "train_data": "a.jsonl"}
    current = {**saved, "group_size": 16, "lr": 1e-3, "steps": 80, "eval_every": 5, "new_flag": 1}
    with pytest.raises(ValueError, match=r"--resume: ckpt was trained with other settings") as e:
        checkpoint.check_resume_config(saved, current, where="ckpt")
    assert "--group-size: 8 in the checkpoint, 16 now" in str(e.value)
    assert "--lr: 0.0003 in the checkpoint, 0.001 now" in str(e.value)
    assert "steps" not in str(e.value) and "eval" not in str(e.value)  # these may change
    checkpoint.check_resume_config(saved, {**saved, "steps": 80, "device": "cuda",
                                           "micro_batch_size": 2})


def test_the_saved_config_is_read_back_from_the_checkpoint(tmp_path, model, tiny_model_dir):
    final = save(tmp_path, 1, model, tiny_model_dir)
    assert checkpoint.saved_config(final) == {"lr": 1e-3}


# --- one run per directory (issue 25) -------------------------------------------------------------

_HOLD_THE_DIRECTORY = """
import sys, time
from infra import checkpoint
checkpoint.prepare_out_dir(sys.argv[1], resume=False, overwrite=False)
print("held", flush=True)
time.sleep(60)
"""


def test_overwrite_refuses_a_directory_whose_run_is_alive_naming_its_pid(tmp_path):
    import subprocess
    import sys
    run = subprocess.Popen([sys.executable, "-c", _HOLD_THE_DIRECTORY, str(tmp_path)],
                           stdout=subprocess.PIPE, text=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert run.stdout.readline() == "held\n"
        (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
        for resume, overwrite in [(False, True), (True, False), (False, False)]:
            with pytest.raises(UserError, match=rf"{tmp_path} is in use by a live run "
                                                rf"\(pid {run.pid}, "):
                checkpoint.prepare_out_dir(str(tmp_path), resume=resume, overwrite=overwrite)
        assert (tmp_path / "metrics.jsonl").exists()  # nothing deleted
    finally:
        run.kill()
        run.wait()
    # a run that died (killed: no clean-up ran) leaves no stuck lock
    assert checkpoint.prepare_out_dir(str(tmp_path), resume=False, overwrite=True) is None


def test_a_new_run_or_a_resume_deletes_stale_temporaries_of_an_interrupted_save(
        tmp_path, model, tiny_model_dir):
    save(tmp_path, 1, model, tiny_model_dir)
    stale = tmp_path / "checkpoints" / "step_000002.tmp"
    (stale / "model").mkdir(parents=True)
    checkpoint.prepare_out_dir(str(tmp_path), resume=True, overwrite=False)
    assert not stale.exists()
    assert (tmp_path / "checkpoints" / "step_000001").is_dir()


def test_a_truncated_trainer_json_is_named(tmp_path, model, tiny_model_dir):
    final = save(tmp_path, 1, model, tiny_model_dir)
    meta = os.path.join(final, "trainer.json")
    with open(meta) as f:
        text = f.read()
    with open(meta, "w") as f:
        f.write(text[:len(text) // 2])
    with pytest.raises(ValueError, match=rf"{meta}: not valid JSON"):
        checkpoint.saved_config(final)


# --- what a resume trusts (issue 46) --------------------------------------------------------------

@pytest.mark.parametrize("pointer", ["absolute", "../../other/checkpoints/step_000001", "foo", ""])
def test_a_latest_naming_anything_but_a_step_of_this_run_is_refused_naming_the_file(
        tmp_path, model, tiny_model_dir, pointer):
    # another run beside this one: following a path in `latest` would resume its checkpoint
    other = save(tmp_path / "other", 1, model, tiny_model_dir)
    run = tmp_path / "run"
    save(run, 2, model, tiny_model_dir)
    text = other if pointer == "absolute" else pointer
    (run / "checkpoints" / "latest").write_text(text)
    with pytest.raises(ValueError, match=rf"--resume: {run}/checkpoints/latest holds "
                                         rf"{re.escape(repr(text))}, not the name of a checkpoint "
                                         r"of this run .*step_000002 is complete: to resume from "
                                         r"it, write step_000002 into"):
        checkpoint.prepare_out_dir(str(run), resume=True, overwrite=False)


def saved_after_one_step(out_dir, model, tok_dir):
    """A checkpoint whose optimizer holds state (AdamW's exp_avg, exp_avg_sq) for every
    parameter."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # a gradient without a forward (the handout lacks rope)
        p.grad = torch.ones_like(p)
    opt.step()
    return checkpoint.save(str(out_dir), 1, model, tok_dir, opt,
                           PromptIterator([{"x": 1}], 1, 0), torch.Generator(), {})


@pytest.mark.parametrize("change,error", [
    (dict(intermediate_size=96), r"optimizer state 'exp_avg' of parameter "
                                 r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
                                 r"\(128, 64\), the parameter \(96, 64\)"),
    (dict(num_hidden_layers=1), r"optimizer state of 26 parameters, the model has 14"),
], ids=["a-shape", "a-count"])
def test_optimizer_state_that_does_not_fit_the_model_is_named_at_load(
        tmp_path, model, tiny_model_dir, change, error):
    # as a checkpoint whose model/ was replaced by another model's: before, it loaded, ran a whole
    # rollout and died in opt.step() with "The size of tensor a (384) must match ... (512)"
    final = saved_after_one_step(tmp_path, model, tiny_model_dir)
    other = Transformer(preset("tiny", vocab_size=model.config.vocab_size, **change))
    opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=rf"step_000001/trainer_rank0\.pt: {error}"):
        checkpoint.load_trainer_state(final, opt, PromptIterator([{"x": 1}], 1, 0),
                                      torch.Generator(), other)
    # the model it was saved with loads it
    checkpoint.load_trainer_state(final, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  PromptIterator([{"x": 1}], 1, 0), torch.Generator(), model)


RAN = []


def _payload():
    RAN.append("the payload ran")


class Planted:
    def __reduce__(self):
        return _payload, ()


def test_an_optimizer_file_holding_code_is_named_and_not_run(tmp_path, model, tiny_model_dir):
    final = save(tmp_path, 1, model, tiny_model_dir)
    file = os.path.join(final, "trainer_rank0.pt")
    torch.save({"optimizer": Planted()}, file)
    with pytest.raises(ValueError, match=rf"{file}: holds objects other than tensors and "
                                         r"numbers.*torch says: Weights only load failed") as e:
        checkpoint.load_trainer_state(final, torch.optim.AdamW(model.parameters()),
                                      PromptIterator([{"x": 1}], 1, 0), torch.Generator())
    assert "weights_only=False" not in str(e.value) and RAN == []


def test_a_resume_on_other_rows_of_the_same_size_is_refused(tmp_path, model, tiny_model_dir):
    rows = [{"prompt": f"{k} + 1?", "answer": str(k + 1)} for k in range(4)]
    opt = torch.optim.AdamW(model.parameters())
    final = checkpoint.save(str(tmp_path), 1, model, tiny_model_dir, opt,
                            PromptIterator(rows, 2, 0), torch.Generator(), {})
    swapped = rows[:3] + [{"prompt": "3 + 1?", "answer": "5"}]  # one answer differs
    with pytest.raises(ValueError, match=rf"--resume: {final}/trainer\.json: prompt iterator "
                                         r"state is for rows_sha256=\w+, this run has "
                                         r"rows_sha256=\w+ \(a resume needs the same data"):
        checkpoint.load_trainer_state(final, opt, PromptIterator(swapped, 2, 0), torch.Generator())
    checkpoint.load_trainer_state(final, opt, PromptIterator(rows, 2, 0), torch.Generator())


def test_overwrite_empties_a_checkpoints_directory_that_is_a_link(tmp_path):
    # checkpoints/ on another disk: rmtree refuses a link, and with ignore_errors deleted nothing
    elsewhere = tmp_path / "big-disk" / "run-checkpoints"
    (elsewhere / "step_000001").mkdir(parents=True)
    (elsewhere / "latest").write_text("step_000001")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(elsewhere, run / "checkpoints")
    assert checkpoint.prepare_out_dir(str(run), resume=False, overwrite=True) is None
    assert os.path.islink(run / "checkpoints") and os.listdir(elsewhere) == []


def a_finished_run(out_dir):
    """A run's directory: metrics.jsonl, and checkpoint step 3 with its model/."""
    model_dir = out_dir / "checkpoints" / "step_000003" / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    (out_dir / "checkpoints" / "latest").write_text("step_000003")
    (out_dir / "metrics.jsonl").write_text('{"step": 3}\n')
    return model_dir


@pytest.mark.parametrize("flag,inside", [
    ("--model", "checkpoints/step_000003/model"),  # train on from a run's model, new settings
    ("--train-data", "checkpoints/rows.jsonl"),
    ("--val-data", "metrics.jsonl"),
    ("--reward-fn", "checkpoints/step_000003/score.py"),
])
def test_overwrite_refuses_to_delete_a_file_the_run_reads(tmp_path, flag, inside):
    a_finished_run(tmp_path)
    (tmp_path / inside).touch()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError, match=rf"^{flag} {tmp_path / inside} lies in {tmp_path}, in "
                                        r"what --overwrite deletes \(its checkpoints/ and "
                                        r"metrics.jsonl\): copy it out first"):
        checkpoint.prepare_out_dir(str(tmp_path), resume=False, overwrite=True,
                                   inputs={flag: str(tmp_path / inside)})
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_overwrite_refuses_a_model_reached_through_a_checkpoints_link(tmp_path):
    elsewhere = tmp_path / "big-disk"
    model_dir = a_finished_run(elsewhere)  # elsewhere/checkpoints/step_000003/model
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(elsewhere / "checkpoints", run / "checkpoints")
    with pytest.raises(UserError, match="--model .* lies in"):
        checkpoint.prepare_out_dir(str(run), resume=False, overwrite=True,
                                   inputs={"--model": str(model_dir)})
    assert (model_dir / "config.json").is_file()


def test_overwrite_deletes_a_step_link_but_keeps_the_model_it_points_to(tmp_path):
    kept = a_finished_run(tmp_path / "kept")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    os.symlink(kept.parent, run / "checkpoints" / "step_000003")
    linked = run / "checkpoints" / "step_000003" / "model"
    assert checkpoint.prepare_out_dir(str(run), resume=False, overwrite=True,
                                      inputs={"--model": str(linked)}) is None
    assert not (run / "checkpoints").exists() and (kept / "config.json").is_file()


# --- metrics.jsonl --------------------------------------------------------------------------------

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_full_disk_while_logging_names_the_metrics_file():
    # /dev/full fails every write with ENOSPC, as a full disk does
    with pytest.raises(UserError, match=r"could not write /dev/full: the disk is full"):
        metrics.RunLog("/dev/full", 0, 1).write({"step": 1, "rollout/acc": 0.5})


def test_a_nan_metric_is_written_as_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = metrics.RunLog(str(path), 0, 1)
    log.write({"step": 1, "actor/grad_norm": float("nan"), "x": float("-inf"), "acc": 0.5})

    def strict(constant):  # what jq, JavaScript and other strict readers do with NaN
        raise ValueError(f"not JSON: {constant}")
    row = json.loads(path.read_text(), parse_constant=strict)
    assert row == {"step": 1, "actor/grad_norm": None, "x": None, "acc": 0.5}


def test_a_resume_on_the_same_rows_at_another_path_says_so_and_goes_on(capsys):
    # before: refused as a change of the algorithm; the rows' sha256 (above) guards the content
    saved = {"group_size": 8, "train_data": "data/a.jsonl"}
    checkpoint.check_resume_config(saved, {**saved, "train_data": "/mnt/moved/a.jsonl"},
                                   where="ckpt")
    assert capsys.readouterr().out == ("note: --resume: ckpt was trained on --train-data "
                                       "'data/a.jsonl', this run reads '/mnt/moved/a.jsonl' "
                                       "(the rows must be the same: their sha256 is checked)\n")


def test_a_torn_row_of_the_checkpointed_step_is_said_to_be_lost(tmp_path, capsys):
    # before: the crash cut the row of step 2 short after checkpoint step 2 was saved; the resume
    # dropped it silently and went on from step 3, step 2 missing from metrics.jsonl for good
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rollout/ac')
    assert checkpoint.trim_metrics(str(path), 2) == 1
    assert path.read_text() == '{"step": 1}\n'
    assert capsys.readouterr().out == (f"warning: {path} holds no whole row of step 2, the "
                                       "checkpoint's (its last line was cut short by the crash): "
                                       "the resumed run logs from step 3 on\n")
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rollout/ac')  # a later step: logged
    assert checkpoint.trim_metrics(str(path), 2) == 1                   # again, nothing lost
    assert capsys.readouterr().out == ""
