"""Chat templates are code from a model's directory: compiled in jinja2's sandbox, as
transformers does, and rendered within bounds, so that `{{ 'x' * 10**9 }}` or nested loops stop
with an error instead of hanging the loader. A real template renders a prompt of a few kB in well
under a millisecond."""
import contextlib
import json
import signal
import threading

from jinja2 import TemplateSyntaxError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infra.errors import UserError

MAX_RENDER_CHARS = 1_000_000
MAX_RENDER_S = 5.0


class _TemplateBound(Exception):
    pass


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*"})  # str * n is checked before it allocates

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and \
                    len(seq) * n > MAX_RENDER_CHARS:
                raise _TemplateBound(f"renders more than {MAX_RENDER_CHARS} characters "
                                     f"({len(seq)} * {n})")
        return super().call_binop(context, operator, left, right)


def render(template, **context) -> str:
    """The template's output, stopped past MAX_RENDER_CHARS characters or MAX_RENDER_S seconds."""
    with _time_limit(MAX_RENDER_S):
        return _bounded_output(template, **context)


def _bounded_output(template, **context) -> str:
    pieces, size = [], 0
    for piece in template.generate(**context):
        size += len(piece)
        if size > MAX_RENDER_CHARS:
            raise _TemplateBound(f"renders more than {MAX_RENDER_CHARS} characters")
        pieces.append(piece)
    return "".join(pieces)


@contextlib.contextmanager
def _time_limit(seconds: float):
    """SIGALRM stops a template that loops without writing (the output bound never fires). Only
    the main thread gets signals: elsewhere only the output bound holds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _TemplateBound(f"takes more than {seconds:g} s to render")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def compile_template(source: str, where: str):
    # The environment transformers uses: sandboxed (a template from the Hub is untrusted code),
    # trim_blocks and lstrip_blocks (they change the whitespace, hence the ids), loop controls, and
    # its tojson / raise_exception.
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def raise_exception(message):
        raise UserError(f"chat template: {message}")

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:
        # compiled on load, so a broken template stops the run before any training
        raise UserError(f"{where}: the chat template does not compile: {e.message} (line "
                        f"{e.lineno} of the template)") from None
