"""
Files that survive a crash: every write here is flushed to the disk, and replacing a file is
atomic, so a power cut or a kill at any moment leaves either the old content or the new one.

    need_file(dir, name)      the path of a file that must exist, or an error naming it
    writing(file)             a failed write (a full disk) becomes an error that names the file
    fsync(path)               a file's data or a directory's entries on the disk
    write_atomic(file, text)  replace a small file whole (metrics.jsonl trimmed, `latest`)
    append_line(file, line)   add a line at the end and flush it (metrics.jsonl's rows)
    read_jsonl(file)          the rows append_line wrote, a last line torn by a crash skipped
    write_json(file, obj)     write indented JSON and flush it (into a directory that is renamed
                              into place whole, as a checkpoint's)
    read_json(file)           JSON, or an error that names the file (a truncated copy)
    read_json_object(file)    read_json of a file whose top level must be an object ({...})
    own_dir(dir)              this process owns dir for its life (a lock a crash never leaves stuck)
    check_writable(dir, what) a directory a run will write: a probe file written and removed there
"""
import contextlib
import errno
import fcntl
import json
import os

from safetensors import SafetensorError

from infra.errors import UserError


def need_file(path: str, name: str) -> str:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise UserError(f"{file}: not found (is {path!r} a Hugging Face model directory?)")
    return file


@contextlib.contextmanager
def writing(file: str):
    """Turn a failed write into an error that names the file. torch.save on a full disk says only
    "[enforce fail at inline_container.cc:672] unexpected pos", safetensors "IoError(...)", neither
    the file."""
    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as e:
        full = getattr(e, "errno", None) == errno.ENOSPC or "unexpected pos" in str(e) or \
            "StorageFull" in str(e)
        why = ": the disk is full" if full else " (is the disk full?)"
        raise UserError(f"could not write {file}{why} ({type(e).__name__}: {e})") from e


def fsync(path: str):
    """Flush a file's data, or a directory's entries, to the disk: without it a power cut after a
    rename can leave the new name pointing at data that was never written."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # some filesystems cannot sync a directory
        if not (os.path.isdir(path) and e.errno == errno.EINVAL):
            raise
    finally:
        os.close(fd)


def write_atomic(file: str, text: str):
    """Write text to file.tmp, flush it to the disk and rename it over file: a reader sees the old
    file or the new one, never a part."""
    tmp = file + ".tmp"
    with writing(file):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
        fsync(os.path.dirname(os.path.abspath(file)))


def append_line(file: str, line: str):
    """Append line and a newline, flushed to the disk: a crash loses at most the line being
    written (a reader skips a torn last line), and a full disk is an error naming the file."""
    with writing(file), open(file, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(file: str) -> list:
    """The JSON rows of a file append_line wrote, one a line. Its last line, cut short by a crash,
    is skipped (the writer said it is lost, or writes it again); any other line that is not JSON
    is an error naming file:line."""
    with open(file, encoding="utf-8") as f:
        lines = f.read().splitlines()
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if lineno == len(lines):  # torn
                continue
            raise UserError(f"{file}:{lineno}: not a JSON row; fix or remove the line") from None
    return rows


def write_json(file: str, obj):
    with writing(file), open(file, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def read_json(file: str):
    with open(file, encoding="utf-8") as f:
        try:
            return json.load(f)
        # JSONDecodeError; UnicodeDecodeError (a byte that is not UTF-8); an integer of 4300+
        # digits; nesting past the recursion limit
        except (ValueError, RecursionError) as e:
            raise UserError(f"{file}: not valid JSON, truncated or corrupt (a partial copy?): "
                            f"{e}") from None


def read_json_object(file: str) -> dict:
    """A JSON file whose top level must be an object (a model's config.json,
    tokenizer_config.json, generation_config.json): anything else is named with the file."""
    value = read_json(file)
    if not isinstance(value, dict):
        raise UserError(f"{file}: the top level must be a JSON object ({{...}}), got "
                        f"{json_type(value)}")
    return value


def json_type(value) -> str:
    """The JSON name of a value's type, for the errors that name it."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "true or false",
             int: "a number", float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


_owned: dict[str, int] = {}  # realpath -> the open lock file's descriptor, held until exit


def own_dir(path: str, lock_name: str = "run.lock"):
    """Take path/lock_name with flock for the life of this process, with our pid in it: a second
    run on the same directory is refused naming the live one's pid. The kernel drops the lock when
    the process dies however it dies, so a crashed run never leaves it stuck."""
    os.makedirs(path, exist_ok=True)
    key = os.path.realpath(path)
    if key in _owned:
        return
    file = os.path.join(path, lock_name)
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"{path} is in use by a live run (pid {holder}, {file}): wait for it "
                        "or stop it, or choose another --out-dir") from None
    try:  # the first write of a run: a disk already full fails here (the lock took no space)
        with writing(file):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except UserError:
        os.close(fd)
        raise
    _owned[key] = fd


def check_writable(path: str, what: str):
    """Raise naming path unless this process can create files in directory `path` (or, where it
    does not exist yet, in the nearest directory above it, where it will be made): a file
    written and removed there, as only a write tells a read-only mount, a full quota's or
    another user's directory, or /proc from a writable one. A dangling link and a file in the
    way are named too."""
    if os.path.islink(path) and not os.path.exists(path):
        raise UserError(f"{what} {path} is a link to {os.readlink(path)}, which does not "
                        "exist")
    where = os.path.abspath(path)
    while not os.path.lexists(where):  # made by the run: its parents must be writable
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise UserError(f"{what} {path}: {where} is not a directory")
    probe = os.path.join(where, f".write-probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)
    except OSError as e:
        raise UserError(f"{what} {path}: cannot write in {where} ({e.strerror})") from None
