"""
Hugging Face model directories, read and written: config.json plus model.safetensors, or sharded
model-0000K-of-0000N.safetensors files with model.safetensors.index.json, the layout transformers
and vLLM read. model.Transformer.from_pretrained and save_pretrained use these, and so do the
training checkpoints (infra/checkpoint.py), whose model/ directory is such a directory.

Reading checks every key, shape and value against the model being built and names the file at
fault; writing goes to a temporary directory, synced and renamed into place (infra/files.py), so a
crash never leaves half a model directory.
"""
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, fields

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from infra import distributed, files
from infra.errors import UserError


def load_state_dict(path: str, expected: dict, dtype, device, skip=()) -> dict:
    """The tensors of model directory `path`, cast to dtype on device: {key: tensor} for exactly
    the keys of `expected` ({key: shape}); keys in `skip` (a tied head) are ignored. Raises naming
    the file on an unexpected or missing key, a wrong shape, a truncated file or a NaN."""
    state, file_of = {}, {}
    for file, key, tensor in _checked_tensors(path, expected, device, skip):
        state[key], file_of[key] = tensor[:].to(dtype), file
    bad = first_nonfinite(state)
    # a diverged run's weights would train on, reporting nothing but zero informative groups
    if bad:
        raise UserError(f"{file_of[bad]}: {bad!r} holds {count_nonfinite(state[bad])}: "
                        "refusing to load a model with non-finite weights")
    return state


def load_rows_into(path: str, into: dict, device, skip=()):
    """Copy rows of each tensor of model directory `path` into the tensors of `into` ({key:
    (rows: a slice of dim 0, the full shape, destination tensor)}: a rank's FSDP shards, as
    distributed.local_rows gives them), converting the dtype as they are copied. The files are
    memory-mapped and only those rows are read, so a rank never holds more than its shards and
    one key's rows. Checked as load_state_dict, but for the NaN (the caller checks its shards, on
    every rank at once)."""
    expected = {key: shape for key, (_, shape, _) in into.items()}
    for _, key, tensor in _checked_tensors(path, expected, device, skip):
        rows, _, destination = into[key]
        destination.copy_(tensor[rows])


def _checked_tensors(path: str, expected: dict, device, skip):
    """(file, key, its safetensors slice) for each tensor of the directory, each key of
    `expected` once and no other, of its expected shape."""
    seen, skipped_head = set(), None
    for file, keys in checkpoint_files(path).items():
        try:
            with safe_open(file, framework="pt", device=str(device)) as f:
                for key in keys or f.keys():
                    skipped_head = file if key in skip else skipped_head
                    # derived buffers some old checkpoints carry; a tied head some carry anyway
                    if key.endswith("rotary_emb.inv_freq") or key in skip:
                        continue
                    if key not in expected:
                        raise UserError(f"{file}: unexpected key {key!r} (not part of "
                                        "the model its config.json describes)")
                    tensor = f.get_slice(key)
                    shape = tuple(tensor.get_shape())
                    if shape != tuple(expected[key]):
                        raise UserError(f"{file}: key {key!r} has shape {shape}, "
                                        f"the config implies {tuple(expected[key])}")
                    seen.add(key)
                    yield file, key, tensor
        except SafetensorError as e:
            # "incomplete metadata, file not fully covered" and the like
            raise UserError(f"{file}: not a readable safetensors file, truncated or corrupt "
                            f"(an interrupted download or copy?): {e}") from None
    missing = sorted(set(expected) - seen)
    if missing:
        raise UserError(f"{path}: checkpoint lacks {len(missing)} key(s), first {missing[0]!r}")
    if skipped_head:
        _warn_if_another_head(path, skipped_head)


def _warn_if_another_head(path: str, head_file: str):
    """A tied config's file that also holds an lm_head.weight: say so if it is not the
    embedding (a model trained untied, its config.json edited), as the head is then dropped.
    Both are read whole, once (a tied model is a small one)."""
    tensors = {}
    for file, keys in checkpoint_files(path).items():
        with safe_open(file, framework="pt") as f:
            for key in {"model.embed_tokens.weight", "lm_head.weight"} & set(keys or f.keys()):
                tensors[key] = f.get_tensor(key)
    if not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
        distributed.say(f"warning: {head_file} holds an lm_head.weight that differs from "
                        "model.embed_tokens.weight, and config.json's tie_word_embeddings is "
                        "true: the head is the embedding, that lm_head.weight is not used")


def tied_keys(cfg) -> set:
    """The keys a checkpoint leaves out: transformers stores a tied head once, as the embedding."""
    return {"lm_head.weight"} if cfg.tie_word_embeddings else set()


def checkpoint_files(path) -> dict:
    """{safetensors file: [keys in it] (or None = all)} from the index of a sharded checkpoint or
    the single file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"{index}: not a safetensors index (a JSON object with a "
                                f"weight_map): {type(e).__name__}: {e}") from None
        keys_of = {}
        for key, name in weight_map.items():
            keys_of.setdefault(name, []).append(key)
        for name in keys_of:
            files.need_file(path, name)
        return {os.path.join(path, name): keys for name, keys in keys_of.items()}
    return {files.need_file(path, "model.safetensors"): None}



def first_nonfinite(tensors: dict) -> str | None:
    """The name of the first floating tensor holding a NaN or an inf, or None. The common case
    costs one fused pass: every tensor's norm at once, then one isfinite over the norms (a single
    host sync). Only when a norm is not finite are tensors looked at one by one: a NaN anywhere
    makes its norm NaN, and a norm that overflowed on finite values is not reported."""
    names = [k for k, t in tensors.items() if t.is_floating_point()]
    if not names:
        return None
    chosen = [tensors[k] for k in names]
    # in fp32, whatever the weights' dtype; float64 weights (the tests' exact runs) in float64
    wide = torch.float64 if any(t.dtype == torch.float64 for t in chosen) else torch.float32
    norms = torch._foreach_norm(chosen, 2, dtype=wide)
    if torch.isfinite(torch.stack(norms)).all():
        return None
    suspects = (k for k, n in zip(names, norms) if not torch.isfinite(n))
    return next((k for k in suspects if not torch.isfinite(tensors[k]).all()), None)


def count_nonfinite(t) -> str:
    nan, inf = int(t.isnan().sum()), int(t.isinf().sum())
    return f"{nan} NaN and {inf} inf value(s) among its {t.numel()}"



# The files a model directory's weights consist of; save_hf_checkpoint replaces these and keeps
# every other file
OWN_FILES = re.compile(r"config\.json|model\.safetensors(\.index\.json)?"
                       r"|model-\d{5}-of-\d{5}\.safetensors")
# The tokenizer's files (those present are copied): transformers and vLLM load the tokenizer from
# beside the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "vocab.json", "merges.txt", "special_tokens_map.json", "chat_template.jinja")



def save_hf_checkpoint(state_dict: dict, cfg, path: str, max_shard_bytes: int = 5 * 2**30,
                       tokenizer_dir: str | None = None):
    """Write config.json + safetensors (sharded with an index above max_shard_bytes), the layout
    transformers writes, and the TOKENIZER_FILES of tokenizer_dir: a complete model directory.
    Everything goes to a temporary directory first, is flushed to disk and renamed into place, so
    a crash (or a full disk) never leaves half a checkpoint under `path`. Saving into an existing
    model directory replaces its weights and config, and those of its TOKENIZER_FILES that
    tokenizer_dir has, and keeps every other file there (a README, its tokenizer's files when no
    tokenizer_dir is given...).
    Refuses weights that hold a NaN or an inf, naming the tensor."""
    tied = tied_keys(cfg)
    state = {k: v.detach().contiguous().cpu() for k, v in state_dict.items() if k not in tied}
    bad = first_nonfinite(state)
    if bad:
        raise UserError(f"not saving {path}: {bad!r} holds {count_nonfinite(state[bad])}")
    shards, size = [{}], 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-ckpt-", dir=parent)
    # mkdtemp makes it private (0700); a model directory is normally readable by all
    os.chmod(tmp, 0o755)
    try:
        dtypes = {str(v.dtype).removeprefix("torch.") for v in state.values()}
        hf = cfg.to_hf()
        hf["torch_dtype"] = dtypes.pop() if len(dtypes) == 1 else cfg.torch_dtype
        files.write_json(os.path.join(tmp, "config.json"), hf)
        if len(shards) == 1:
            _save_safetensors(shards[0], os.path.join(tmp, "model.safetensors"))
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _save_safetensors(shard, os.path.join(tmp, name))
                weight_map.update({k: name for k in shard})
            total = sum(v.numel() * v.element_size() for v in state.values())
            files.write_json(os.path.join(tmp, "model.safetensors.index.json"),
                       {"metadata": {"total_size": total}, "weight_map": weight_map})
        if tokenizer_dir:
            _copy_tokenizer(tokenizer_dir, tmp)
        if os.path.isdir(path):
            _link_others(path, tmp)
        # the files (each synced as written) and their names, before the rename makes them visible
        files.fsync(tmp)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise



def _save_safetensors(tensors: dict, file: str):
    with files.writing(file):
        save_file(tensors, file, metadata={"format": "pt"})
        # safetensors creates its files private (0600), unlike every other file here
        os.chmod(file, 0o644)
        files.fsync(file)


def _copy_tokenizer(tokenizer_dir: str, dst_dir: str):
    # copies, not _link_or_copy's hard links: those files leave the directory being replaced,
    # these stay in another one (--model's), which a shared inode would tie to this checkpoint
    for name in TOKENIZER_FILES:
        src, dst = os.path.join(tokenizer_dir, name), os.path.join(dst_dir, name)
        if os.path.isfile(src):
            with files.writing(dst):
                shutil.copyfile(src, dst)
                files.fsync(dst)


def _link_others(old: str, new: str):
    """Bring every entry of model directory `old` that is not weights or config into `new`: hard
    links (no copy of a large file), or a copy where the filesystem cannot link."""
    for name in os.listdir(old):
        src, dst = os.path.join(old, name), os.path.join(new, name)
        if OWN_FILES.fullmatch(name) or os.path.lexists(dst):
            continue
        with files.writing(dst):
            if os.path.islink(src):
                os.symlink(os.readlink(src), dst)
            elif os.path.isdir(src):
                shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(src, dst)


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _replace_dir(src, dst):
    """Move directory src to dst atomically enough: dst is either the old or the new checkpoint,
    never a mix."""
    old = dst.rstrip("/") + f".old-{os.getpid()}" if os.path.exists(dst) else None
    if old:
        os.replace(dst, old)
    os.replace(src, dst)
    files.fsync(os.path.dirname(os.path.abspath(dst)))
    if old:
        shutil.rmtree(old)


# --------------------------------------------------------------------------------------------------
# config.json <-> model.ModelConfig

# The families model.py runs, each with the class transformers (and vLLM) load it as
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def config_from_hf(cls, hf: dict, source: str = "config.json"):
    """A cls (model.ModelConfig) from a Hugging Face config.json dict of a Qwen2/Qwen2.5, Llama or
    Qwen3 (old top-level rope_theta and rope_scaling, or newer rope_parameters). What this project
    does not compute (another family, a sliding window, other RoPE scalings) is refused, naming
    the field."""
    family = hf.get("model_type", "qwen2")
    if not isinstance(family, str) or family not in ARCHITECTURES:
        raise UserError(f"{source}: model_type is {family!r}; this project implements "
                        f"{', '.join(map(repr, ARCHITECTURES))} (dense, full attention)")
    _refuse_what_is_not_computed(hf, source)
    known = {f.name for f in fields(cls)}
    kw = {k: v for k, v in hf.items() if k in known and v is not None}
    if family == "qwen2":  # transformers' Qwen2 has q/k/v biases whatever the file says
        kw.pop("attention_bias", None)
    rope_key, rope = _rope_field(hf, source)
    if "rope_theta" in rope:
        kw["rope_theta"] = rope["rope_theta"]
    kw["rope_scaling"] = _llama3_rope(rope, f"{source}: {rope_key}")
    kw["torch_dtype"] = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads"):
        if k not in kw:
            raise UserError(f"{source}: missing required field {k!r}")
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    _check_types(cls, kw, source)
    return cls(**kw)


def _refuse_what_is_not_computed(hf: dict, source: str):
    """One line naming the field, for what a config.json may ask that model.py does not do."""
    if hf.get("use_sliding_window", False):
        raise UserError(f"{source}: use_sliding_window=true is not supported "
                        "(Qwen2.5 and Qwen3 ship with it off)")
    layer_types = hf.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise UserError(f"{source}: layer_types must be a list, got {json.dumps(layer_types)}")
    windowed = [t for t in layer_types if t != "full_attention"]
    if windowed:
        raise UserError(f"{source}: layer_types holds {windowed[0]!r}; only full_attention "
                        "layers are supported")
    if hf.get("mlp_bias", False):
        raise UserError(f"{source}: mlp_bias=true is not supported (Llama ships with it off)")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (SwiGLU's "
                        "'silu' only)")
    rope_key, rope = _rope_field(hf, source)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UserError(f"{source}: {rope_key} has rope type {rope_type!r}, not supported (only "
                        "the default RoPE and Llama 3's 'llama3')")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError(f"{source}: partial_rotary_factor is not supported (RoPE on every "
                        "dimension of a head only)")


def _rope_field(hf: dict, source: str) -> tuple[str, dict]:
    """The RoPE settings and the key holding them: rope_parameters (transformers 5) or
    rope_scaling (older files, with rope_theta beside it)."""
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) and not isinstance(hf[key], dict):
            raise UserError(f"{source}: {key} must be an object, got {json.dumps(hf[key])}")
        if hf.get(key):
            return key, hf[key]
    return "rope_parameters", {}


def _llama3_rope(rope: dict, where: str) -> dict | None:
    """Llama 3.x's rescaled RoPE as ModelConfig.rope_scaling holds it, or None for the default."""
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        return None
    for k in LLAMA3_ROPE:
        v = rope.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise UserError(f"{where}: llama3 RoPE needs {k!r}, a positive number, got "
                            f"{json.dumps(v)}")
    return {"rope_type": "llama3", **{k: rope[k] for k in LLAMA3_ROPE}}


def config_from_json(cls, path: str):
    return config_from_hf(cls, files.read_json_object(path), source=path)


def config_to_hf(cfg) -> dict:
    """The config.json that transformers (and vLLM) read as the family's *ForCausalLM. A Llama
    3.x RoPE goes as its own config.json has it: rope_scaling, with rope_theta beside it (read by
    transformers 4 and 5 and vLLM)."""
    hf = asdict(cfg)
    hf.update(architectures=[ARCHITECTURES[cfg.model_type]], hidden_act="silu",
              attention_dropout=0.0, initializer_range=0.02, use_cache=True)
    if cfg.model_type == "qwen2":
        del hf["attention_bias"]  # not a Qwen2 setting: its q, k, v always have biases
    if cfg.model_type == "llama":
        hf["mlp_bias"] = False
    else:
        hf["use_sliding_window"] = False
    return {k: v for k, v in hf.items() if v is not None}


def _check_types(cls, kw: dict, source: str):
    """A config.json edited by hand ("hidden_size": "128") would otherwise fail deep
    inside torch."""
    kinds = {int: "a positive integer", float: "a positive number", bool: "true or false"}
    for f in fields(cls):
        if f.name not in kw or f.type not in kinds:
            continue
        v = kw[f.name]
        if f.type is bool:
            ok = isinstance(v, bool)
        else:
            # JSON has one number type: 1e6 may come as 1000000; a bool is an int to Python, not
            # here; head_dim 0 is derived from the other sizes
            ok = isinstance(v, (int, float) if f.type is float else int) and \
                not isinstance(v, bool) and (v > 0 or (f.name == "head_dim" and v == 0))
        if not ok:
            raise UserError(f"{source}: {f.name!r} must be {kinds[f.type]}, got {json.dumps(v)} "
                            f"({type(v).__name__})")
    if not isinstance(getattr(torch, str(kw["torch_dtype"]), None), torch.dtype):
        raise UserError(f"{source}: torch_dtype {kw['torch_dtype']!r} is not a torch dtype "
                        "(e.g. \"bfloat16\")")
