"""
Files that survive a crash: every write here is flushed to the disk, and replacing a file is
atomic, so a power cut or a kill at any moment leaves either the old content or the new one.

    need_file(dir, name)      the path of a file that must exist, or an error naming it
    writing(file)             a failed write (a full disk) becomes an error that names the file
    fsync(path)               a file's data or a directory's entries on the disk
    write_atomic(file, text)  replace a small file whole (metrics.jsonl, `latest`)
    write_json(file, obj)     write indented JSON and flush it (into a directory that is renamed
                              into place whole, as a checkpoint's)
"""
import contextlib
import errno
import json
import os

from safetensors import SafetensorError


def need_file(path: str, name: str) -> str:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: not found (is {path!r} a Hugging Face model directory?)")
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
        raise OSError(f"could not write {file}{why} ({type(e).__name__}: {e})") from e


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


def write_json(file: str, obj):
    with writing(file), open(file, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
