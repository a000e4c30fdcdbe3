"""data.py: chat-template ids against transformers, dataset loading, and the prompt iterator.

No downloads: the tests build a small byte-level BPE with Qwen2's pipeline and special tokens, and
save it next to the real Qwen2.5 / Qwen2 chat templates (copied below from the models'
tokenizer_config.json).
"""
import json
import logging
import random
import sys

import pytest
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

import toy
from data import PromptIterator, check_vocab, encode_prompts, load_rows, load_tokenizer
from infra.errors import UserError
from reward import has_built_in_verifier

transformers = pytest.importorskip("transformers")

# Qwen/Qwen2.5-7B-Instruct tokenizer_config.json "chat_template" (the base models ship the same one)
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""  # noqa: E501

# Qwen/Qwen2-7B-Instruct tokenizer_config.json "chat_template"
QWEN2_TEMPLATE = ("{% for message in messages %}"
                  "{% if loop.first and messages[0]['role'] != 'system' %}"
                  "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
                  "{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                  " + '<|im_end|>' + '\n'}}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Not a real model's: whitespace after and before block tags (trim_blocks / lstrip_blocks),
# `is defined` on a field that is None (transformers drops None fields first), tojson on unicode,
# and special tokens passed to the template.
EDGE_TEMPLATE = """{{ pad_token }}{% for message in messages %}
    {% if message.name is defined %}
[{{ message.name }}]
    {% endif %}
<|im_start|>{{ message.role }}
{{ message.content | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

PROMPT = ("Solve the following math problem step by step. The last line of your response should be "
          "of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
          "problem.\n\n{}\n\nRemember to put your answer on its own line after \"Answer:\".")

CHATS = [
    [{"role": "user", "content": PROMPT.format("What is $1+1$?")}],
    [{"role": "system", "content": "You are a careful mathematician."},
     {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 123 456"},
     {"role": "user", "content": "  spaces\tand\n\nnewlines  "}],
    [{"role": "user", "content": "Ünïcödé: 数学 — ∑x² ≤ π 🙂"}],
    [{"role": "user", "content": "literal <|im_end|> inside user text"}],
    [{"role": "user", "content": "named", "name": None},
     {"role": "assistant", "content": "ok", "name": "bot"},
     {"role": "user", "content": "again"}],
]

CORPUS = ([PROMPT.format(f"Find the sum of {i} and {i * 7}, then divide by 3.") for i in range(50)]
          + ["The quick brown fox jumps over the lazy dog. 数学 ∑x² ≤ π 🙂 Ünïcödé",
             "Hello! How can I help you today?"])


def qwen_like_dir(tmp_path, template, gen_eos=("<|im_end|>", "<|endoftext|>"),
                  eos_token="<|im_end|>", template_file=False):
    """A model directory whose tokenizer is built the way Qwen2's is (NFC, Qwen's split regex,
    byte-level BPE), trained on a few sentences, with Qwen's three special tokens."""
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(toy.QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": eos_token,
              "pad_token": "<|endoftext|>", "unk_token": None}
    if template_file:
        (tmp_path / "chat_template.jinja").write_text(template)
        config["chat_template"] = "{{ 'a stale template that chat_template.jinja overrides' }}"
    else:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id(t) for t in gen_eos],
         "pad_token_id": tok.token_to_id("<|endoftext|>")}))
    return str(tmp_path)


def hf_ids(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              return_dict=False))


# --- tokenizer and chat template ------------------------------------------------------------------

@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, QWEN2_TEMPLATE, EDGE_TEMPLATE],
                         ids=["qwen2.5", "qwen2", "edge"])
# the first is AutoTokenizer's pick
@pytest.mark.parametrize("loader", ["Qwen2Tokenizer", "PreTrainedTokenizerFast"])
def test_chat_template_ids_match_transformers(tmp_path, template, loader):
    path = qwen_like_dir(tmp_path, template)
    ours = load_tokenizer(path)
    ref = getattr(transformers, loader).from_pretrained(path)
    for messages in CHATS:
        assert ours.apply_chat_template(messages) == hf_ids(ref, messages), messages
        assert ours.render_chat(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=True)
        assert ours.render_chat(messages, add_generation_prompt=False) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False)


@pytest.mark.parametrize("template,system", [
    (QWEN25_TEMPLATE, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    (QWEN2_TEMPLATE, "You are a helpful assistant.")])
def test_chat_template_inserts_the_default_system_turn(tmp_path, template, system):
    ours = load_tokenizer(qwen_like_dir(tmp_path, template))
    text = ours.render_chat([{"role": "user", "content": "What is 2+2?"}])
    assert text == (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    with_system = ours.render_chat([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"}])
    assert (with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
            and system not in with_system)


def test_chat_template_jinja_file_takes_priority(tmp_path):
    path = qwen_like_dir(tmp_path, QWEN2_TEMPLATE, template_file=True)
    ours, ref = load_tokenizer(path), transformers.Qwen2Tokenizer.from_pretrained(path)
    assert "You are a helpful assistant." in ours.render_chat(CHATS[0])
    assert ours.apply_chat_template(CHATS[0]) == hf_ids(ref, CHATS[0])


def test_encode_and_decode_match_transformers(tmp_path):
    path = qwen_like_dir(tmp_path, QWEN25_TEMPLATE)
    ours, ref = load_tokenizer(path), transformers.Qwen2Tokenizer.from_pretrained(path)
    for text in CORPUS[:3] + [m["content"] for chat in CHATS for m in chat]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(ref)


def test_decode_skips_special_tokens(tmp_path):
    ours = load_tokenizer(qwen_like_dir(tmp_path, QWEN25_TEMPLATE))
    ids = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ours.decode(ids) == ("system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                "assistant.\nuser\nHi\nassistant\n")
    assert ours.decode(ours.encode("Answer: 34") + [ours.token_to_id("<|im_end|>")]) == "Answer: 34"


def test_eos_ids_of_an_instruct_checkpoint(tmp_path):
    ours = load_tokenizer(qwen_like_dir(tmp_path, QWEN25_TEMPLATE))
    im_end, eot = ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")
    assert ours.eos_token_ids == [im_end, eot]
    assert ours.pad_token_id == eot


def test_eos_ids_of_a_base_checkpoint_include_the_chatml_turn_end(tmp_path):
    # Qwen2.5 base: generation_config.json and tokenizer_config.json name only <|endoftext|>
    ours = load_tokenizer(qwen_like_dir(tmp_path, QWEN25_TEMPLATE, gen_eos=("<|endoftext|>",),
                                        eos_token="<|endoftext|>"))
    assert ours.eos_token_ids == [ours.token_to_id("<|endoftext|>"), ours.token_to_id("<|im_end|>")]


def test_missing_tokenizer_file_names_the_file(tmp_path):
    with pytest.raises(UserError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_missing_chat_template_is_a_clear_error(tmp_path):
    path = qwen_like_dir(tmp_path, QWEN2_TEMPLATE)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat_template"):
        load_tokenizer(path).apply_chat_template(CHATS[0])


@pytest.mark.parametrize("file, edit, message", [
    ("tokenizer_config.json", lambda config: [config],
     "tokenizer_config.json: the top level must be a JSON object ({...}), got a list"),
    ("generation_config.json", lambda gen: [gen],
     "generation_config.json: the top level must be a JSON object ({...}), got a list"),
    ("tokenizer_config.json", lambda config: {**config, "chat_template": 7},
     "tokenizer_config.json (its chat_template): must be the template's text, or a list of "
     '{"name": ..., "template": ...}, got a number'),
    ("tokenizer_config.json", lambda config: {**config, "chat_template": [{"template": "x"}]},
     "(its chat_template): must be the template's text, or a list"),
    ("tokenizer_config.json", lambda config: {**config, "eos_token": ["<|im_end|>"]},
     "tokenizer_config.json: eos_token must be a token's text"),
], ids=["config-list", "generation-list", "template-number", "template-without-name",
        "eos-list"])
def test_a_tokenizer_file_of_the_wrong_shape_is_named(tmp_path, file, edit, message):
    # before: AttributeError, TypeError or KeyError tracebacks in tools/chat.py and dapo.py
    path = qwen_like_dir(tmp_path, QWEN2_TEMPLATE)
    (tmp_path / file).write_text(json.dumps(edit(json.loads((tmp_path / file).read_text()))))
    with pytest.raises(UserError) as e:
        load_tokenizer(path)
    assert message in str(e.value)


@pytest.mark.parametrize("template_file", [False, True],
                         ids=["tokenizer_config.json", "chat_template.jinja"])
def test_a_chat_template_syntax_error_names_the_file_and_line(tmp_path, template_file):
    # "}" for "}}" on line 2
    broken = "{% for message in messages %}\n{{ message.content }\n{% endfor %}"
    with pytest.raises(ValueError, match=("chat_template.jinja" if template_file else
                                          r"tokenizer_config.json \(its chat_template\)") +
                       r": the chat template does not compile: .* \(line 2 of the template\)"):
        load_tokenizer(qwen_like_dir(tmp_path, broken, template_file=template_file))


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_named_with_both_sizes(tmp_path):
    tok = load_tokenizer(qwen_like_dir(tmp_path, QWEN25_TEMPLATE))
    # equal: fine (and larger, as Qwen2.5's padded embedding)
    check_vocab(tok.vocab_size, tok, "/models/m")
    small = tok.vocab_size - 1
    with pytest.raises(ValueError, match=rf"/models/m has vocab_size {small} .*the "
                                         rf"{tok.vocab_size} token ids of the tokenizer in "
                                         rf"{tmp_path}"):
        check_vocab(small, tok, "/models/m")


@pytest.mark.parametrize("generation,error", [
    # tokenizer_config.json names no pad token: generation_config.json's number is taken as is
    ({"pad_token_id": 99999}, r"pad_token_id 99999 is not a row of the model's embedding "
                              r"\(vocab_size 287 in /models/m/config\.json\)"),
    ({"eos_token_id": 99999}, r"eos_token_id 99999 is not a token of the tokenizer in .*: no "
                              r"response would end before --max-response-len"),
    ({"eos_token_id": [284, -1]}, r"eos_token_id -1 is not a token"),
])
def test_pad_and_eos_ids_outside_the_vocabulary_are_refused_at_load(tmp_path, generation, error):
    # before: pad 99999 gave "IndexError: index out of range in self" after the first rollout; an
    # EOS never sampled cut every response at --max-response-len and blamed the length
    toy.make_toy_tokenizer(str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [286, 284], "pad_token_id": 284} | generation))
    tok = load_tokenizer(str(tmp_path))
    assert tok.vocab_size == 287
    with pytest.raises(ValueError, match=rf"{tmp_path}/generation_config\.json: {error}"):
        check_vocab(287, tok, "/models/m")


def test_chat_template_runs_sandboxed(tmp_path):
    # a template from the Hub reaching for Python internals
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    path = qwen_like_dir(tmp_path, evil)
    with pytest.raises(ValueError, match=r"tokenizer_config.json \(its chat_template\): the chat "
                                         r"template failed: SecurityError"):
        load_tokenizer(path)  # rendered once at load


# --- datasets -------------------------------------------------------------------------------------

def dapo_row(question, answer="34", source="math_dapo", index=0):
    return {"data_source": source, "prompt": [{"role": "user", "content": PROMPT.format(question)}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule"},
            "extra_info": {"index": str(index)}}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def dapo_like_rows():
    """Three problems repeated like the released DAPO-Math-17k file (each ~100x there), shuffled."""
    rows = [dapo_row(f"Problem {p}?", str(10 + p), index=100 * p + k)
            for p in range(3) for k in range(4)]
    random.Random(0).shuffle(rows)
    return rows


def test_jsonl_rows_are_deduplicated_and_the_count_logged(tmp_path, caplog):
    rows = dapo_like_rows()
    with caplog.at_level(logging.INFO, logger="data"):
        got = load_rows(write_jsonl(tmp_path / "d.jsonl", rows))
    first_copies = [r for i, r in enumerate(rows)
                    if r["prompt"] not in [q["prompt"] for q in rows[:i]]]
    assert got == first_copies and len(got) == 3
    assert "12 rows read, 9 duplicate prompts dropped, 0 skipped, 3 kept" in caplog.text


def test_dedupe_can_be_turned_off_for_avg_at_k_copies(tmp_path):
    rows = [dapo_row("AIME problem", "204", source="aime2024", index=k) for k in range(32)]
    assert len(load_rows(write_jsonl(tmp_path / "aime.jsonl", rows), dedupe=False)) == 32
    assert len(load_rows(str(tmp_path / "aime.jsonl"))) == 1


def test_parquet_and_jsonl_give_the_same_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = dapo_like_rows()
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "d.parquet"))
    parquet = load_rows(str(tmp_path / "d.parquet"))
    assert parquet == load_rows(write_jsonl(tmp_path / "d.jsonl", rows))


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match="requirements-extra.txt"):
        load_rows(str(tmp_path / "d.parquet"))


def test_malformed_json_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(dapo_row("a")) + "\n\n"
                    + '{"data_source": "math_dapo", "prompt": [\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: malformed JSON"):
        load_rows(str(path))


@pytest.mark.parametrize("line,message", [
    ('{"data_source": ' + "1" * 5000 + "}", "Exceeds the limit (4300 digits)"),  # a ValueError
    ("[" * 100_000 + "]" * 100_000, "maximum recursion depth exceeded"),  # a RecursionError
    # json reads ~990 levels, but a row of ~960 failed later, in the rows' sha256 (a deeper
    # stack, at a checkpoint): one limit, far above any dataset's nesting
    (json.dumps(dapo_row("b"))[:-1] + ', "deep": ' + "[" * 500 + "]" * 500 + "}",
     "nested more than 100 levels deep"),
], ids=["5000-digits", "100000-deep", "500-deep"])
def test_a_line_json_cannot_read_names_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(dapo_row("a")) + "\n" + line + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:2: ") as e:
        load_rows(str(path))
    assert message in str(e.value)


@pytest.mark.parametrize("broken,message", [
    ([1, 2], "expected an object"),
    ({"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "1"}},
     "data_source"),
    ({"data_source": "math_dapo", "prompt": "just a string",
      "reward_model": {"ground_truth": "1"}}, "'prompt'"),
    ({"data_source": "math_dapo", "prompt": [{"role": "user"}],
      "reward_model": {"ground_truth": "1"}}, "'prompt'"),
    ({"data_source": "math_dapo", "prompt": [{"role": "user", "content": "x"}],
      "reward_model": "1"}, "reward_model"),
    ({"data_source": "math_dapo", "prompt": [{"role": "user", "content": "x"}],
      "reward_model": {"ground_truth": 1.5}}, "ground_truth must be a string"),
])
def test_a_row_that_breaks_the_schema_is_rejected_with_its_line(tmp_path, broken, message):
    path = write_jsonl(tmp_path / "d.jsonl", [dapo_row("fine"), broken])
    with pytest.raises(ValueError, match=f"d.jsonl:2: .*{message}"):
        load_rows(path)


def test_rows_without_ground_truth_or_prompt_are_skipped_and_counted(tmp_path, caplog):
    no_gt = dapo_row("b")
    del no_gt["reward_model"]["ground_truth"]
    rows = [dapo_row("a"), no_gt, dapo_row("c", answer=""), dapo_row("d"),
            {**dapo_row("e"), "prompt": []},
            {**dapo_row("f"), "prompt": [{"role": "user", "content": "  "}]}]
    with caplog.at_level(logging.INFO, logger="data"):
        got = load_rows(write_jsonl(tmp_path / "d.jsonl", rows))
    assert [r["prompt"] for r in got] == [dapo_row("a")["prompt"], dapo_row("d")["prompt"]]
    assert ("skipped 2 row(s) with no ground truth (first: " in caplog.text
            and "d.jsonl:2)" in caplog.text)
    assert ("skipped 2 row(s) with empty prompt (first: " in caplog.text
            and "d.jsonl:5)" in caplog.text)
    assert "6 rows read, 0 duplicate prompts dropped, 4 skipped, 2 kept" in caplog.text


def test_an_integer_ground_truth_becomes_the_string_the_verifier_compares(tmp_path):
    (row,) = load_rows(write_jsonl(tmp_path / "d.jsonl", [dapo_row("a", answer=34)]))
    assert row["reward_model"]["ground_truth"] == "34"


def test_duplicates_with_a_different_answer_are_reported(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="data"):
        got = load_rows(write_jsonl(tmp_path / "d.jsonl", [dapo_row("a", "1"), dapo_row("a", "2")]))
    assert len(got) == 1 and got[0]["reward_model"]["ground_truth"] == "1"
    assert "1 duplicate prompt(s) had a different ground truth" in caplog.text


def twelve_rows_then(bad):
    # the bad row is on line 13 / row 12
    return [dapo_row(f"problem {i}") for i in range(12)] + [bad]


def test_a_row_without_a_reward_function_stops_the_load_with_its_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", twelve_rows_then(dapo_row("q", source="gsm8k")))
    with pytest.raises(ValueError, match=r"d.jsonl:13: no reward function for data_source 'gsm8k'"):
        load_rows(path, rewarded=has_built_in_verifier)


def test_the_error_names_the_data_sources_a_built_in_verifier_scores(tmp_path):
    from reward import Verifier
    path = write_jsonl(tmp_path / "d.jsonl", twelve_rows_then(dapo_row("q", source="gsm8k")))
    verifier = Verifier()
    with pytest.raises(ValueError, match=r"score the data_sources .*math_dapo.*openai/gsm8k.*aime"):
        load_rows(path, rewarded=verifier.rewards,
                  known_data_sources=verifier.built_in_data_sources())


def test_without_rewarded_a_row_of_any_data_source_loads(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", twelve_rows_then(dapo_row("q", source="gsm8k")))
    assert load_rows(path)[-1]["data_source"] == "gsm8k"  # its verifier is the caller's to give


def test_a_lone_surrogate_stops_the_load_with_its_line(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, twelve_rows_then(dapo_row("SURROGATE")))
    # the JSON escape, as a file would hold it
    path.write_text(path.read_text().replace("SURROGATE", "\\ud800"))
    with pytest.raises(ValueError, match=r"d.jsonl:13: the prompt holds '\\ud800' at character "
                                         r"\d+, half of a"):
        load_rows(str(path))


def test_a_prompt_the_chat_template_cannot_render_stops_the_load_with_its_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    template = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
                "{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
                "{{ m.content }}{% endfor %}")
    tok = load_tokenizer(qwen_like_dir(tmp_path, template))
    bad = {**dapo_row("q"), "prompt": [{"role": "tool", "content": "42"}]}
    pq.write_table(pa.Table.from_pylist(twelve_rows_then(bad)), str(tmp_path / "d.parquet"))
    # without the tokenizer nothing renders
    assert len(load_rows(str(tmp_path / "d.parquet"))) == 13
    with pytest.raises(ValueError, match=r"d.parquet: row 12: the chat template of .* cannot "
                                         r"render this prompt: .*unknown role tool"):
        load_rows(str(tmp_path / "d.parquet"), tok)


def test_a_prompt_the_tokenizer_cannot_encode_stops_the_load_with_its_line(tmp_path, monkeypatch):
    tok = load_tokenizer(qwen_like_dir(tmp_path, QWEN25_TEMPLATE))
    path = write_jsonl(tmp_path / "d.jsonl", twelve_rows_then(dapo_row("UNENCODABLE")))
    assert len(load_rows(path, tok)) == 13
    encode = tok.encode

    # the batch call fails as a whole; the row is found by encoding one text at a time
    def refuse(text):
        if "UNENCODABLE" in text:
            raise TypeError("TextInputSequence must be str")
        return encode(text)
    monkeypatch.setattr(tok, "encode", refuse)
    monkeypatch.setattr(tok, "encode_batch", lambda texts: [refuse(t) for t in texts])
    with pytest.raises(ValueError, match=r"d.jsonl:13: the tokenizer of .* cannot encode this "
                                         r"prompt: TypeError"):
        load_rows(path, tok)


def test_a_byte_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    good = "".join(json.dumps(dapo_row(f"p{i}")) + "\n" for i in range(2))
    bad = json.dumps(dapo_row("caf\xe9"), ensure_ascii=False).encode("latin-1")
    path.write_bytes(good.encode() + bad + b"\n")
    with pytest.raises(ValueError, match=r"d.jsonl:3: the file is not UTF-8 text \(byte 0xe9 at "
                                         r"byte \d+"):
        load_rows(str(path))


def test_a_byte_order_mark_is_not_an_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(dapo_row("a")) + "\n").encode())
    assert len(load_rows(str(path))) == 1


def test_a_truncated_parquet_file_is_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(dapo_like_rows()), str(tmp_path / "d.parquet"))
    data = (tmp_path / "d.parquet").read_bytes()
    (tmp_path / "d.parquet").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"d.parquet: not a readable parquet file after 0 rows; "
                                         r"truncated"):
        load_rows(str(tmp_path / "d.parquet"))


def test_unknown_format_and_empty_files_are_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown data format"):
        load_rows(str(tmp_path / "d.csv"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no usable rows"):
        load_rows(str(tmp_path / "empty.jsonl"))


def test_encode_prompts_truncates_long_prompts_from_the_left(tmp_path):
    tok = load_tokenizer(qwen_like_dir(tmp_path, QWEN25_TEMPLATE))
    rows = [dapo_row("short"), dapo_row("long " * 200)]
    full = [tok.apply_chat_template(r["prompt"]) for r in rows]
    limit = len(full[0]) + 5
    assert len(full[1]) > limit
    ids, n_truncated = encode_prompts(rows, tok, limit)
    assert n_truncated == 1
    assert ids[0] == full[0]
    # the end survives: the question's tail and the assistant header
    assert ids[1] == full[1][-limit:]


# --- prompt iterator ------------------------------------------------------------------------------

def test_prompt_iterator_batches_are_shuffled_epochs():
    rows = [{"i": i} for i in range(12)]
    it = PromptIterator(rows, batch_size=4, seed=0)
    epoch0 = [r["i"] for _ in range(3) for r in it.next_batch()]
    epoch1 = [r["i"] for _ in range(3) for r in it.next_batch()]
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))  # each epoch sees every row once
    assert epoch0 != list(range(12)) and epoch0 != epoch1  # shuffled, differently each epoch
    assert it.epoch == 1


def test_prompt_iterator_drops_the_ragged_end_of_an_epoch():
    it = PromptIterator([{"i": i} for i in range(10)], batch_size=4, seed=0)
    sizes = [len(it.next_batch()) for _ in range(5)]
    # 2 batches per epoch; the 2 leftover rows wait for a reshuffle
    assert sizes == [4] * 5 and it.epoch == 2


def test_prompt_iterator_order_depends_on_the_seed_only():
    rows = [{"i": i} for i in range(50)]
    def run(seed):
        return [r["i"] for _ in range(7) for r in PromptIterator(rows, 8, seed).next_batch()]
    assert run(1) == run(1) and run(1) != run(2)


def test_prompt_iterator_resumes_exactly_from_its_state():
    rows = [{"i": i} for i in range(10)]
    it = PromptIterator(rows, batch_size=3, seed=7)
    for _ in range(4):  # into the second epoch
        it.next_batch()
    state = json.loads(json.dumps(it.state_dict()))  # a checkpoint stores it as JSON
    resumed = PromptIterator(rows, batch_size=3, seed=7)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(6)] == [it.next_batch() for _ in range(6)]


def test_prompt_iterator_refuses_a_state_from_other_data():
    state = PromptIterator([{"i": i} for i in range(10)], 3, seed=7).state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        PromptIterator([{"i": i} for i in range(10)], 4, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="num_rows"):
        PromptIterator([{"i": i} for i in range(11)], 3, seed=7).load_state_dict(state)


def test_prompt_iterator_needs_a_batch_that_fits():
    with pytest.raises(ValueError, match="batch_size"):
        PromptIterator([{"i": 0}], batch_size=2, seed=0)


@pytest.mark.parametrize("template,why", [
    ("{{ 'x' * 20000000 }}", "builds a value of more than"),  # one 20 MB string
    ("{% for i in range(100000) %}{{ 'abcdefghijk' }}{% endfor %}",
     "renders more than"),  # many small pieces
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "takes more than"),  # no output at all, 10^10 iterations
    ("{{ raise_exception('only user turns') }}", "only user turns"),  # a failure, not a bound
], ids=["one-big-string", "many-pieces", "silent-loops", "raises"])
def test_a_runaway_chat_template_is_stopped_at_load_naming_it(tmp_path, monkeypatch, template,
                                                               why):
    from infra import templates
    monkeypatch.setattr(templates, "MAX_RENDER_S", 0.5)  # silent loops wait it out: keep it short
    with pytest.raises(ValueError, match=r"tokenizer_config.json \(its chat_template\): the chat "
                                         rf"template .*{why}"):
        load_tokenizer(qwen_like_dir(tmp_path, template))


NS = "{% set ns = namespace(s='x' * 1000) %}"


@pytest.mark.parametrize("template,what", [
    # nothing output: before, only `*` and the output were bounded
    (NS + "{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "(~)"),  # 1 TB
    (NS + "{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "(+)"),
    ("{% set _ = 'x'.ljust(900000000) %}", "(ljust())"),  # 0.9 GB at every render
    ("{% set _ = '{:>900000000}'.format(1) %}", "(format())"),
    ("{% set _ = '%*s' % (900000000, 'x') %}", "(%)"),
    ("{% set _ = '%900000000s'|format('x') %}", "(the filter format)"),
    ("{% set _ = [[[1]]]|tojson(indent=900000000) %}", "(the filter tojson)"),
    (NS + "{% set _ = ns.s.replace('x', ns.s * 999) %}", "(replace())"),
    (NS + "{% set _ = (ns.s * 900)|indent(900000) %}", "(the filter indent)"),
    (NS + "{% set b %}{% for i in range(1001) %}{{ ns.s * 999 }}{% endfor %}{% endset %}",
     "(a block's output)"),
    ("{% set _ = range(100000)|map('center', 999000)|list %}", "(the items of an iterator)"),
    ("{% set _ = 2 ** (2 ** 40) %}", "integer of more than"),
], ids=["concat", "plus", "ljust", "format", "percent-star", "format-filter", "tojson-indent",
        "replace", "indent", "block", "generator", "power"])
def test_what_a_chat_template_builds_is_bounded_before_it_is_allocated(tmp_path, template, what):
    with pytest.raises(UserError, match=r"tokenizer_config.json \(its chat_template\): the chat "
                                        r"template failed: _TemplateBound: builds a") as e:
        load_tokenizer(qwen_like_dir(tmp_path, template + QWEN2_TEMPLATE))
    assert what in str(e.value)


def test_a_template_may_build_up_to_the_bound(tmp_path):
    template = ("{% set _ = 'x' * 999999 %}{% set _ = 'x'.ljust(999999) %}"
                "{% set _ = ('a</think>' * 90000).split('</think>') %}"
                "{% set _ = {'a': [1, {'b': 'c'}]}|tojson(indent=2) %}" + QWEN2_TEMPLATE)
    assert load_tokenizer(qwen_like_dir(tmp_path, template)).render_chat(CHATS[0])
