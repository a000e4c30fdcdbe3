"""
Talk to a model: the model/ directory of a checkpoint (dapo.py's runs end by printing this
command for their last one), any Hugging Face directory of a Qwen2/Qwen2.5, Llama or Qwen3, or
its name on the Hub. Every turn goes through the model's own chat template, and the reply is
printed token by token as it is sampled, by the rollout's own code: sampler.py's prefill, sample
and decode over model.py's KV cache (no transformers). nanochat's scripts/chat_cli.py is the
model for this script.

    python tools/chat.py --model runs/demo/checkpoints/step_000040/model --prompt "What is 2 + 3?"
    python tools/chat.py --model Qwen/Qwen2.5-0.5B-Instruct      # a conversation: quit, or clear

One --prompt: its reply alone is printed, then the script ends. Without one, a conversation on
the terminal (or stdin): each reply joins the history the next turn's prompt is rendered from.
Ctrl-C while a reply streams ends that reply (its turn is left out of the history) and returns to
the prompt; with --prompt, or at the prompt, it ends the script.
"""
import argparse
import os
import re
import sys

# run as a script (python tools/chat.py), from any directory: the project's modules are one up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from config import device_problems, not_finite, seed_problems
from data import Tokenizer, check_vocab, load_tokenizer
from infra import distributed, hub, precision
from infra.errors import UserError
from infra.precision import PRECISIONS
from model import Transformer, num_params
from sampler import decode_one_token, prefill_slots, sample

QUIT, CLEAR = ("quit", "exit"), "clear"  # the conversation's commands, as nanochat's


@torch.no_grad()
def stream(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float,
           top_p: float, eos_token_ids: list[int], generator: torch.Generator):
    """Yield the tokens of one response as they are sampled: sampler.generate() for one prompt in
    one cache slot, whose prefill, sample and decode steps these are, so that for the same prompt
    and generator the tokens are generate()'s."""
    device = model.model.embed_tokens.weight.device
    kv_cache = model.new_kv_cache(1, len(prompt) + max_new_tokens)
    logits = prefill_slots(model, [prompt], [0], kv_cache)  # (1, V)
    for n in range(max_new_tokens):
        token, _ = sample(logits, temperature, 0, top_p, generator)  # (1,)
        yield int(token)
        if int(token) in eos_token_ids or n == max_new_tokens - 1:
            return
        position = len(prompt) + n  # where this token's key goes
        logits = decode_one_token(model, token, torch.tensor([position], device=device),
                                  kv_cache.upto(position + 1))  # (1, V)


def show(tokens, tok: Tokenizer, out) -> str:
    """Print the text of tokens (an iterable of ids) to out as they come -> the whole text. A
    token may end inside a character (byte-level BPE splits UTF-8): its text waits for the
    rest."""
    ids, shown = [], ""
    for token in tokens:
        ids.append(token)
        text = tok.decode(ids)  # special tokens (the EOS) are not shown
        if not text.endswith("\ufffd"):  # the replacement character of a partial one
            out.write(text[len(shown):])
            out.flush()
            shown = text
    text = tok.decode(ids)
    out.write(text[len(shown):] + "\n")
    return text


class Chat:
    """A model, its tokenizer and the settings; reply() answers a conversation's last message."""

    def __init__(self, args):
        model_dir = args.model
        if name := hub.parse(model_dir, "model"):  # a name on the Hub: its snapshot
            model_dir = hub.fetch(name, "--model")
        self.device = args.device
        self.model = Transformer.from_pretrained(model_dir, dtype=torch.float32, device=self.device)
        self.model.eval()
        self.precision = precision.resolve(args.precision, self.device, num_params(self.model))
        self.tok = load_tokenizer(model_dir)
        check_vocab(self.model.config.vocab_size, self.tok, model_dir)
        self.args = args
        self.generator = torch.Generator(self.device).manual_seed(args.seed)

    def reply(self, messages: list[dict], out) -> str | None:
        """Sample the reply to messages, printing it as it comes -> its text; None when the
        conversation has no room left in the model's positions."""
        prompt = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        room = self.model.config.max_position_embeddings - len(prompt)
        if room < 1:
            return None
        tokens = stream(self.model, prompt, min(self.args.max_new_tokens, room),
                        self.args.temperature, self.args.top_p, self.tok.eos_token_ids,
                        self.generator)
        with precision.autocast(self.precision, self.device):  # the generator runs in here
            return show(tokens, self.tok, out)


def converse(chat: Chat, lines, out):
    """The conversation: each line a user's turn (quit, exit or the end of the input end it; clear
    starts again), each reply printed as it comes and kept in the history."""
    messages = []
    out.write(f"chat with {chat.args.model}: {' or '.join(QUIT)} ends, {CLEAR} starts again\n")
    while True:
        out.write("\nUser: ")
        out.flush()
        line = next(lines, None)
        if line is None or line.strip().lower() in QUIT:
            out.write("\n")
            return
        if line.strip().lower() == CLEAR:
            messages = []
            out.write("(a new conversation)\n")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": valid_text(line.strip())})
        out.write("Assistant: ")
        try:
            text = chat.reply(messages, out)
        except KeyboardInterrupt:  # Ctrl-C while the reply streams: that reply ends, not the chat
            messages.pop()
            out.write("\n(stopped: this turn is left out of the conversation)\n")
            continue
        if text is None:
            messages.pop()
            out.write(f"(the conversation fills the model's "
                      f"{chat.model.config.max_position_embeddings} positions: {CLEAR} starts "
                      "again)\n")
            continue
        messages.append({"role": "assistant", "content": text})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a model directory (a checkpoint's model/) or a name on the Hub")
    parser.add_argument("--prompt", default="",
                        help="one message: print its reply and end; empty: a conversation")
    parser.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling, 1 = off")
    parser.add_argument("--max-new-tokens", type=int, default=512,
                        help="tokens of a reply at most")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    parser.add_argument("--precision", default="auto", choices=PRECISIONS,
                        help="auto: bf16 on CUDA, and on a CPU where it is faster")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def check_args(args):
    """The flags checked as dapo.py's are (config.py's checks): finite numbers in their range, a
    seed the generators take, a device this machine has. Before, --temperature nan reached the
    sampler ("index out of bounds") and --device cuda:99 an AssertionError."""
    problems = [p for p in (not_finite("--temperature", args.temperature),
                            not_finite("--top-p", args.top_p)) if p]
    if args.temperature < 0:
        problems.append(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    problems += seed_problems(args.seed) + device_problems(args.device)
    if problems:  # one line, as dapo.py's
        raise UserError("bad flags: " + "; ".join(problems))


def main(argv=None, lines=None, out=sys.stdout):
    """lines: the conversation's input lines (default: the terminal's, or stdin's)."""
    args = parse_args(argv)
    try:
        check_args(args)
        chat = Chat(args)
        if not args.prompt:
            converse(chat, iter(lines) if lines is not None else _input_lines(), out)
        elif chat.reply([{"role": "user", "content": valid_text(args.prompt)}], out) is None:
            positions = chat.model.config.max_position_embeddings
            raise UserError(f"--prompt: more tokens than the {positions} positions of "
                            f"{args.model}")
    except UserError as e:  # a user's mistake (no such directory): one line, exit status 2
        distributed.fail(str(e))
    except KeyboardInterrupt:  # Ctrl-C while loading, or while --prompt's reply streams
        out.write("\n")
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        raise SystemExit(130) from None


def valid_text(text: str) -> str:
    """text with its lone surrogates (bytes that were not UTF-8, in an argument or, under the C
    locale, on stdin) as U+FFFD: the tokenizer takes no surrogate ("TextInputSequence must be
    str")."""
    return re.sub("[\ud800-\udfff]", "\ufffd", text)


def _input_lines():
    """Lines of stdin, read as they are typed, until its end (or Ctrl-C at the prompt). A byte
    that is not UTF-8 is read as U+FFFD, not a UnicodeDecodeError."""
    if hasattr(sys.stdin, "reconfigure"):  # a TextIOWrapper (not a test's StringIO)
        sys.stdin.reconfigure(errors="replace")
    while True:
        try:
            yield input()
        except (EOFError, KeyboardInterrupt):
            return


if __name__ == "__main__":
    main()
