"""Chat templates are code from a model's directory: compiled in jinja2's sandbox, as
transformers does, and rendered within bounds, so that `{{ 'x' * 10**9 }}` or nested loops stop
with an error instead of hanging the loader. A real template renders a prompt of a few kB in well
under a millisecond.

What a template builds is bounded before it is allocated, not only what it outputs: a value of
more than MAX_RENDER_CHARS characters (as str() or JSON would write it) from an operator (`*`,
`+`, `%`, `~`), a string method (ljust, replace, join, format...), a filter (center, indent,
join, tojson with an indent...) or a block's captured output stops the render, as does an integer
of more than MAX_INT_BITS bits. Before, `{% set ns.s = ns.s ~ ns.s %}` in a loop reached 1.5 GB,
and `{% set _ = 'x'.ljust(900000000) %}` allocated 0.9 GB at every prompt."""
import collections.abc
import contextlib
import functools
import inspect
import json
import re
import signal
import threading

from jinja2 import TemplateSyntaxError
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from infra.errors import UserError

MAX_RENDER_CHARS = 1_000_000
MAX_RENDER_S = 5.0
MAX_INT_BITS = 100_000  # ~30,000 digits; Python prints no int past 4,300


class _TemplateBound(Exception):
    pass


def _size(value, indent: int = 0, separators: int = 4) -> int:
    """An upper bound of len(str(value)) (or of its JSON with this indent and separators'
    length), counted only up to just past MAX_RENDER_CHARS: a walk of at most that many steps."""
    if isinstance(value, str):  # most of what a template computes, at once
        return len(value)
    total, stack = 0, [(value, 1)]
    while stack and total <= MAX_RENDER_CHARS:
        v, depth = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v) + (2 if depth > 1 else 0)  # quoted inside a list or an object
        elif isinstance(v, Namespace):  # its repr holds its attributes
            stack.append((v._Namespace__attrs, depth))
        elif isinstance(v, (dict, list, tuple, set, frozenset)):
            total += 2 + len(v) * (separators + 1 + indent * depth)
            items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2  # decimal digits, at most
        else:  # None, a float, a generator, a range: a short repr
            total += 24
    return total


def _check(size: int, what: str):
    if size > MAX_RENDER_CHARS:
        raise _TemplateBound(f"builds a value of more than {MAX_RENDER_CHARS} characters "
                             f"({what})")


def _bounded(value, what: str):
    """value, once its size is checked (an integer's bits too)."""
    if isinstance(value, str):
        _check(len(value), what)
        return value
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _TemplateBound(f"builds an integer of more than {MAX_INT_BITS} bits ({what})")
    _check(_size(value), what)
    return value


def _taken(value):
    """An iterator's items as a list, stopped past the bound: a filter or a method that keeps
    them all (list, join, sum...) would otherwise hold all of a generator's items at once."""
    if not isinstance(value, collections.abc.Iterator):
        return value
    items, size = [], 0
    for item in value:
        size += _size(item)
        _check(size, "the items of an iterator")
        items.append(item)
    return items


def _format_size(fmt: str, args) -> int:
    """An upper bound of the length of fmt % args or fmt.format(*args): the widths and precisions
    its fields spell, and those it takes from the arguments (`%*s`, `{:{}}`), on top of the
    arguments themselves."""
    fields = re.findall(r"%[^a-zA-Z%]*|\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}", fmt)
    widths = sum(int(d) for spec in fields for d in re.findall(r"\d+", spec))
    if any("*" in spec or spec.count("{") > 1 for spec in fields):
        values = args.values() if isinstance(args, dict) else \
            args if isinstance(args, (tuple, list)) else [args]
        widths += sum(abs(v) for v in values if isinstance(v, int))
    return len(fmt) + _size(args) + widths


def _int(value) -> int:
    return value if isinstance(value, int) else 0


def _text(value) -> str:
    return value if isinstance(value, (str, bytes)) else ""


def _replace_size(s, old, new) -> int:
    """An upper bound of the length of s with old replaced by new."""
    if isinstance(s, (str, bytes)) and type(old) is type(new) is type(s):
        hits = s.count(old) if old else len(s) + 1
        return len(s) + hits * max(0, len(new) - len(old))
    return _size(s) * (1 + _size(new))  # str() of each, replaced anywhere


def _join_size(items, separator) -> int:
    return _size(items) + len(_text(separator)) * (len(items) if hasattr(items, "__len__") else 0)


# The size of a str (or bytes) method's result, for those whose result can grow past their
# inputs' sizes, from (the string, its arguments by position, by name)
STRING_METHODS = {
    "ljust": lambda s, a, k: len(s) + _int(a[0] if a else k.get("width")),
    "rjust": lambda s, a, k: len(s) + _int(a[0] if a else k.get("width")),
    "center": lambda s, a, k: len(s) + _int(a[0] if a else k.get("width")),
    "zfill": lambda s, a, k: len(s) + _int(a[0] if a else k.get("width")),
    "expandtabs": lambda s, a, k: len(s) + s.count("\t" if isinstance(s, str) else b"\t")
    * _int(a[0] if a else k.get("tabsize", 8)),
    "replace": lambda s, a, k: _replace_size(s, a[0], a[1]),
    "join": lambda s, a, k: _join_size(a[0], s),
    "translate": lambda s, a, k: len(s) * max([1, *(_size(v) for v in a[0].values())])
    if a and isinstance(a[0], dict) else len(s),
    "format": lambda s, a, k: _format_size(s, (*a, *k.values())),
    "format_map": lambda s, a, k: _format_size(s, a[0] if a else {}),
    "hex": lambda s, a, k: len(s) * (2 + _size(a[0] if a else k.get("sep", ""))),
}


def _method_size(obj, args, kwargs) -> int:
    """The size bound of a call of a string's method (the sandbox's own wrapper of format), or
    of an int's to_bytes; 0 for any other call."""
    method = getattr(obj, "__wrapped__", obj)
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if isinstance(owner, (str, bytes)) and name in STRING_METHODS:
        try:
            return STRING_METHODS[name](owner, args, kwargs)
        except (IndexError, TypeError, AttributeError):  # wrong arguments: the call says so
            return 0
    if isinstance(owner, int) and name == "to_bytes":
        return _int(args[0] if args else kwargs.get("length", 1))
    return 0


# The size of a filter's result, for those whose result can grow past their inputs' sizes, from
# the value filtered and the other arguments by name (jinja2's own names)
FILTERS = {
    "center": lambda v, a: _size(v) + _int(a.get("width", 80)),
    "indent": lambda v, a: _size(v) + (_text(v).count("\n") + 1)
    * (_int(a.get("width", 4)) or len(_text(a.get("width")))),
    "wordwrap": lambda v, a: _size(v) + (_size(v) // max(1, _int(a.get("width", 79)))
                                         + _text(v).count("\n") + 1)
    * max(1, len(_text(a.get("wrapstring")))),
    "replace": lambda v, a: _replace_size(v, a.get("old"), a.get("new")),
    "join": lambda v, a: _join_size(v, a.get("d")),
    "format": lambda v, a: _format_size(_text(v), a.get("kwargs") or a.get("args")),
    "tojson": lambda v, a: _size(v, _int(a.get("indent")) or len(_text(a.get("indent"))),
                                 sum(len(_text(s)) for s in a.get("separators") or ()) or 4),
    "batch": lambda v, a: _size(v) + _int(a.get("linecount")) * (2 + _size(a.get("fill_with"))),
    "slice": lambda v, a: _size(v) + _int(a.get("slices")) * (2 + _size(a.get("fill_with"))),
    # a link is wrapped in <a href="..." rel=... target=...>...</a>; each holds a "." or an "@"
    "urlize": lambda v, a: 2 * _size(v) + (_text(v).count(".") + _text(v).count("@") + 1)
    * (40 + _size(a.get("target")) + _size(a.get("rel"))),
    "string": lambda v, a: _size(v),
    "pprint": lambda v, a: _size(v),
}


def _bounded_filter(name: str, f):
    """Filter f, its arguments' iterators taken under the bound, its result's size bounded
    before it is built (FILTERS) and checked after."""
    # jinja2 passes most filters a context first (an environment, an evaluation context), also
    # an async variant whose sync function, the signature here, takes none
    signature = inspect.signature(f)
    takes_context = next(iter(signature.parameters), None) in CONTEXTS
    skip = int(hasattr(f, "jinja_pass_arg") and not takes_context)

    @functools.wraps(f)  # keeps jinja2's pass_context & co. marks
    def bounded(*args, **kwargs):
        args = [_taken(a) for a in args]
        kwargs = {k: _taken(v) for k, v in kwargs.items()}
        if name in FILTERS:
            try:
                named = signature.bind(*args[skip:], **kwargs).arguments
            except TypeError:  # arguments it does not take: the call says so
                named = None
            if named:
                arguments = list(named.items())[int(takes_context):]
                _check(FILTERS[name](arguments[0][1], dict(arguments[1:])), f"the filter {name}")
        return _bounded(f(*args, **kwargs), f"the filter {name}")
    return bounded


CONTEXTS = ("environment", "eval_ctx", "context")  # jinja2's names of what it passes first


def _bounded_lipsum(n=5, html=True, min=20, max=100):  # jinja2's global, its own argument names
    _check(_int(n) * (_int(max) + 10) * 15, "lipsum")
    return _lipsum(n, html, min, max)


def _checked_join(pieces) -> str:
    """A block's captured output ({% set x %}...{% endset %}, a macro, a call block) joined."""
    pieces = list(pieces)
    _check(sum(len(p) for p in pieces), "a block's output")
    return "".join(pieces)


class _BoundedCodeGenerator(CodeGenerator):
    """`a ~ b` compiles to a join in jinja2's runtime, out of the sandbox's reach: its pieces go
    through environment.checked_pieces first. (jinja2 3.x's visit_Concat, that call added.)"""

    @optimizeconst
    def visit_Concat(self, node, frame):
        if frame.eval_ctx.volatile:
            func_name = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            func_name = "markup_join"
        else:
            func_name = "str_join"
        self.write(f"{func_name}(environment.checked_pieces((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(")))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "%", "**"})  # checked before they allocate
    code_generator_class = _BoundedCodeGenerator
    concat = staticmethod(_checked_join)

    def call_binop(self, context, operator, left, right):
        numbers = isinstance(left, (int, float)) and isinstance(right, (int, float))
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                abs(left) > 1 and right > 0 and right * left.bit_length() > MAX_INT_BITS:
            raise _TemplateBound(f"builds an integer of more than {MAX_INT_BITS} bits "
                                 f"({left} ** {right})")
        if operator == "*" and not numbers:
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int):
                _check(_size(seq) * n, f"* {n}")
        elif operator == "+" and not numbers:
            _check(_size(left) + _size(right), "+")
        elif operator == "%" and isinstance(left, str):
            _check(_format_size(left, right), "%")
        return _bounded(super().call_binop(context, operator, left, right), operator)

    # jinja2's own names, which no keyword argument of a template's call can take
    def call(__self, __context, __obj, *args, **kwargs):
        args = [_taken(a) for a in args]
        kwargs = {k: _taken(v) for k, v in kwargs.items()}
        _check(_method_size(__obj, args, kwargs), f"{getattr(__obj, '__name__', 'a call')}()")
        result = super().call(__context, __obj, *args, **kwargs)
        return _bounded(result, f"{getattr(__obj, '__name__', 'a call')}()")

    def checked_pieces(self, pieces):
        _check(sum(_size(p) for p in pieces), "~")
        return pieces


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
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["lipsum"] = _bounded_lipsum
    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:
        # compiled on load, so a broken template stops the run before any training
        raise UserError(f"{where}: the chat template does not compile: {e.message} (line "
                        f"{e.lineno} of the template)") from None


_lipsum = ImmutableSandboxedEnvironment().globals["lipsum"]
