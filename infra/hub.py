"""
Models and datasets by their names on the Hugging Face Hub, as verl, TRL and OpenRLHF take them,
turned into local paths in huggingface_hub's own cache: downloaded when online, read from the
cache offline (HF_HUB_OFFLINE=1 is honoured), and when neither works, one line naming the
repository and what to do. The rest of a run then reads files, as it does for a local path.

    --model Qwen/Qwen2.5-0.5B-Instruct            the weights, config.json and tokenizer files
    --train-data BytedTsinghua-SIA/DAPO-Math-17k  the repository's one data file (.parquet/.jsonl)
    --val-data ORG/NAME:test                      the data file of split "test"
    --val-data ORG/NAME/data/aime-2024.parquet    a file inside the repository
    ORG/NAME@REV...                               at a branch, tag or commit (default: main)

A local path keeps precedence: a spec is a path when it starts like one (/ . ~), when its first
folder exists here (ORG/NAME itself, runs/...), or when it is a data file one folder down
(no/such.jsonl: no repository is called NAME.jsonl). Such a path that is not a model directory
(or, for ORG/NAME[:SPLIT], no data file) is refused saying that it took the Hub name's place.

The cache (HF_HUB_CACHE, by default ~/.cache/huggingface/hub) keeps each repository as
    models--ORG--NAME/refs/main           the commit `main` named when it was last fetched
    models--ORG--NAME/snapshots/COMMIT/   the files of that commit (links into blobs/)
so the path a name resolves to names its commit: a checkpoint's trainer.json, which holds the
run's flags, keeps it, and pinned() reads it back for --resume.

    parse(spec, repo_type)     a HubName, or None for a local path
    fetch(name, flag)          the local path of a name: a model's snapshot, a dataset's file
    pinned(path)               the HubName (at its commit) of a path in the cache, or None
    at_commit_of(name, path)   --resume: name at the commit of the checkpoint's path of it
    same_files(path, path)     the same path, or the same repository, commit and file
    fetch_once(names)          fetch() under torchrun: one process downloads, the others wait
"""
import os
import re
from dataclasses import dataclass, replace

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError,
                                    LocalEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)
from huggingface_hub.utils import validate_repo_id

from infra import distributed
from infra.errors import UserError
from infra.hf_io import TOKENIZER_FILES

# What a run reads of a model repository: never the other formats many also hold (.bin, .gguf,
# onnx/, original/), which would multiply the download
MODEL_FILES = ("config.json", "model.safetensors", "model-*-of-*.safetensors",
               "model.safetensors.index.json", *TOKENIZER_FILES)
DATA_SUFFIXES = (".parquet", ".jsonl")  # what data.load_rows reads
# ORG/NAME, then @REV, then :SPLIT or /FILE (a dataset's)
HUB_NAME = re.compile(r"(?P<repo>[^/@:]+/[^/@:]+)(?:@(?P<revision>[^/:@]+))?"
                  r"(?::(?P<split>[^/:@]+)|/(?P<file>.+))?")
COMMIT = re.compile(r"[0-9a-f]{40}")
# A revision git refuses as a ref name (git check-ref-format): a leading ".", "..", a trailing "."
# or ".lock", control characters, space and ~^:?*[\ (HUB_NAME takes no @, : or /). `@..` made
# huggingface_hub open refs/.. (a directory) and die in an IsADirectoryError.
BAD_REVISION = re.compile(r"^\.|\.\.|\.$|\.lock$|[\x00-\x20\x7f~^:?*\[\\]")
# A commit hash, whole or its first 7+ digits (a branch or a tag is any other name)
HASH = re.compile(r"[0-9a-f]{7,40}")


@dataclass(frozen=True)
class HubName:
    """A repository on the Hub, at a revision, and (a dataset's) a split or a file in it."""
    repo_type: str  # "model" or "dataset"
    repo_id: str  # "ORG/NAME"
    revision: str | None = None  # a branch, tag or commit; None: main
    split: str | None = None  # the data file whose path names this split
    file: str | None = None  # a file's path inside the repository

    def __str__(self):
        at = f"@{self.revision}" if self.revision else ""
        inside = f":{self.split}" if self.split else f"/{self.file}" if self.file else ""
        return f"{self.repo_id}{at}{inside}"


def is_local(spec: str) -> bool:
    """Whether spec is a local path rather than a Hub name (see the module docstring)."""
    return (spec.startswith(("/", ".", "~")) or os.path.isdir(spec.split("/", 1)[0])
            or (spec.count("/") == 1 and spec.endswith(DATA_SUFFIXES)))


def parse(spec: str, repo_type: str) -> HubName | None:
    """The Hub name a flag's value spells (a model's: ORG/NAME[@REV]), or None: a local path. A
    local path that spells a Hub name (its first folder exists here) and holds no model (no
    config.json) or no data (a dataset's ORG/NAME[:SPLIT]) is refused, saying that it took the
    Hub name's place."""
    match = HUB_NAME.fullmatch(spec) if spec else None
    if not match or (repo_type == "model" and (match["split"] or match["file"])):
        return None
    try:
        validate_repo_id(match["repo"])
    except HFValidationError:
        return None
    if is_local(spec):
        _check_local(spec, repo_type, match["repo"])
        return None
    if match["revision"] and BAD_REVISION.search(match["revision"]):
        raise UserError(f"{spec}: {match['revision']!r} is not a revision (a branch, tag or "
                        "commit: git's names never start or end with '.', never end with "
                        "'.lock', never hold '..', spaces or any of ~^:?*[\\)")
    return HubName(repo_type, match["repo"], match["revision"], match["split"], match["file"])


def _check_local(spec: str, repo_type: str, repo: str):
    """A local path that took a Hub name's place because its first folder exists here: the
    error that it is not a model (or a data file) says so, else it read as a typo."""
    first = spec.split("/", 1)[0]
    # a data file's name (runs/x/rows.jsonl) is a local path meant: its error is "no such file"
    if spec.startswith(("/", ".", "~")) or not os.path.isdir(first) or \
            spec.endswith(DATA_SUFFIXES):
        return
    if repo_type == "model" and not os.path.isfile(os.path.join(spec, "config.json")):
        problem = f"it is not a model directory (no {os.path.join(spec, 'config.json')})"
    elif repo_type == "dataset" and not os.path.isfile(spec):
        problem = "it is not a file"
    else:
        return
    raise UserError(f"{spec}: a local path ({first}/ exists here), which takes precedence over "
                    f"the Hub's {repo_type} {repo}, and {problem}: for the Hub's, run from a "
                    f"directory without {first}/")


def fetch(name: HubName, flag: str, config_only: bool = False, local_only: bool = False) -> str:
    """The local path of name: a model's snapshot directory (config.json alone with config_only),
    a dataset's data file. Downloads what the cache lacks unless offline (HF_HUB_OFFLINE=1) or
    local_only; raises a UserError naming flag and the repository when it can do neither."""
    if name.repo_type == "model":
        patterns = ["config.json"] if config_only else list(MODEL_FILES)
    elif name.file:
        patterns = [name.file]
    else:  # a superset of the files of the split, narrowed by data_file()
        patterns = [f"*{name.split or ''}*{suffix}" for suffix in DATA_SUFFIXES]
    try:
        snapshot = snapshot_download(name.repo_id, repo_type=name.repo_type,
                                     revision=name.revision, allow_patterns=patterns,
                                     local_files_only=local_only or constants.HF_HUB_OFFLINE)
    except (LocalEntryNotFoundError, HfHubHTTPError) as e:
        raise UserError(f"{flag} {name}: {why_not(name, e)}") from None
    except OSError as e:  # the cache itself: unreadable, a ref that is a directory...
        raise UserError(f"{flag} {name}: reading the {name.repo_type} {name.repo_id} from the "
                        f"Hugging Face cache {constants.HF_HUB_CACHE} failed: "
                        f"{type(e).__name__}: {e}") from None
    return snapshot if name.repo_type == "model" else data_file(snapshot, name, flag)


def why_not(name: HubName, e: Exception) -> str:
    """What went wrong fetching name, and what to do, in a few words."""
    kind, repo = name.repo_type, name.repo_id
    if isinstance(e, RevisionNotFoundError):
        return f"the {kind} {repo} has no revision {name.revision!r} on the Hub"
    if isinstance(e, GatedRepoError):
        return (f"the {kind} {repo} is gated: accept its terms on its page at huggingface.co, "
                "then log in (hf auth login)")
    if isinstance(e, RepositoryNotFoundError):
        return (f"no such local path, and no {kind} {repo} on the Hub (a private one needs "
                "hf auth login)")
    if isinstance(e, LocalEntryNotFoundError):
        offline = ("HF_HUB_OFFLINE=1 forbids downloading it" if constants.HF_HUB_OFFLINE
                   else "the Hub could not be reached to download it")
        # the revision: without it, hf download fetches main, and the same name fails again
        download = f"hf download {repo}" + (" --repo-type dataset" if kind == "dataset" else "") \
            + (f" --revision {name.revision}" if name.revision else "")
        return (f"no such local path, and the {kind} {repo} is not (or not whole) in the Hugging "
                f"Face cache {constants.HF_HUB_CACHE}, and {offline}: run `{download}` where "
                "there is a network, into this cache (HF_HUB_CACHE), or pass a local path")
    return f"the Hub refused it: {type(e).__name__}: {e}"


def data_file(snapshot: str, name: HubName, flag: str) -> str:
    """The one data file of name in its snapshot directory: the file named, or the one whose path
    names the split (train in data/train-00000-of-00001.parquet, test in test.jsonl), or the
    repository's only one."""
    files = sorted(os.path.relpath(os.path.join(d, f), snapshot)
                   for d, _, names in os.walk(snapshot) for f in names
                   if f.endswith(DATA_SUFFIXES))
    if name.file:
        chosen = [f for f in files if f == name.file]
    elif name.split:
        word = re.compile(rf"(^|[/._-]){re.escape(name.split)}([/._-]|$)")
        chosen = [f for f in files if word.search(f)]
    else:
        chosen = files
    if len(chosen) == 1:
        return os.path.join(snapshot, chosen[0])
    held = ", ".join(files[:8]) + (f" and {len(files) - 8} more" if len(files) > 8 else "")
    where = f"the dataset {name.repo_id} at commit {os.path.basename(snapshot)}"
    if not chosen:
        raise UserError(f"{flag} {name}: {where} holds no such data file (.parquet or .jsonl); "
                        f"it holds {held or 'none'}")
    raise UserError(f"{flag} {name}: {where} holds {len(chosen)} data files ({held}): name one, "
                    f"as {name.repo_id}/FILE or {name.repo_id}:SPLIT")


def pinned(path: str) -> HubName | None:
    """The Hub name, at its commit and with its file, that a path in the cache holds
    (CACHE/datasets--ORG--NAME/snapshots/COMMIT/FILE), or None for any other path. Found by its
    repository's folder, the first one followed by snapshots/COMMIT: a folder named snapshots
    in the repository (or above the cache) is not the cache's."""
    parts = os.path.normpath(path).split(os.sep)
    for at, part in enumerate(parts[:-2]):
        kind, sep, repo = part.partition("s--")  # models--ORG--NAME
        if sep and kind in ("model", "dataset") and repo.count("--") == 1 and \
                parts[at + 1] == "snapshots" and COMMIT.fullmatch(parts[at + 2]):
            return HubName(kind, repo.replace("--", "/"), parts[at + 2],
                           file="/".join(parts[at + 3:]) or None)
    return None


def at_commit_of(name: HubName, saved_path: str | None, flag: str) -> HubName:
    """--resume: name at the commit of saved_path, the checkpoint's path of the same flag, so that
    the run goes on with the files it started with, whatever `main` (or any branch or tag given,
    @REV: the command the interrupt prints) names now. A commit given (@HASH, 7 to 40 hex digits)
    that is not that commit is refused. Another source (a local path, another repository) is
    left to the checks of a changed flag or dataset."""
    saved = pinned(saved_path) if saved_path else None
    if saved is None or (saved.repo_type, saved.repo_id) != (name.repo_type, name.repo_id):
        return name
    if name.revision and HASH.fullmatch(name.revision) and \
            not saved.revision.startswith(name.revision):
        raise UserError(f"--resume: {flag} {name}: the checkpoint was trained on commit "
                        f"{saved.revision} of {name.repo_id}, not {name.revision}: resume with "
                        f"{flag} {name.repo_id} (the checkpoint's commit is kept), or start a new "
                        "run")
    return replace(name, revision=saved.revision)


def same_files(saved_path, path) -> bool:
    """Whether two values of a flag are the same: equal, or paths of the same repository, commit
    and file in two caches (HF_HUB_CACHE moved, another node's)."""
    if saved_path == path:
        return True
    if not (isinstance(saved_path, str) and isinstance(path, str)):
        return False
    return pinned(saved_path) is not None and pinned(saved_path) == pinned(path)


def fetch_once(names: dict[str, HubName], config_only: bool = False) -> dict[str, str]:
    """{flag: fetch()'s path} of each {flag: name}. Under torchrun, in three turns: rank 0 fetches
    (downloading what is missing) while the others wait, which pins every name to a commit; the
    first process of each other node fetches those commits (nothing to do on a cache the nodes
    share); the rest read their node's cache. An error of any turn stops every rank with it."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    turns = [distributed.rank() == 0, distributed.rank() > 0 and local_rank == 0, local_rank > 0]
    paths = {}
    for turn, mine in enumerate(turns):
        result = None
        if mine:
            try:
                paths = {flag: fetch(name, flag, config_only, local_only=turn == 2)
                         for flag, name in names.items()}
                result = paths
            except UserError as e:
                result = str(e)
        results = distributed.all_gather_object(result, name="the Hub's files")
        errors = [r for r in results if isinstance(r, str)]
        if errors:  # this process's own, or the first other's
            raise UserError(result if isinstance(result, str) else f"another process: {errors[0]}")
        if turn == 0:  # rank 0's commits, for everyone
            names = {flag: replace(name, revision=pinned(results[0][flag]).revision)
                     for flag, name in names.items()}
    return paths
