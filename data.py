"""
Data: a model directory's tokenizer and chat template, the DAPO datasets, and the loop's prompt
iterator (the CPU demo's toy task lives in toy.py).

- load_tokenizer(path): tokenizer.json through the `tokenizers` library, plus the model's own chat
  template rendered with jinja2 the way transformers renders it, so prompt ids are the ones
  transformers (and verl) would produce.
- load_rows(path, tokenizer): DAPO-Math-17k / AIME-2024 rows from parquet (needs pyarrow:
  requirements-extra.txt) or JSONL with the same columns. Duplicates are dropped (the released
  DAPO-Math-17k parquet repeats each of its ~17.9k prompts ~100 times: DAPO #15, #36), and every
  row is checked on load, so a bad row stops the run before it starts, naming its file and line.
- check_vocab(...): the model's embedding has a row for every token id the tokenizer can produce.
- encode_prompts(...): chat template + left truncation to the prompt limit, as verl's
  truncation="left".
- PromptIterator: shuffled fixed-size batches over epochs, with a state a checkpoint saves.

Messages go through `logging` (logger "data"): INFO for what a load did, WARNING for rows skipped;
the entry point decides where they go.
"""
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from infra import datafiles, templates
from infra.errors import UserError
from infra.files import json_type, need_file, read_json_object

log = logging.getLogger("data")
CUSTOM_DATA_SOURCE = "custom"  # the data_source of plain {"prompt", "answer"} rows (--reward-fn's)

# --------------------------------------------------------------------------------------------------
# Tokenizer and chat template

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")


class Tokenizer:
    """What the trainer needs from a tokenizer. vocab_size is the tokenizer's (151665 for Qwen2.5);
    the model's embedding may be larger (151936), padded for speed."""

    def __init__(self, tok: _HFTokenizer, chat_template: str | None, eos_token_ids: list[int],
                 pad_token_id: int, special_tokens: dict[str, str], name: str = "",
                 template_source: str = "the chat template"):
        self._tok = tok
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        # {"eos_token": "<|im_end|>", ...}: templates may refer to these
        self.special_tokens = special_tokens
        self.name = name
        self.template_source = template_source
        self._template = (templates.compile_template(chat_template, template_source)
                          if chat_template else None)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # no BOS/EOS added: the chat template writes every control token itself, as in
        # transformers' chat path
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text, in one call that runs on all cores (the tokenizers library's
        own threads)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def decode_rows(self, ids, lengths) -> list[str]:
        """The text of each row of ids (N, T) up to its length (lengths (N,)): the responses'."""
        return [self.decode(row[:n].tolist()) for row, n in zip(ids, lengths.tolist())]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat as text, exactly as transformers' apply_chat_template(..., tokenize=False)
        renders it."""
        if self._template is None:
            raise UserError(f"{self.name or 'this tokenizer'} has no chat_template (neither "
                            "chat_template.jinja nor a chat_template entry in "
                            "tokenizer_config.json)")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty list of messages")
        # transformers drops None fields
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return templates.render(self._template, messages=messages, tools=None,
                                    documents=None, add_generation_prompt=add_generation_prompt,
                                    **self.special_tokens)
        except Exception as e:  # a template is code: any error it raises, named with its file
            raise UserError(f"{self.template_source}: the chat template failed: "
                            f"{type(e).__name__}: {e}") from None

    def apply_chat_template(self, messages: list[dict],
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat: the same ids as transformers'
        apply_chat_template(..., tokenize=True)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _token_text(value, name: str, where: str) -> str | None:
    """A special token's text: "<|im_end|>" or {"content": "<|im_end|>", ...} (None: none)."""
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        raise UserError(f"{where}: {name} must be a token's text (\"<|im_end|>\" or "
                        f"{{\"content\": ...}}), got {json.dumps(value)}")
    return text


def _chat_template(path: str, config: dict) -> tuple[str | None, str]:
    """(the chat template, the file it comes from)."""
    # newer transformers save it here; it takes priority
    file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            return f.read(), file
    where = os.path.join(path, "tokenizer_config.json") + " (its chat_template)"
    template = config.get("chat_template")
    if isinstance(template, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
        # several named templates: the chat one is "default"
        template = {t["name"]: t.get("template") for t in template}.get("default")
    if template is not None and not isinstance(template, str):
        raise UserError(f"{where}: must be the template's text, or a list of {{\"name\": ..., "
                        f"\"template\": ...}}, got {json_type(template)}")
    return template, where


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory: tokenizer.json, tokenizer_config.json,
    generation_config.json.

    EOS ids: generation_config.json's eos_token_id (an int or a list), then tokenizer_config.json's
    eos_token, then <|im_end|> when the chat template is ChatML. Qwen2.5 base lists only
    <|endoftext|> in its generation config, but a response formatted by its ChatML template ends
    with <|im_end|>: both must stop generation."""
    tokenizer_file = need_file(path, "tokenizer.json")
    try:
        tok = _HFTokenizer.from_file(tokenizer_file)
    except Exception as e:  # the tokenizers library's errors are bare Exceptions, naming no file
        raise UserError(f"{tokenizer_file}: not a tokenizer the tokenizers library reads, "
                        f"truncated or corrupt (a partial copy?): {e}") from None
    config_file = need_file(path, "tokenizer_config.json")
    config = read_json_object(config_file)
    gen_file = os.path.join(path, "generation_config.json")
    gen = read_json_object(gen_file) if os.path.isfile(gen_file) else {}
    template, template_source = _chat_template(path, config)
    special = {name: text for name in SPECIAL_TOKEN_NAMES
               if (text := _token_text(config.get(name), name, config_file))}

    eos = gen.get("eos_token_id")
    if isinstance(eos, list):
        eos_ids = list(eos)
    elif eos is not None:
        eos_ids = [eos]
    else:
        eos_ids = []
    chatml = ["<|im_end|>"] if template and "<|im_end|>" in template else []
    candidates = [special.get("eos_token")] + chatml
    for token in candidates:
        tid = tok.token_to_id(token) if token else None
        if tid is not None and tid not in eos_ids:
            eos_ids.append(tid)
    if not eos_ids:
        raise UserError(f"{path}: no EOS token (no eos_token_id in generation_config.json, no "
                        "eos_token in tokenizer_config.json)")
    pad = (tok.token_to_id(special["pad_token"]) if "pad_token" in special
           else gen.get("pad_token_id"))
    tokenizer = Tokenizer(tok, template, eos_ids, eos_ids[0] if pad is None else pad, special,
                          name=path, template_source=template_source)
    if template:  # rendered once now: a template that fails or runs away stops the load
        tokenizer.render_chat([{"role": "user", "content": "What is 1 + 1?"}])
    return tokenizer


def check_vocab(model_vocab_size: int, tokenizer: Tokenizer, model_dir: str):
    """Every id the tokenizer can produce must have a row in the model's embedding, which may be
    larger (Qwen2.5 pads 151665 tokens to 151936 rows). The EOS ids, numbers in
    generation_config.json, must be tokens (another id is never sampled: every response would run
    to --max-response-len), and the pad id a row of the embedding."""
    needed = max(tokenizer._tok.get_vocab(with_added_tokens=True).values()) + 1
    if model_vocab_size < needed:
        raise UserError(f"the model in {model_dir} has vocab_size {model_vocab_size} "
                        f"(config.json), smaller than the {needed} token ids of the tokenizer in "
                        f"{tokenizer.name}: are they from different models?")
    # the ids that are not a token name come from generation_config.json
    source = os.path.join(tokenizer.name, "generation_config.json")
    for eos in tokenizer.eos_token_ids:
        if not (isinstance(eos, int) and 0 <= eos < needed and tokenizer._tok.id_to_token(eos)):
            raise UserError(f"{source}: eos_token_id {eos!r} is not a token of the tokenizer in "
                            f"{tokenizer.name} (ids 0 to {needed - 1}): no response would end "
                            "before --max-response-len")
    pad = tokenizer.pad_token_id
    if not (isinstance(pad, int) and 0 <= pad < model_vocab_size):
        raise UserError(f"{source}: pad_token_id {pad!r} is not a row of the model's embedding "
                        f"(vocab_size {model_vocab_size} in {model_dir}/config.json)")


# --------------------------------------------------------------------------------------------------
# Datasets: DAPO-Math-17k and AIME-2024 rows as released, in verl's RL data format
#   {"data_source": "math_dapo", "prompt": [{"role": "user", "content": ...}], "ability": "MATH",
#    "reward_model": {"ground_truth": "34", "style": "rule"}, "extra_info": {"index": ...}}

def check_data_file(path: str, flag: str):
    """Before anything loads: the file a flag names is there and has a reader (.jsonl, or .parquet
    with pyarrow installed). Raises naming the flag and the file."""
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such file")
    try:
        datafiles.need_reader(path)
    except ValueError as e:
        raise UserError(f"{flag} {e}") from None


def _from_plain(row, where: str):
    """A plain row {"prompt": "question", "answer": "ground truth"} as a verl row of data_source
    "custom" (scored by --reward-fn); any other row unchanged."""
    if not (isinstance(row, dict) and isinstance(row.get("prompt"), str)):
        return row
    if set(row) - {"prompt", "answer", "data_source"} or "answer" not in row:
        raise UserError(f"{where}: a plain row is {{\"prompt\": str, \"answer\": str}}, got "
                        f"keys {sorted(row)}")
    return {"data_source": row.get("data_source", CUSTOM_DATA_SOURCE),
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "reward_model": {"ground_truth": row["answer"], "style": "rule"}}


def _check_row(row, where: str, rewarded: Callable[[str], bool] | None,
               known_data_sources: Sequence[str] = ()) -> str | None:
    """Raise on a row that breaks the schema or that no verifier scores (rewarded); return why
    a well-formed but unusable row is skipped, or None. A JSON integer ground truth is turned into
    the string the verifier compares."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object with data_source, prompt and reward_model, "
                        f"got {type(row).__name__}")
    if not isinstance(row.get("data_source"), str):
        raise UserError(f"{where}: 'data_source' is missing or not a string")
    if rewarded is not None and not rewarded(row["data_source"]):
        raise UserError(f"{where}: no reward function for data_source {row['data_source']!r}: "
                        f"give the row \"data_source\": \"math_dapo\" for the built-in verifier "
                        "of DAPO-Math-17k (+1 when the response's last \"Answer: ...\" line "
                        "matches the ground truth, else -1), or give yours with --reward-fn "
                        "FILE.py:NAME (the built-in verifiers score the data_sources "
                        f"{', '.join(known_data_sources) or 'of reward.py'})")
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in prompt):
        raise UserError(f"{where}: 'prompt' must be a list of {{'role': str, 'content': str}} "
                        "messages")
    for m in prompt:
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as e:
            # JSON can escape half a surrogate pair ("\ud800"); no tokenizer takes it
            raise UserError(f"{where}: the prompt holds {m['content'][e.start]!r} at character "
                            f"{e.start}, half of a UTF-16 surrogate pair, which is not text any "
                            "tokenizer can encode") from None
    reward_model = row.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise UserError(f"{where}: 'reward_model' must be an object holding 'ground_truth'")
    gt = reward_model.get("ground_truth")
    if isinstance(gt, int) and not isinstance(gt, bool):
        reward_model["ground_truth"] = gt = str(gt)
    if gt is not None and not isinstance(gt, str):
        raise UserError(f"{where}: ground_truth must be a string, got {type(gt).__name__}")
    if not gt or not gt.strip():
        return "no ground truth"
    if not any(m["content"].strip() for m in prompt):
        return "empty prompt"
    return None


def load_rows(path: str, tokenizer: Tokenizer | None = None, dedupe: bool = True,
              rewarded: Callable[[str], bool] | None = None,
              known_data_sources: Sequence[str] = ()) -> list[dict]:
    """Rows from a .parquet or .jsonl file (one JSON object per line), in file order, each of a
    data_source that rewarded(data_source) says is rewarded (the run's
    reward.Verifier.rewards; None: every data_source is taken, the caller scores them);
    known_data_sources, the built-in verifiers', are named when a row's is not rewarded.

    A row that breaks the schema (not an object, no data_source, a prompt that is not a list of
    messages) or that cannot be used (a data_source without a reward function; with a tokenizer, a
    prompt its chat template cannot render or it cannot encode) stops the load with an error naming
    the file and row, not at the step that draws it hours later. A row without a ground truth or
    with an empty prompt is skipped and counted, with a WARNING. With dedupe, a prompt seen before
    is dropped (the first copy is kept) and the count is logged; AIME-2024's 32 copies of each
    problem collapse to 30 rows, so sample k responses per row for avg@k. The 1.79M-row
    DAPO-Math-17k parquet takes about a minute, once per run; a deduplicated JSONL copy loads in a
    second."""
    source = datafiles.read_rows(path)
    rows, wheres, first_ground_truth, skipped = [], [], {}, {}
    n_read = n_dup = n_conflict = 0
    for where, row in source:
        n_read += 1
        row = _from_plain(row, where)
        reason = _check_row(row, where, rewarded, known_data_sources)
        if reason:
            skipped.setdefault(reason, []).append(where)
            continue
        key = (row["data_source"], tuple((m["role"], m["content"]) for m in row["prompt"]))
        gt = row["reward_model"]["ground_truth"]
        if dedupe and key in first_ground_truth:
            n_dup += 1
            n_conflict += first_ground_truth[key] != gt
            continue
        first_ground_truth[key] = gt
        rows.append(row)
        wheres.append(where)
    for reason, places in skipped.items():
        log.warning("%s: skipped %d row(s) with %s (first: %s)", path, len(places), reason,
                    places[0])
    if n_conflict:
        log.warning("%s: %d duplicate prompt(s) had a different ground truth than their first copy "
                    "(kept the first)", path, n_conflict)
    log.info("%s: %d rows read, %d duplicate prompts dropped, %d skipped, %d kept", path, n_read,
             n_dup, sum(map(len, skipped.values())), len(rows))
    if not rows:
        raise UserError(f"{path}: no usable rows")
    if tokenizer is not None:
        _check_prompts(rows, wheres, tokenizer)
    return rows


def _check_prompts(rows, wheres, tokenizer: Tokenizer, chunk: int = 4096):
    """Render every row's prompt with the chat template and encode it, as the rollout will; raise
    naming the first row that fails. The ids are not kept: the rollout encodes the rows it draws."""
    for start in range(0, len(rows), chunk):
        texts = []
        for row, where in zip(rows[start:start + chunk], wheres[start:start + chunk]):
            try:
                texts.append(tokenizer.render_chat(row["prompt"], add_generation_prompt=True))
            except Exception as e:
                # jinja2 errors, raise_exception() of the template itself ("roles must alternate")
                raise UserError(f"{where}: the chat template of {tokenizer.name} cannot render "
                                f"this prompt: {type(e).__name__}: {e}") from None
        try:
            tokenizer.encode_batch(texts)
        except Exception:  # the batch call does not say which text: find it
            for text, where in zip(texts, wheres[start:start + chunk]):
                try:
                    tokenizer.encode(text)
                except Exception as e:
                    raise UserError(f"{where}: the tokenizer of {tokenizer.name} cannot encode "
                                    f"this prompt: {type(e).__name__}: {e}") from None
            raise


def encode_prompts(rows: list[dict], tokenizer: Tokenizer,
                   max_prompt_len: int) -> tuple[list[list[int]], int]:
    """Each row's messages through the chat template (with the assistant header); a prompt longer
    than max_prompt_len keeps its last max_prompt_len tokens, as verl's truncation="left" (the
    question and the generation prompt are at the end). Returns (prompt ids per row, how many were
    truncated)."""
    prompts, n_truncated = [], 0
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)
        if len(ids) > max_prompt_len:
            ids = ids[-max_prompt_len:]
            n_truncated += 1
        prompts.append(ids)
    if n_truncated:
        log.info("%d of %d prompts were longer than %d tokens and lost their beginning",
                 n_truncated, len(rows), max_prompt_len)
    return prompts, n_truncated


class PromptIterator:
    """Fixed-size batches of rows, reshuffled every epoch. The order of epoch e is a function of
    (seed, e) only, so the state is two integers: a resumed run sees exactly the batches the
    interrupted one would have. The last len(rows) % batch_size rows of an epoch's order are not
    used (they differ from epoch to epoch). The state also holds a hash of the rows' content, so
    that a resume on other data of the same size is refused."""

    def __init__(self, rows: list[dict], batch_size: int, seed: int):
        if not 0 < batch_size <= len(rows):
            raise ValueError(f"batch_size={batch_size} needs 1 <= batch_size <= number of rows "
                             f"({len(rows)})")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)
        self._rows_hash = None  # computed when a checkpoint first needs it

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next_batch(self) -> list[dict]:
        if self.position + self.batch_size > len(self.rows):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        idx = self._order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return [self.rows[i] for i in idx]

    def rows_hash(self) -> str:
        """sha256 of the rows in order, as sorted-key JSON: the same file loads to the same hash
        on any machine."""
        if self._rows_hash is None:
            text = json.dumps(self.rows, sort_keys=True, default=str)
            self._rows_hash = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._rows_hash

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_rows": len(self.rows), "batch_size": self.batch_size,
                "rows_sha256": self.rows_hash()}

    def load_state_dict(self, state: dict):
        mine = self.state_dict()
        # a key the state lacks is not checked (older checkpoints hold no rows_sha256)
        for k in ("seed", "num_rows", "batch_size", "rows_sha256"):
            if k in state and state[k] != mine[k]:
                raise UserError(f"prompt iterator state is for {k}={state[k]}, this run has "
                                f"{k}={mine[k]} (a resume needs the same data, batch size "
                                "and seed)")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)
