"""Models and datasets by their names on the Hugging Face Hub (infra/hub.py), offline: each test
builds a cache in huggingface_hub's own layout (ORG--NAME/snapshots/COMMIT/..., refs/main, blobs/)
with a tiny model and a tiny parquet, and huggingface_hub itself reads it; nothing reaches the
network (conftest.py sets HF_HUB_OFFLINE=1)."""
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp
from huggingface_hub import constants

import dapo
from config import Config
from infra import checkpoint, distributed, hub
from infra.errors import UserError
from model import Transformer
from rendezvous import file_init
from test_dapo import _cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
MODEL, DATA = "tiny-org/tiny-qwen2", "tiny-org/sums"


def cache_repo(cache, repo_type: str, repo_id: str, files: dict[str, bytes], commit: str):
    """A repository as a download leaves it in the cache: each file's bytes in blobs/ under their
    hash, linked from snapshots/COMMIT/PATH; refs/main names the commit. -> the snapshot."""
    root = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    for path, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return root / "snapshots" / commit


def parquet_bytes(rows: list[dict], tmp_path) -> bytes:
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    file = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), file)
    return file.read_bytes()


def sum_rows(n: int, offset: int = 0) -> list[dict]:
    """DAPO-Math-17k's row schema, scored by the built-in math_dapo verifier."""
    return [{"data_source": "math_dapo", "ability": "MATH",
             "prompt": [{"role": "user", "content": f"What is {i} + {offset}?"}],
             "reward_model": {"ground_truth": str(i + offset), "style": "rule"},
             "extra_info": {"index": i}} for i in range(n)]


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_model_dir):
    """An offline cache holding the tiny model and a dataset of one parquet file at COMMIT_A."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model_files = {name: open(os.path.join(tiny_model_dir, name), "rb").read()
                   for name in os.listdir(tiny_model_dir)}
    cache_repo(cache, "model", MODEL, model_files, COMMIT_A)
    cache_repo(cache, "dataset", DATA, {"data/sums.parquet": parquet_bytes(sum_rows(8), tmp_path),
                                        "README.md": b"# sums\n"}, COMMIT_A)
    return cache


@pytest.mark.needs("rope", "attention")  # the loaded model's forward
def test_a_model_name_is_its_snapshot_in_the_cache(cache, tiny_model_dir):
    path = hub.fetch(hub.parse(MODEL, "model"), "--model")
    assert path == str(cache / f"models--{MODEL.replace('/', '--')}" / "snapshots" / COMMIT_A)
    ours, reference = Transformer.from_pretrained(path), Transformer.from_pretrained(tiny_model_dir)
    ids = torch.arange(10)[None]
    assert torch.equal(ours(ids), reference(ids))


def test_a_dataset_name_is_its_one_data_file(cache):
    path = hub.fetch(hub.parse(DATA, "dataset"), "--train-data")
    assert path.endswith(f"snapshots/{COMMIT_A}/data/sums.parquet") and os.path.isfile(path)


@pytest.mark.parametrize("spec, chosen", [
    (f"{DATA}:train", "data/train-00000-of-00001.parquet"),
    (f"{DATA}:test", "test.jsonl"),
    (f"{DATA}/data/train-00000-of-00001.parquet", "data/train-00000-of-00001.parquet"),
    (f"{DATA}@{COMMIT_A}:test", "test.jsonl"),
])
def test_a_split_or_a_file_picks_one_of_several(cache, spec, chosen):
    cache_repo(cache, "dataset", DATA, {"data/train-00000-of-00001.parquet": b"PAR1",
                                        "test.jsonl": b"{}\n", "pretraining.jsonl": b"{}\n"},
               COMMIT_A)
    assert hub.fetch(hub.parse(spec, "dataset"), "--val-data").endswith(f"{COMMIT_A}/{chosen}")


def test_several_data_files_and_no_choice_is_one_line_listing_them(cache):
    cache_repo(cache, "dataset", DATA, {"test.jsonl": b"{}\n"}, COMMIT_A)
    with pytest.raises(UserError, match=rf"--val-data {DATA}: the dataset {DATA} at commit "
                                        rf"{COMMIT_A} holds 2 data files \(data/sums.parquet, "
                                        rf"test.jsonl\): name one, as {DATA}/FILE or "
                                        rf"{DATA}:SPLIT$"):
        hub.fetch(hub.parse(DATA, "dataset"), "--val-data")


@pytest.mark.parametrize("spec, repo_type, name", [
    ("Qwen/Qwen2.5-0.5B-Instruct", "model", ("model", "Qwen/Qwen2.5-0.5B-Instruct", None, None,
                                             None)),
    ("Qwen/Qwen2.5-0.5B@v1", "model", ("model", "Qwen/Qwen2.5-0.5B", "v1", None, None)),
    ("BytedTsinghua-SIA/AIME-2024:test", "dataset",
     ("dataset", "BytedTsinghua-SIA/AIME-2024", None, "test", None)),
    ("ORG/NAME@main/data/x.parquet", "dataset", ("dataset", "ORG/NAME", "main", None,
                                                 "data/x.parquet")),
    ("ORG/NAME:test", "model", None),  # a model has no split
    ("no/such.jsonl", "dataset", None),  # a data file one folder down: a path
    ("runs/x/y.jsonl", "dataset", None),  # below a directory that exists here
    ("/abs/ORG/NAME", "model", None),
    ("./ORG/NAME", "model", None),
    ("a--b/c", "model", None),  # no repository id
    ("", "model", None),
])
def test_parse_tells_a_hub_name_from_a_local_path(spec, repo_type, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    parsed = hub.parse(spec, repo_type)
    assert (parsed and (parsed.repo_type, parsed.repo_id, parsed.revision, parsed.split,
                        parsed.file)) == name
    assert parsed is None or str(parsed) == spec


def test_a_local_path_keeps_precedence_over_the_same_hub_name(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / MODEL).mkdir(parents=True)
    (tmp_path / MODEL / "config.json").write_text("{}")
    assert hub.parse(MODEL, "model") is None


@pytest.mark.parametrize("spec, repo_type, problem", [
    (MODEL, "model", f"it is not a model directory (no {MODEL}/config.json)"),
    (f"{DATA}:train", "dataset", "it is not a file"),
])
def test_a_local_path_that_hides_a_hub_name_says_so_when_it_is_not_usable(
        cache, tmp_path, monkeypatch, spec, repo_type, problem):
    # before: "ORG/NAME/config.json: not found", nothing of the Hub
    monkeypatch.chdir(tmp_path)
    (tmp_path / spec.split(":")[0]).mkdir(parents=True)
    repo, first = spec.split(":")[0], spec.split("/")[0]
    with pytest.raises(UserError) as e:
        hub.parse(spec, repo_type)
    assert str(e.value) == (f"{spec}: a local path ({first}/ exists here), which takes "
                            f"precedence over the Hub's {repo_type} {repo}, and {problem}: for "
                            f"the Hub's, run from a directory without {first}/")


@pytest.mark.parametrize("spec, repo_type", [("tiny-org/absent", "model"),
                                             ("tiny-org/absent:train", "dataset")])
def test_a_name_the_cache_lacks_offline_is_one_line_naming_it_and_what_to_do(cache, spec,
                                                                             repo_type):
    repo = spec.split(":")[0]
    download = f"hf download {repo}" + (" --repo-type dataset" if repo_type == "dataset" else "")
    with pytest.raises(UserError) as raised:
        hub.fetch(hub.parse(spec, repo_type), "--flag")
    message = str(raised.value)
    assert message.startswith(f"--flag {spec}: no such local path, and the {repo_type} {repo} is "
                              f"not (or not whole) in the Hugging Face cache {cache}, and "
                              "HF_HUB_OFFLINE=1 forbids downloading it")
    assert f"run `{download}` where there is a network" in message and "\n" not in message


def test_pinned_reads_the_commit_and_the_file_back_from_a_cache_path(cache):
    path = hub.fetch(hub.parse(DATA, "dataset"), "--train-data")
    assert hub.pinned(path) == hub.HubName("dataset", DATA, COMMIT_A, file="data/sums.parquet")
    assert hub.pinned(path.split("/data/")[0]).file is None
    assert hub.pinned("/data/snapshots/x.parquet") is None
    assert hub.pinned(f"/c/models--a--b/snapshots/{COMMIT_A}") == hub.HubName("model", "a/b",
                                                                               COMMIT_A)


@pytest.mark.parametrize("revision", ["..", ".", "v1.lock", "a b"])
def test_a_revision_git_refuses_is_one_line_naming_it(cache, revision):
    # before: `@..` made huggingface_hub open refs/.. and die in an IsADirectoryError
    with pytest.raises(UserError, match=rf"^{MODEL}@{revision}: '{revision}' is not a revision"):
        hub.parse(f"{MODEL}@{revision}", "model")


def test_an_oserror_reading_the_cache_is_one_line_naming_the_repository(cache):
    (cache / f"models--{MODEL.replace('/', '--')}" / "refs" / "v1").mkdir()  # a ref, not a file
    with pytest.raises(UserError, match=rf"^--model {MODEL}@v1: reading the model {MODEL} from "
                                        rf"the Hugging Face cache {cache} failed: "
                                        "IsADirectoryError"):
        hub.fetch(hub.parse(f"{MODEL}@v1", "model"), "--model")


def test_a_commit_the_cache_lacks_is_named_in_the_download_hint(cache):
    # without --revision, `hf download` fetches main, and the resume fails again
    with pytest.raises(UserError, match=rf"run `hf download {DATA} --repo-type dataset "
                                        rf"--revision {COMMIT_B}`"):
        hub.fetch(hub.parse(f"{DATA}@{COMMIT_B}", "dataset"), "--train-data")


def test_a_folder_named_snapshots_in_a_repository_is_not_the_caches(cache):
    cache_repo(cache, "dataset", DATA, {"snapshots/sums.jsonl": b"{}\n"}, COMMIT_B)
    # before: the last "snapshots" of the path was taken for the cache's, and fetch_once died
    # on None.revision
    paths = hub.fetch_once({"--train-data": hub.parse(f"{DATA}@{COMMIT_B}/snapshots/sums.jsonl",
                                                      "dataset")})
    assert hub.pinned(paths["--train-data"]) == hub.HubName("dataset", DATA, COMMIT_B,
                                                            file="snapshots/sums.jsonl")
    assert hub.pinned(f"/snapshots/{COMMIT_A}/datasets--a--b/snapshots/{COMMIT_A}/x.jsonl") == \
        hub.HubName("dataset", "a/b", COMMIT_A, file="x.jsonl")


def test_a_branch_on_resume_goes_on_at_the_checkpoints_commit(cache, tmp_path):
    saved = hub.fetch(hub.parse(DATA, "dataset"), "--train-data")  # the run started on commit A
    cache_repo(cache, "dataset", DATA, {"data/sums.parquet": parquet_bytes(sum_rows(8, 1),
                                                                           tmp_path)}, COMMIT_B)
    # the command the interrupt prints names the branch: before, refused as "not main"
    resumed = hub.at_commit_of(hub.parse(f"{DATA}@main", "dataset"), saved, "--train-data")
    assert resumed == hub.HubName("dataset", DATA, COMMIT_A)
    with pytest.raises(UserError, match=f"trained on commit {COMMIT_A} of {DATA}, not bbbbbbb"):
        hub.at_commit_of(hub.parse(f"{DATA}@bbbbbbb", "dataset"), saved, "--train-data")


def test_the_same_commit_from_another_cache_is_the_same_model_on_resume(cache, tmp_path):
    saved = {"model": f"/old/hub/models--{MODEL.replace('/', '--')}/snapshots/{COMMIT_A}"}
    moved = hub.fetch(hub.parse(MODEL, "model"), "--model")  # HF_HUB_CACHE moved since
    # before: compared as strings, refused as a --model that changes the algorithm
    checkpoint.check_resume_config(saved, {"model": moved})
    with pytest.raises(UserError, match="--model: "):
        checkpoint.check_resume_config({"model": saved["model"].replace(COMMIT_A, COMMIT_B)},
                                       {"model": moved})


# --- dapo.py with names on the Hub: trained, recorded in trainer.json, resumed at that commit -----

def hub_run(tmp_path, **kw) -> Config:
    return _cfg(MODEL, tmp_path / "run", **{"steps": 1, "eval_every": 0, "train_data": DATA,
                                            "val_data": f"{DATA}:sums", **kw})


@pytest.mark.needs("all")
def test_dapo_trains_on_hub_names_and_resumes_at_the_commit_it_started_with(cache, tmp_path):
    dapo.main(hub_run(tmp_path))
    saved = checkpoint.saved_config(checkpoint.latest(str(tmp_path / "run")))
    assert hub.pinned(saved["model"]) == hub.HubName("model", MODEL, COMMIT_A)
    assert hub.pinned(saved["train_data"]) == hub.HubName("dataset", DATA, COMMIT_A,
                                                          file="data/sums.parquet")
    # main moves on to other rows: the resumed run still reads commit A (else its rows' sha256
    # would refuse the resume)
    cache_repo(cache, "dataset", DATA, {"data/sums.parquet": parquet_bytes(sum_rows(8, 1),
                                                                           tmp_path)}, COMMIT_B)
    dapo.main(hub_run(tmp_path, steps=2, resume=True))
    saved = checkpoint.saved_config(checkpoint.latest(str(tmp_path / "run")))
    assert hub.pinned(saved["train_data"]).revision == COMMIT_A
    with pytest.raises(UserError, match=rf"--resume: --train-data {DATA}@{COMMIT_B}: the "
                                        rf"checkpoint was trained on commit {COMMIT_A} of {DATA}"):
        dapo.main(replace(hub_run(tmp_path, steps=3, resume=True), train_data=f"{DATA}@{COMMIT_B}"))


def test_plan_fetches_a_hub_models_config_json_alone_and_no_data(cache, monkeypatch, capsys):
    asked, snapshot_download = [], hub.snapshot_download
    monkeypatch.setattr(hub, "snapshot_download", lambda repo_id, **kw: asked.append(
        (repo_id, kw["allow_patterns"])) or snapshot_download(repo_id, **kw))
    dapo.main(Config(model=MODEL, train_data=DATA, val_data=DATA, plan=1))
    assert asked == [(MODEL, ["config.json"])]
    assert capsys.readouterr().out.startswith("memory plan per process (")


def test_the_command_line_says_a_missing_name_in_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    out = subprocess.run([sys.executable, "dapo.py", "--model", "tiny-org/absent", "--out-dir",
                          str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: --model tiny-org/absent: no such local path, and the "
                                 "model tiny-org/absent is not (or not whole) in the Hugging "
                                 "Face cache"), out.stderr
    assert out.stderr.count("\n") == 1


# --- under torchrun: one process fetches, the others wait and read its commit --------------------

def fetch_on_two_ranks(rank, tmp, cache, spec, fail_on_rank0):
    """Rank `rank` of 2 (LOCAL_RANK = rank: one node) runs hub.fetch_once, recording each fetch
    it makes: when, and whether it could download."""
    os.environ["LOCAL_RANK"] = str(rank)
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = cache, False
    torch.distributed.init_process_group("gloo", init_method=file_init(tmp), rank=rank,
                                         world_size=2)
    real_fetch, log = hub.fetch, []

    def fetch(name, flag, config_only=False, local_only=False):
        log.append((torch.distributed.get_rank(), str(name), local_only))
        if fail_on_rank0:
            raise UserError(f"{flag} {name}: not there")
        return real_fetch(name, flag, config_only, local_only=True)  # no network in a test

    hub.fetch = fetch
    try:
        paths = hub.fetch_once({"--train-data": hub.parse(spec, "dataset")})
        result = {"paths": paths, "log": log}
    except UserError as e:
        result = {"error": str(e), "log": log}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    distributed.shutdown()


@pytest.mark.parametrize("fail_on_rank0", [False, True], ids=["fetched", "rank-0-fails"])
def test_under_torchrun_rank_0_fetches_and_the_others_read_its_commit(cache, tmp_path,
                                                                      fail_on_rank0):
    ctx = mp.spawn(fetch_on_two_ranks, args=(str(tmp_path), str(cache), DATA, fail_on_rank0),
                   nprocs=2, join=False)
    deadline = time.monotonic() + 120  # a rank left waiting in a collective would hang the test
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            assert time.monotonic() < deadline, "a rank hung"
    finally:
        for p in ctx.processes:
            p.kill()
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    if fail_on_rank0:
        assert ranks[0]["error"] == f"--train-data {DATA}: not there"
        assert ranks[1]["error"] == f"another process: --train-data {DATA}: not there"
        assert ranks[1]["log"] == []  # it never fetched
        return
    assert ranks[0]["log"] == [[0, DATA, False]]  # rank 0 alone may download
    assert ranks[1]["log"] == [[1, f"{DATA}@{COMMIT_A}", True]]  # rank 0's commit, the cache
    assert ranks[0]["paths"] == ranks[1]["paths"]


def test_the_cache_helper_writes_huggingface_hubs_layout(cache):
    # scan_cache_dir is huggingface_hub's own reader of the cache: it sees both repositories
    from huggingface_hub import scan_cache_dir
    repos = {(r.repo_type, r.repo_id, tuple(sorted(x.commit_hash for x in r.revisions)),
              tuple(sorted(x.refs for x in r.revisions)))
             for r in scan_cache_dir(str(cache)).repos}
    assert repos == {("model", MODEL, (COMMIT_A,), (frozenset({"main"}),)),
                     ("dataset", DATA, (COMMIT_A,), (frozenset({"main"}),))}
