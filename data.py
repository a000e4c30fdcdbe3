"""
Data: a model directory's tokenizer and chat template, the DAPO datasets, the prompt iterator of the training loop, and
the toy task that the CPU demo trains on.

- load_tokenizer(path): tokenizer.json through the `tokenizers` library, plus the model's own chat template rendered
  with jinja2 the way transformers renders it, so prompt ids are the ones transformers (and verl) would produce.
- load_rows(path): DAPO-Math-17k / AIME-2024 rows from parquet (needs pyarrow: requirements-extra.txt) or JSONL with
  the same columns. The released DAPO-Math-17k parquet repeats each of its ~17.9k prompts ~100 times (DAPO #15, #36),
  so duplicates are dropped on load.
- encode_prompts(...): chat template + left truncation to the prompt limit, as verl's truncation="left".
- PromptIterator: shuffled fixed-size batches over epochs, with a state a checkpoint saves and a resume restores.
- The toy task (bottom of the file): sums of a few digits, a tiny tokenizer saved as a real model directory, and the
  noisy "base model" behaviour that the demo's supervised warm-up imitates.

Messages go through the `logging` module (logger "data"): INFO for what a load did (rows read, duplicates dropped,
prompts truncated), WARNING for rows skipped as unusable. The entry point decides where they go (logging.basicConfig).
"""
import json
import logging
import os
import random
import zlib

import numpy as np
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

log = logging.getLogger("data")

# ----------------------------------------------------------------------------------------------------------------------
# Tokenizer and chat template

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """What the trainer needs from a tokenizer. vocab_size is the tokenizer's (151665 for Qwen2.5); the model's
    embedding may be larger (151936), padded for speed."""

    def __init__(self, tok: _HFTokenizer, chat_template: str | None, eos_token_ids: list[int], pad_token_id: int,
                 special_tokens: dict[str, str], name: str = ""):
        self._tok = tok
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.special_tokens = special_tokens  # {"eos_token": "<|im_end|>", ...}: templates may refer to these
        self.name = name
        self._template = _compile_chat_template(chat_template) if chat_template else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # no BOS/EOS added: the chat template writes every control token itself, as in transformers' chat path
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat as text, exactly as transformers' apply_chat_template(..., tokenize=False) renders it."""
        if self._template is None:
            raise ValueError(f"{self.name or 'this tokenizer'} has no chat_template (neither chat_template.jinja nor "
                             "a chat_template entry in tokenizer_config.json)")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty list of messages")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # transformers drops None fields
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat: the same ids as transformers' apply_chat_template(..., tokenize=True)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _compile_chat_template(source: str):
    # The environment transformers uses: sandboxed (a template from the Hub is untrusted code), trim_blocks and
    # lstrip_blocks (they change the whitespace, hence the ids), loop controls, and its tojson / raise_exception.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def _need_file(path, name):
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: not found (is {path!r} a Hugging Face model directory?)")
    return file


def _read_json(path: str, required: bool = True) -> dict:
    if not os.path.isfile(path):
        if required:
            _need_file(*os.path.split(path))
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value  # "<|im_end|>" or {"content": "<|im_end|>", ...}


def _chat_template(path: str, config: dict) -> str | None:
    file = os.path.join(path, "chat_template.jinja")  # newer transformers save it here; it takes priority
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the chat one is "default"
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory: tokenizer.json, tokenizer_config.json, generation_config.json.

    EOS ids: generation_config.json's eos_token_id (an int or a list), then tokenizer_config.json's eos_token, then
    <|im_end|> when the chat template is ChatML. Qwen2.5 base lists only <|endoftext|> in its generation config, but a
    response formatted by its ChatML template ends with <|im_end|>: both must stop generation."""
    tok = _HFTokenizer.from_file(_need_file(path, "tokenizer.json"))
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    gen = _read_json(os.path.join(path, "generation_config.json"), required=False)
    template = _chat_template(path, config)
    special = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if _token_text(config.get(name))}

    eos = gen.get("eos_token_id")
    eos_ids = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    candidates = [special.get("eos_token")] + (["<|im_end|>"] if template and "<|im_end|>" in template else [])
    for token in candidates:
        tid = tok.token_to_id(token) if token else None
        if tid is not None and tid not in eos_ids:
            eos_ids.append(tid)
    if not eos_ids:
        raise ValueError(f"{path}: no EOS token (no eos_token_id in generation_config.json, no eos_token in "
                         "tokenizer_config.json)")
    pad = tok.token_to_id(special["pad_token"]) if "pad_token" in special else gen.get("pad_token_id")
    return Tokenizer(tok, template, eos_ids, eos_ids[0] if pad is None else pad, special, name=path)


# ----------------------------------------------------------------------------------------------------------------------
# Datasets: DAPO-Math-17k and AIME-2024 rows (SPEC section 5)
#   {"data_source": "math_dapo", "prompt": [{"role": "user", "content": ...}], "ability": "MATH",
#    "reward_model": {"ground_truth": "34", "style": "rule"}, "extra_info": {"index": ...}}

def _parquet_rows(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow, an optional extra: pip install -r requirements-extra.txt "
                          "(or convert the file to JSONL with the same columns)") from None
    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=65536):  # Python objects for one batch at a time
        for row in batch.to_pylist():
            yield f"{path}: row {index}", row
            index += 1


def _jsonl_rows(path: str):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None


def _check_row(row, where: str) -> str | None:
    """Raise on a row that breaks the schema; return why a well-formed but unusable row is skipped, or None.
    A JSON integer ground truth is turned into the string the verifier compares."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with data_source, prompt and reward_model, got "
                         f"{type(row).__name__}")
    if not isinstance(row.get("data_source"), str):
        raise ValueError(f"{where}: 'data_source' is missing or not a string")
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        raise ValueError(f"{where}: 'prompt' must be a list of {{'role': str, 'content': str}} messages")
    reward_model = row.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise ValueError(f"{where}: 'reward_model' must be an object holding 'ground_truth'")
    gt = reward_model.get("ground_truth")
    if isinstance(gt, int) and not isinstance(gt, bool):
        reward_model["ground_truth"] = gt = str(gt)
    if gt is not None and not isinstance(gt, str):
        raise ValueError(f"{where}: ground_truth must be a string, got {type(gt).__name__}")
    if not gt or not gt.strip():
        return "no ground truth"
    if not any(m["content"].strip() for m in prompt):
        return "empty prompt"
    return None


def load_rows(path: str, dedupe: bool = True) -> list[dict]:
    """Rows from a .parquet or .jsonl file (one JSON object per line), in file order.

    A row that breaks the schema (not an object, no data_source, a prompt that is not a list of messages) stops the
    load with an error naming the file and row. A row without a ground truth or with an empty prompt is skipped and
    counted, with a WARNING. With dedupe, a prompt seen before is dropped (the first copy is kept) and the count is
    logged; AIME-2024's 32 copies of each problem collapse to 30 rows, so sample k responses per row for avg@k.
    Reading the 1.79M-row DAPO-Math-17k parquet this way takes a minute or so (200k rows: ~17 s on a busy 2-core
    machine): it happens once per run, and a deduplicated JSONL copy loads in a second."""
    if path.endswith(".parquet"):
        source = _parquet_rows(path)
    elif path.endswith(".jsonl"):
        source = _jsonl_rows(path)
    else:
        raise ValueError(f"{path}: unknown data format (expected .parquet or .jsonl)")
    rows, seen, skipped = [], {}, {}
    n_read = n_dup = n_conflict = 0
    for where, row in source:
        n_read += 1
        reason = _check_row(row, where)
        if reason:
            skipped.setdefault(reason, []).append(where)
            continue
        key = (row["data_source"], tuple((m["role"], m["content"]) for m in row["prompt"]))
        gt = row["reward_model"]["ground_truth"]
        if dedupe and key in seen:
            n_dup += 1
            n_conflict += seen[key] != gt
            continue
        seen[key] = gt
        rows.append(row)
    for reason, places in skipped.items():
        log.warning("%s: skipped %d row(s) with %s (first: %s)", path, len(places), reason, places[0])
    if n_conflict:
        log.warning("%s: %d duplicate prompt(s) had a different ground truth than their first copy (kept the first)",
                    path, n_conflict)
    log.info("%s: %d rows read, %d duplicate prompts dropped, %d skipped, %d kept", path, n_read, n_dup,
             sum(map(len, skipped.values())), len(rows))
    if not rows:
        raise ValueError(f"{path}: no usable rows")
    return rows


def encode_prompts(rows: list[dict], tokenizer: Tokenizer, max_prompt_len: int) -> tuple[list[list[int]], int]:
    """Each row's messages through the chat template (with the assistant header); a prompt longer than
    max_prompt_len keeps its last max_prompt_len tokens, as verl's truncation="left" (the question and the
    generation prompt are at the end). Returns (prompt ids per row, how many were truncated)."""
    out, n_truncated = [], 0
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)
        if len(ids) > max_prompt_len:
            ids = ids[-max_prompt_len:]
            n_truncated += 1
        out.append(ids)
    if n_truncated:
        log.info("%d of %d prompts were longer than %d tokens and lost their beginning", n_truncated, len(rows),
                 max_prompt_len)
    return out, n_truncated


class PromptIterator:
    """Fixed-size batches of rows, reshuffled every epoch. The order of epoch e is a function of (seed, e) only, so
    the state is two integers: a resumed run sees exactly the batches the interrupted one would have. The last
    len(rows) % batch_size rows of an epoch's order are not used (they differ from epoch to epoch)."""

    def __init__(self, rows: list[dict], batch_size: int, seed: int):
        if not 0 < batch_size <= len(rows):
            raise ValueError(f"batch_size={batch_size} needs 1 <= batch_size <= number of rows ({len(rows)})")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next_batch(self) -> list[dict]:
        if self.position + self.batch_size > len(self.rows):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        idx = self._order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return [self.rows[i] for i in idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": len(self.rows),
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict):
        mine = self.state_dict()
        for k in ("seed", "num_rows", "batch_size"):
            if state[k] != mine[k]:
                raise ValueError(f"prompt iterator state is for {k}={state[k]}, this run has {k}={mine[k]} "
                                 "(a resume needs the same data, batch size and seed)")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


# ----------------------------------------------------------------------------------------------------------------------
# The toy task of the CPU demo
#
# Problems are sums of 2-3 digits from 0 to 5 ("3+5+2"), answered with the sum. The demo's "base model" is a tiny Qwen2 given a
# short supervised warm-up on toy_warmup_pairs(), responses in the format the verifier reads, of two kinds:
# - worked: a running sum, then the answer ("3+5=8, 8+2=10.\nAnswer: 10"). Right almost always (a step slips with
#   probability TOY_STEP_ERROR), but only a fraction TOY_WORK_PROB of the warm-up responses work it out;
# - direct: "Answer: 12", a guess, right about 1 time in 16.
# So the base model can solve most problems (it has seen how) but mostly does not bother: held-out accuracy starts
# near 0.25, while pass@k is much higher. This is what RL on a real base model does at scale: the reward teaches the
# model to use the reasoning it already has, responses get longer as it does (the paper's Fig. 7), and the gain
# is the RL phase's alone (more warm-up on the same data teaches the same mixture).
# A fraction TOY_RAMBLE of the responses of both kinds repeat a filler sentence before the answer, so lengths vary
# widely and ~1 in 6 runs past TOY_MAX_RESPONSE_LEN, where truncation cuts off the Answer line too: overlong shaping
# and the token-level loss then have something to act on (paper Sec. 3.3-3.4).
# Measured (make run, seed 0): 400 warm-up steps give held-out accuracy ~0.25 at T = 1 (the worked answers right
# ~60% of the time, the sums above 10 the hardest); RL then makes the model work every problem out.
# The reward is the real math_dapo verifier (reward.py routes "toy_sum" to it). Held-out problems come from a
# disjoint part of the problem space (a hash of the problem text), never seen in warm-up or RL.

TOY_DATA_SOURCE = "toy_sum"
TOY_MIN_TERMS, TOY_MAX_TERMS = 2, 3  # terms per problem...
TOY_MAX_DIGIT = 5  # ...each in [0, TOY_MAX_DIGIT]: few enough addition facts for a 2-minute warm-up to learn
TOY_WORK_PROB = 0.3  # chance that a warm-up response works the sum out step by step...
TOY_GUESS_MAX = 15  # ...otherwise it states a guess, uniform in [0, TOY_GUESS_MAX]
TOY_STEP_ERROR = 0.05  # chance that a step of the working slips...
TOY_SLIPS = (-2, -1, 1, 2)  # ...by one of these, equally likely
TOY_RAMBLE = 0.4  # chance that a warm-up response repeats filler before its answer...
TOY_RAMBLE_REPEATS = (1, 8)  # ...this many times (inclusive range)
TOY_FILLER = "Let me check."
TOY_TEST_BUCKETS = 5  # 1 problem in 5 (by a hash of its text) is held out for evaluation: 54 of 252
TOY_WORDS = ["user", "assistant", "Answer", "Let", " Let", " me", " check"]  # one token each; digits stay single
TOY_MAX_RESPONSE_LEN, TOY_OVERLONG_BUFFER = 40, 16  # suggested demo limits: no plain response is penalised
TOY_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                     "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2's pre-tokenizer regex: letters group into words, every digit is its own piece
QWEN_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                    r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of every byte-level BPE (space is "Ġ", newline "Ċ")."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def make_toy_tokenizer(out_dir: str) -> Tokenizer:
    """Write a Qwen-style tokenizer for the toy task into out_dir (tokenizer.json, tokenizer_config.json with the
    chat template, generation_config.json) and load it back through load_tokenizer, the path a real checkpoint takes.
    Byte-level BPE with Qwen2's normaliser, pre-tokenizer and decoder: the 256 bytes, a few whole-word tokens, and
    <|endoftext|>, <|im_start|>, <|im_end|>. Any text round-trips exactly."""
    byte_char = _bytes_to_unicode()
    vocab = {byte_char[b]: b for b in range(256)}
    merges = []
    for word in TOY_WORDS:  # build each word left to right: ("Ġ", "m"), ("Ġm", "e"), ...
        pieces = [byte_char[b] for b in word.encode()]
        for piece in pieces[1:]:
            merges.append((pieces[0], piece))
            pieces[0] += piece
            vocab.setdefault(pieces[0], len(vocab))
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in specials}
    config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 1024,
              "chat_template": TOY_CHAT_TEMPLATE}
    generation = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]}
    for name, content in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
    return load_tokenizer(out_dir)


def _toy_split(problem: str) -> str:
    return "test" if zlib.crc32(problem.encode()) % TOY_TEST_BUCKETS == 0 else "train"


def _toy_problems(n: int, seed: int, split: str, stream: str):
    """n problems (lists of digits) of one split, drawn i.i.d.: a uniform number of terms, uniform digits. Each
    stream ("rows", "warmup") has its own random sequence, so warm-up and RL problems are independent draws."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"toy-{stream}-{split}-{seed}")
    problems = []
    while len(problems) < n:
        terms = [rng.randrange(TOY_MAX_DIGIT + 1) for _ in range(rng.randint(TOY_MIN_TERMS, TOY_MAX_TERMS))]
        if _toy_split("+".join(map(str, terms))) == split:
            problems.append(terms)
    return problems, rng


def toy_rows(n: int, seed: int, split: str = "train") -> list[dict]:
    """n toy rows in the DAPO row schema, data_source "toy_sum". The splits never share a problem."""
    problems, _ = _toy_problems(n, seed, split, "rows")
    return [{"data_source": TOY_DATA_SOURCE,
             "prompt": [{"role": "user", "content": "+".join(map(str, terms))}],
             "ability": "arithmetic",
             "reward_model": {"ground_truth": str(sum(terms)), "style": "rule"},
             "extra_info": {"split": split, "index": i}} for i, terms in enumerate(problems)]


def toy_response(terms: list[int], rng: random.Random) -> str:
    """One "base model" response: worked (a running sum, rarely slipping) or a direct guess, maybe filler, then
    the Answer line."""
    lines = []
    if rng.random() < TOY_WORK_PROB:
        total, steps = terms[0], []
        for t in terms[1:]:
            s = total + t
            if rng.random() < TOY_STEP_ERROR:
                s += rng.choice(TOY_SLIPS)
            steps.append(f"{total}+{t}={s}")
            total = s  # a slip carries forward, as a real mistake would
        lines.append(", ".join(steps) + ".")
    else:
        total = rng.randint(0, TOY_GUESS_MAX)
    if rng.random() < TOY_RAMBLE:
        lines.append(" ".join([TOY_FILLER] * rng.randint(*TOY_RAMBLE_REPEATS)))
    return "\n".join(lines + [f"Answer: {total}"])


def toy_warmup_pairs(n: int, seed: int) -> list[tuple[list[dict], str]]:
    """n (prompt messages, response text) pairs from the train split: the supervised warm-up that makes the demo's
    base model. About a quarter of the answers are right (see the comment above the TOY_ constants)."""
    problems, rng = _toy_problems(n, seed, "train", "warmup")
    return [([{"role": "user", "content": "+".join(map(str, terms))}], toy_response(terms, rng))
            for terms in problems]
