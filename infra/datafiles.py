"""
Reading a dataset file row by row, each error naming the file and the row or line, so that a bad
file stops a run before anything loads and says where to look. What a row must hold (verl's RL
data format) is data.py's business; this is the bytes.

    need_reader(path)   a .jsonl, or a .parquet with pyarrow installed, or an error saying which
    read_rows(path)     (where, row) pairs in file order: "file:line" for JSONL, "file: row i"
                        for parquet
"""
import json

from infra.errors import UserError

# Nesting a row may have (verl's rows have 3: prompt, message, content): json reads ~990 levels,
# but a row that deep fails later, in a deeper stack (the rows' sha256 at the first checkpoint)
MAX_DEPTH = 100


def _import_pyarrow(path: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow, an optional extra: pip install -r "
                        "requirements-extra.txt (or convert the file to JSONL with the same "
                        "columns)") from None
    return pa, pq


def need_reader(path: str):
    if path.endswith(".parquet"):
        _import_pyarrow(path)
    elif not path.endswith(".jsonl"):
        raise UserError(f"{path}: unknown data format (expected .parquet or .jsonl)")


def read_rows(path: str):
    need_reader(path)
    return _parquet_rows(path) if path.endswith(".parquet") else _jsonl_rows(path)


def _parquet_rows(path: str):
    pa, pq = _import_pyarrow(path)
    index = 0
    try:
        # Python objects for one batch at a time
        for batch in pq.ParquetFile(path).iter_batches(batch_size=65536):
            for row in batch.to_pylist():
                yield f"{path}: row {index}", row
                index += 1
    except pa.ArrowException as e:
        # ArrowInvalid, ArrowIOError...: the file, not one row, is broken
        raise UserError(f"{path}: not a readable parquet file after {index} rows; truncated (an "
                        f"interrupted download?) or corrupt: {e}") from None


def _jsonl_rows(path: str):
    # bytes, decoded line by line: a bad byte is then reported with its line
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                # -sig: a BOM some editors write
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{path}:{lineno}: the file is not UTF-8 text (byte "
                                f"0x{raw[e.start]:02x} at byte {e.start + 1} of the line); JSONL "
                                "must be UTF-8: re-encode it, e.g. with iconv") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: malformed JSON ({e.msg} at column "
                                f"{e.colno})") from None
            except (ValueError, RecursionError) as e:  # an integer of 4300+ digits; deep nesting
                raise UserError(f"{path}:{lineno}: JSON that Python cannot read: {e}") from None
            # a line of fewer brackets cannot nest deeper: the walk only for the few that might
            if line.count("[") + line.count("{") > MAX_DEPTH and _deeper_than(row, MAX_DEPTH):
                raise UserError(f"{path}:{lineno}: JSON nested more than {MAX_DEPTH} levels deep")
            yield f"{path}:{lineno}", row


def _deeper_than(value, limit: int) -> bool:
    """Whether lists and objects nest more than limit levels in value (walked without recursion)."""
    level = [value]
    for _ in range(limit + 1):
        level = [x for v in level if isinstance(v, (list, dict))
                 for x in (v.values() if isinstance(v, dict) else v)]
        if not level:
            return False
    return True
