"""toy.py: the demo's tokenizer against transformers, the toy rows and the warm-up data the base
model learns from."""
import os

import pytest
import torch

import reward
import toy
from test_data import hf_ids
from toy import toy_rows, toy_warmup_pairs

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def toy_tok(tmp_path_factory):
    return toy.make_toy_tokenizer(str(tmp_path_factory.mktemp("toy")))


def test_toy_tokenizer_matches_transformers(toy_tok):
    ref = transformers.Qwen2Tokenizer.from_pretrained(toy_tok.name)
    for row in toy_rows(20, 0):
        assert toy_tok.apply_chat_template(row["prompt"]) == hf_ids(ref, row["prompt"])
    prompt = toy_rows(1, 0)[0]["prompt"]
    assert toy_tok.render_chat(prompt).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_toy_tokenizer_is_small_and_splits_every_digit(toy_tok):
    assert toy_tok.vocab_size < 300
    assert all(len(toy_tok.encode(str(n))) == len(str(n)) for n in range(100))
    assert len(toy_tok.encode("Answer")) == 1


def test_toy_tokenizer_decodes_text_exactly(toy_tok):
    for _, response in toy_warmup_pairs(200, 0):
        assert toy_tok.decode(toy_tok.encode(response)) == response
    odd = "  two  spaces\n\ttab, ünïcode 🙂 and 3+5=8"
    assert toy_tok.decode(toy_tok.encode(odd)) == odd


def test_toy_tokenizer_stops_at_im_end_and_endoftext(toy_tok):
    assert toy_tok.eos_token_ids == [toy_tok.token_to_id("<|im_end|>"),
                                     toy_tok.token_to_id("<|endoftext|>")]


def test_toy_rows_follow_the_dapo_schema():
    rows = toy_rows(50, seed=3)
    for row in rows:
        terms = [int(t) for t in row["prompt"][0]["content"].split("+")]
        assert row["data_source"] == "toy_sum" and row["prompt"][0]["role"] == "user"
        assert (toy.TOY_MIN_TERMS <= len(terms) <= toy.TOY_MAX_TERMS
                and all(0 <= t <= 9 for t in terms))
        assert row["reward_model"]["ground_truth"] == str(sum(terms))
    assert rows == toy_rows(50, seed=3) and rows != toy_rows(50, seed=4)


def test_toy_train_and_test_problems_are_disjoint():
    train = {r["prompt"][0]["content"] for r in toy_rows(5000, 0, "train")}
    test = {r["prompt"][0]["content"] for r in toy_rows(500, 0, "test")}
    warmup = {p[0]["content"] for p, _ in toy_warmup_pairs(5000, 0)}
    assert not train & test and not warmup & test
    assert len(test) >= 45  # and the held-out set is not a handful of problems (49 of the 252)


def test_every_step_of_a_held_out_problem_is_a_step_of_a_training_problem():
    train = {r["prompt"][0]["content"] for r in toy_rows(5000, 0, "train")}
    trained = {s for p in train for s in toy.toy_steps([int(t) for t in p.split("+")])}
    assert len(train) == 252 - len(toy.held_out_problems())  # every training problem drawn
    for problem in toy.held_out_problems():
        steps = toy.toy_steps([int(t) for t in problem.split("+")])
        assert steps and all(s in trained for s in steps), problem
    assert toy.toy_steps([4, 5, 4]) == [(4, 5), (9, 4)]
    # the rule held these out of the test split: 9+4 and 10+t are steps of no other problem
    assert {"4+5+4", "5+5+3"} <= train


def test_held_out_rows_weigh_every_problem_the_same():
    # the test split comes in passes over its problems: any 128 rows (the demo's eval) hold each
    # problem 2 or 3 times, so no few problems decide val/acc (drawn i.i.d. with a uniform
    # number of terms, the 7 two-term problems took about half the rows)
    problems = toy.held_out_problems()
    rows = [r["prompt"][0]["content"] for r in toy_rows(1000, 0, "test")]
    n = len(problems)
    for start in range(0, 1000 - n, n):
        assert sorted(rows[start:start + n]) == sorted(problems)
    counts = [rows[:128].count(p) for p in problems]
    assert min(counts) >= 2 and max(counts) <= 3
    assert rows != [r["prompt"][0]["content"] for r in toy_rows(1000, 1, "test")]
    two_terms = sum(p.count("+") == 1 for p in rows[:128])
    assert two_terms < 128 / 4


@pytest.mark.needs("extract_answer", "normalize")
def test_toy_warmup_is_right_only_some_of_the_time():
    pairs = toy_warmup_pairs(4000, 0)
    acc = [reward.verify_built_in("toy_sum", resp,
                                 str(sum(map(int, p[0]["content"].split("+")))))["acc"]
           for p, resp in pairs]
    # a base model that can, but half the time does not, get it right
    assert 0.35 <= sum(acc) / len(acc) <= 0.6
    assert all(resp.split("\n")[-1].startswith("Answer: ") for _, resp in pairs)


def test_toy_warmup_working_is_right_and_guesses_mostly_wrong():
    # RL can only sharpen what the base model already samples: worked answers must be right,
    # direct ones a guess
    worked, guessed = [], []
    for (messages,), resp in ((p, r) for p, r in toy_warmup_pairs(3000, 1)):
        right = resp.rsplit("Answer: ", 1)[1] == str(sum(map(int, messages["content"].split("+"))))
        (worked if "=" in resp else guessed).append(right)
    assert 0.4 < len(worked) / 3000 < 0.6  # the base model works it out half the time...
    assert sum(worked) / len(worked) > 0.85  # ...but when it does it is right...
    assert 0.03 < sum(guessed) / len(guessed) < 0.12  # ...and a guess is right about 1 time in 16


def test_toy_warmup_lengths_vary_past_the_demo_limit(toy_tok):
    # +1: the EOS
    lengths = [len(toy_tok.encode(resp)) + 1 for _, resp in toy_warmup_pairs(2000, 0)]
    over = sum(n > toy.TOY_MAX_RESPONSE_LEN for n in lengths) / len(lengths)
    buffer_start = toy.TOY_MAX_RESPONSE_LEN - toy.TOY_OVERLONG_BUFFER
    in_buffer = sum(buffer_start < n <= toy.TOY_MAX_RESPONSE_LEN for n in lengths) / len(lengths)
    assert min(lengths) < 16 and 0.03 < over < 0.25 and in_buffer > 0.03


@pytest.mark.needs("rope", "attention")  # the warm-up trains the model
def test_warmup_cache_is_kept_apart_per_kernel_set(toy_tok, tmp_path, monkeypatch):
    # a base model warmed up under one kernel set is not loaded under another: each gets the
    # model a fresh clone would warm up with its own rounding
    from toy import toy_warmup_pairs, warmed_up_model
    key = dict(steps=1, batch_size=2, lr=1e-3, preset="tiny", seed=0)
    dirs = []
    for capability in ("AVX2", "DEFAULT", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        warmed_up_model(toy_tok, key, lambda n: toy_warmup_pairs(n, seed=0),
                        cache_root=str(tmp_path), log_every=10**9)
        dirs.append(sorted(os.listdir(tmp_path)))
    assert len(dirs[0]) == 1 and dirs[0][0].endswith("kernelsAVX2"), dirs
    assert len(dirs[1]) == 2 and dirs[2] == dirs[1], dirs  # the AVX2 one reused, not re-made


@pytest.mark.needs("rope", "attention")  # the warm-up trains the model
def test_a_truncated_cached_base_model_says_to_delete_the_cache(toy_tok, tmp_path):
    # a cut copy of the cache (or a full disk when it was written) was called "an interrupted
    # download", and said nothing of the cache
    from toy import warmed_up_model
    key = dict(steps=1, batch_size=2, lr=1e-3, preset="tiny", seed=0)

    def warm_up():
        return warmed_up_model(toy_tok, key, lambda n: toy_warmup_pairs(n, seed=0),
                               cache_root=str(tmp_path), log_every=10**9)
    warm_up()
    cache = tmp_path / os.listdir(tmp_path)[0]
    weights = cache / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ValueError, match=rf"model\.safetensors: not a readable safetensors file.* "
                                         rf"This is the demo's cached base model, not a download: "
                                         rf"delete {cache} and the next run warms it up again"):
        warm_up()


@pytest.mark.needs("rope", "attention")  # the warm-up trains the model
def test_the_warmup_micro_batches_give_the_whole_batchs_gradient(toy_tok):
    """sft_backward cuts a batch into micro-batches of similar lengths (less padding): the
    gradient is the whole batch's mean loss's, equal in float64 up to summation order."""
    from model import Transformer, preset
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=toy_tok.vocab_size)).double()
    examples = [(toy_tok.apply_chat_template(messages), toy_tok.encode(response) + [1])
                for messages, response in toy_warmup_pairs(16, seed=0)]
    assert len({len(p) + len(r) for p, r in examples}) > 4  # lengths differ: padding to cut
    whole = toy.sft_loss(model, examples, toy_tok.pad_token_id, "cpu")
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss = toy.sft_backward(model, examples, toy_tok.pad_token_id, "cpu", micro_batches=4)
    assert loss == pytest.approx(whole.item(), rel=1e-12)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
