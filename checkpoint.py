"""
Training checkpoints: data, not code, written so that a crash at any moment leaves the previous one intact.

    out_dir/checkpoints/step_000040/model/            a Hugging Face model directory (config.json, safetensors,
                                                      tokenizer files): transformers, vLLM and dapo.py load it
    out_dir/checkpoints/step_000040/trainer.json      step, data-iterator position, config, world size
    out_dir/checkpoints/step_000040/trainer_rank0.pt  optimizer state (this rank's shard under FSDP), RNG states:
                                                      tensors and numbers only, read with torch.load(weights_only=True)
    out_dir/checkpoints/latest                        the name of the newest complete checkpoint

Everything is written into step_N.tmp/ and renamed to step_N/ once complete; `latest` is replaced atomically after.
Under FSDP, rank 0 writes the full model and every rank its own optimizer shard (resume needs the same world size;
the model directory itself loads anywhere). Several nodes need a shared filesystem for out_dir.
"""
import json
import os
import shutil

import torch

import distributed
from model import save_hf_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json")


def save(out_dir, step, model, tok_dir, opt, prompt_iter, generator, config: dict) -> str:
    rank, world = distributed.rank(), distributed.world_size()
    final = os.path.join(out_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    weights = distributed.full_state_dict(model)  # a collective under FSDP: every rank takes part
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the remains of a save that crashed
        save_hf_checkpoint(weights, model.config, os.path.join(tmp, "model"))
        for name in TOKENIZER_FILES:  # a self-contained model directory: --eval-only --model can point at it
            if os.path.isfile(os.path.join(tok_dir, name)):
                shutil.copyfile(os.path.join(tok_dir, name), os.path.join(tmp, "model", name))
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump({"step": step, "world_size": world, "data": prompt_iter.state_dict(), "config": config}, f,
                      indent=1)
    distributed.barrier()
    torch.save({"optimizer": distributed.local_optimizer_state(opt), "generator": generator.get_state(),
                "torch_rng": torch.get_rng_state()}, os.path.join(tmp, f"trainer_rank{rank}.pt"))
    distributed.barrier()
    if rank == 0:
        if os.path.isdir(final):  # saving the same step again (a resumed run): swap, then delete the old one
            os.replace(final, final + ".old")
        os.replace(tmp, final)
        _write_atomic(os.path.join(out_dir, "checkpoints", "latest"), os.path.basename(final))
        shutil.rmtree(final + ".old", ignore_errors=True)
    distributed.barrier()
    return final


def _write_atomic(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def latest(out_dir) -> str:
    pointer = os.path.join(out_dir, "checkpoints", "latest")
    if not os.path.isfile(pointer):
        raise FileNotFoundError(f"--resume: no checkpoint under {out_dir} ({pointer} does not exist)")
    with open(pointer) as f:
        return os.path.join(out_dir, "checkpoints", f.read().strip())


def load_trainer_state(ckpt, opt, prompt_iter, generator) -> int:
    """Restore the optimizer, the data position and the RNG states; returns the step to continue from."""
    with open(os.path.join(ckpt, "trainer.json")) as f:
        meta = json.load(f)
    if meta["world_size"] != distributed.world_size():
        raise ValueError(f"{ckpt} was written by {meta['world_size']} processes; resuming it needs the same number "
                         f"(this run has {distributed.world_size()}). Its model/ directory loads anywhere.")
    state = torch.load(os.path.join(ckpt, f"trainer_rank{distributed.rank()}.pt"), weights_only=True)  # no code runs
    distributed.load_local_optimizer_state(opt, state["optimizer"])
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    prompt_iter.load_state_dict(meta["data"])
    return meta["step"]
