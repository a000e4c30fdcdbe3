"""tools/chat.py: the reply streamed token by token is the sampler's, a conversation keeps its
history through the chat template, and make run / make real end with a chat command that runs."""
import io
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from tools import chat
import dapo
from data import load_tokenizer
from model import Transformer, preset
from sampler import generate
from test_dapo import _cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")


@pytest.fixture(scope="module")
def talkative_dir(tmp_path_factory, tiny_model_dir):
    """A tiny random model with the toy tokenizer, its weights drawn 10x wider than an init's
    (std 0.2): its greedy reply changes from token to token, where the init's repeats one."""
    d = str(tmp_path_factory.mktemp("talkative"))
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=load_tokenizer(tiny_model_dir).vocab_size))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" not in name:
                weight.normal_(0, 0.2)
    model.save_pretrained(d, tokenizer_dir=tiny_model_dir)
    return d


def generated_text(model_dir, messages, max_new_tokens, temperature, top_p, seed) -> str:
    """sampler.generate()'s reply to messages, decoded."""
    model = Transformer.from_pretrained(model_dir, dtype=torch.float32)
    tok = load_tokenizer(model_dir)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    out = generate(model, [prompt], max_new_tokens, temperature=temperature, top_p=top_p,
                   eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                   generator=torch.Generator().manual_seed(seed))
    return tok.decode(out.response_ids[0, :out.lengths[0]].tolist())


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 0.9)], ids=["greedy", "top-p"])
def test_the_streamed_reply_is_the_samplers_for_the_same_prompt(talkative_dir, temperature,
                                                                 top_p):
    out = io.StringIO()
    chat.main(["--model", talkative_dir, "--prompt", "What is 2 + 3?", "--max-new-tokens", "24",
               "--temperature", str(temperature), "--top-p", str(top_p), "--seed", "3"], out=out)
    expected = generated_text(talkative_dir, [{"role": "user", "content": "What is 2 + 3?"}], 24,
                              temperature, top_p, seed=3)
    assert len(set(expected)) > 5  # a reply that varies, not one token repeated
    assert out.getvalue() == expected + "\n"


def test_each_token_is_printed_as_it_comes_and_never_half_a_character(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    text = "2 + 3 = 5, é 日本 ✓"
    ids = tok.encode(text)
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # the last character spans several tokens
    writes = []

    class Recorder(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    assert chat.show(iter(ids), tok, Recorder()) == text
    # the toy tokenizer's tokens here are single bytes: each character is printed as soon as its
    # last byte is, the multi-byte ones (é 日 本 ✓) whole
    assert len(ids) > len(text) and [w for w in writes if w] == list(text) + ["\n"]


def test_a_conversation_renders_every_turn_through_the_chat_template(talkative_dir, monkeypatch):
    prompts, stream = [], chat.stream
    monkeypatch.setattr(chat, "stream", lambda model, prompt, *a: prompts.append(prompt) or
                        stream(model, prompt, *a))
    out = io.StringIO()
    chat.main(["--model", talkative_dir, "--max-new-tokens", "6", "--temperature", "0"],
              lines=["What is 1 + 1?", "", "And 2 + 2?", "clear", "Hi", "quit", "never read"],
              out=out)
    replies = re.findall(r"Assistant: (.*?)\n\nUser: ", out.getvalue(), re.S)
    tok = load_tokenizer(talkative_dir)
    first = [{"role": "user", "content": "What is 1 + 1?"}]
    second = first + [{"role": "assistant", "content": replies[0]},
                      {"role": "user", "content": "And 2 + 2?"}]
    third = [{"role": "user", "content": "Hi"}]  # after clear
    assert prompts == [tok.apply_chat_template(m, add_generation_prompt=True)
                       for m in (first, second, third)]
    assert replies[0] == generated_text(talkative_dir, first, 6, 0.0, 1.0, seed=0)


def test_the_conversation_reads_stdin_until_its_end(talkative_dir):
    out = subprocess.run([sys.executable, "tools/chat.py", "--model", talkative_dir,
                          "--max-new-tokens", "4"], cwd=ROOT, input="Hello\nHow are you?\n",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("Assistant: ") == 2 and out.stdout.count("User: ") == 3


@pytest.mark.parametrize("argv, message", [
    (["--model", "no/such/dir"], "error: no/such/dir/config.json: not found (is 'no/such/dir' a "
                                 "Hugging Face model directory?)"),
    (["--model", "tiny-org/absent"], "error: --model tiny-org/absent: no such local path, and "
                                     "the model tiny-org/absent is not (or not whole) in the "
                                     "Hugging Face cache"),
])
def test_a_model_that_is_not_there_is_one_line(argv, message, tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "tools/chat.py", *argv, "--prompt", "hi"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(message) and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_stdin_that_is_not_utf8_is_read_with_replacement_characters(monkeypatch, errors):
    # before: a UnicodeDecodeError (a UTF-8 locale), or lone surrogates (C.UTF-8) that the
    # tokenizer refused with a TypeError
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9\n\xed\xa0\x80?\n"), encoding="utf-8",
                             errors=errors)
    monkeypatch.setattr(sys, "stdin", stdin)
    assert list(chat._input_lines()) == ["caf\ufffd", "\ufffd\ufffd\ufffd?"]


def test_a_lone_surrogate_in_a_turn_or_a_prompt_is_replaced_not_a_traceback(talkative_dir):
    # an argument of bytes that are not UTF-8 reaches Python as lone surrogates
    argv = ["--model", talkative_dir, "--max-new-tokens", "3", "--temperature", "0"]
    by_line, by_prompt, replaced = io.StringIO(), io.StringIO(), io.StringIO()
    chat.main(argv, lines=["caf\udce9", "quit"], out=by_line)
    chat.main([*argv, "--prompt", "caf\udce9"], out=by_prompt)
    chat.main([*argv, "--prompt", "caf\ufffd"], out=replaced)
    assert by_prompt.getvalue() == replaced.getvalue() and "Assistant: " in by_line.getvalue()


def interrupted_once(real_stream):
    """chat.stream, whose first reply is cut by a Ctrl-C after two tokens."""
    calls = []

    def stream(*args):
        calls.append(args)
        tokens = real_stream(*args)
        if len(calls) == 1:
            yield next(tokens)
            yield next(tokens)
            raise KeyboardInterrupt
        yield from tokens
    return stream


def test_ctrl_c_while_a_reply_streams_returns_to_the_prompt(talkative_dir, monkeypatch):
    # before: a KeyboardInterrupt traceback, exit status -2
    prompts, real_stream = [], chat.stream
    monkeypatch.setattr(chat, "stream", interrupted_once(
        lambda model, prompt, *a: prompts.append(prompt) or real_stream(model, prompt, *a)))
    out = io.StringIO()
    chat.main(["--model", talkative_dir, "--max-new-tokens", "6", "--temperature", "0"],
              lines=["Hi", "What is 1 + 1?", "quit"], out=out)
    assert "\n(stopped: this turn is left out of the conversation)\n\nUser: " in out.getvalue()
    tok = load_tokenizer(talkative_dir)
    second = [{"role": "user", "content": "What is 1 + 1?"}]  # without the stopped turn
    assert prompts[1] == tok.apply_chat_template(second, add_generation_prompt=True)
    assert out.getvalue().endswith("User: \n")  # the conversation went on to its end


def test_ctrl_c_during_the_reply_to_a_prompt_is_one_line_and_exit_status_130(
        talkative_dir, monkeypatch, capsys):
    monkeypatch.setattr(chat, "stream", interrupted_once(chat.stream))
    with pytest.raises(SystemExit) as e:
        chat.main(["--model", talkative_dir, "--prompt", "Hi", "--max-new-tokens", "6"])
    assert e.value.code == 130 and capsys.readouterr().err == "error: interrupted (Ctrl-C)\n"


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--top-p", "inf"], "--top-p must be a finite number, got inf"),
    (["--temperature", "-1"], "--temperature must be >= 0 (0: greedy), got -1.0"),
    (["--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
    (["--device", "cuda:99"], "--device must be a CUDA device this machine has"),
    (["--device", "foo"], "--device must be cpu, cuda or cuda:N, got 'foo'"),
])
def test_chats_flags_are_checked_as_dapos_before_the_model_loads(flags, message, capsys):
    # before: --temperature nan reached the sampler ("index out of bounds"), --device cuda:99
    # an AssertionError; "no/such/dir" is never looked at
    with pytest.raises(SystemExit) as e:
        chat.main(["--model", "no/such/dir", "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: bad flags: ") and message in err
    assert err.count("\n") == 1


def test_chat_takes_a_name_on_the_hub(talkative_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants
    from test_hub import cache_repo
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    files = {name: open(os.path.join(talkative_dir, name), "rb").read()
             for name in os.listdir(talkative_dir)}
    cache_repo(tmp_path, "model", "tiny-org/talkative", files, "c" * 40)
    argv = ["--prompt", "Hi", "--max-new-tokens", "5", "--temperature", "0"]
    by_name, by_path = io.StringIO(), io.StringIO()
    chat.main(["--model", "tiny-org/talkative", *argv], out=by_name)
    chat.main(["--model", talkative_dir, *argv], out=by_path)
    assert by_name.getvalue() == by_path.getvalue()


# --- make run and make real end with the command that chats with what they trained -------------

def make_recipe(target: str) -> list[str]:
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    return re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M).group(1).strip().splitlines()


@pytest.mark.needs("all")
def test_make_run_ends_with_a_chat_command_that_runs(tiny_model_dir, tmp_path):
    recipe = make_recipe("run")
    train = shlex.split(next(line for line in recipe if "dapo.py" in line))
    out_dir = train[train.index("--out-dir") + 1]  # runs/demo
    dapo.main(_cfg(tiny_model_dir, tmp_path / out_dir, steps=1, eval_every=0))
    echo = recipe[-1].removeprefix("\t").removeprefix("@").replace("$(PY)", sys.executable)
    printed = subprocess.run(["sh", "-c", echo.replace("$$", "$")], cwd=tmp_path,
                             capture_output=True, text=True, check=True).stdout
    python, script, flag, model_dir = shlex.split(printed.removeprefix("chat with it:"))
    assert (python, script, flag) == (sys.executable, "tools/chat.py", "--model")
    assert model_dir == f"{out_dir}/checkpoints/step_000001/model"
    out = io.StringIO()
    chat.main(["--model", str(tmp_path / model_dir), "--prompt", "Hi", "--max-new-tokens", "3"],
              out=out)
    assert out.getvalue().endswith("\n")
