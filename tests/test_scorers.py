"""verl's other data_sources, scored as verl scores them (infra/scorers.py): GSM8K's "#### N"
and MATH's last \\boxed{} with Hendrycks' normalisation, on a corpus of tricky responses whose
scores verl's own functions gave; and the rows verl's quickstart writes for GSM8K, loaded and
trained on unchanged."""
import json

import pytest

import dapo
from data import load_rows
from reward import found_answer, verify_built_in
from infra.scorers import VERL_SCORERS
from test_dapo import _cfg

# (data_source, response, ground truth, verl's score). The scores were computed once, outside this
# repository, with verl's own functions: verl 0.8.0.dev, commit b178a3cd56f5 (2026-01-29),
# verl/utils/reward_score/gsm8k.py compute_score, math_reward.py compute_score and math_dapo.py
# compute_score, dispatched as its default_compute_score dispatches these data_sources (its
# "score" for a dict). Nothing of verl is in this repository; the scores are data.
VERL_SCORES = [
    ("openai/gsm8k", "Let's think step by step. 6 * 12 = 72\n#### 72", "72", 1.0),
    ("openai/gsm8k", "#### 72.0", "72", 0.0),
    ("openai/gsm8k", "#### 72.", "72", 0.0),
    ("openai/gsm8k", "The total is 1,000 dollars.\n#### 1,000", "1000", 1.0),
    ("openai/gsm8k", "#### $1,000", "1000", 0.0),
    ("openai/gsm8k", "####72", "72", 0.0),
    ("openai/gsm8k", "####  72", "72", 0.0),
    ("openai/gsm8k", "##### 72", "72", 1.0),
    ("openai/gsm8k", "He is 3 years younger.\n#### -3", "-3", 1.0),
    ("openai/gsm8k", "#### - 3", "-3", 0.0),
    ("openai/gsm8k", "The answer is 72.", "72", 0.0),
    ("openai/gsm8k", "#### 70\nWait, I made an error.\n#### 72", "72", 1.0),
    ("openai/gsm8k", "#### 72\nNo: #### 70", "72", 0.0),
    ("openai/gsm8k", "#### 72" + " and then some more words" * 20, "72", 0.0),  # > 300 chars
    ("openai/gsm8k", "#### 7,2", "72", 1.0),
    ("openai/gsm8k", "#### 1,000.50", "1000.50", 1.0),
    ("openai/gsm8k", "#### ,,,", "72", 0.0),
    ("openai/gsm8k", "#### 72 apples", "72", 1.0),
    ("openai/gsm8k", "#### \uff17\uff12", "72", 0.0),  # fullwidth digits
    ("openai/gsm8k", "\\boxed{72}", "72", 0.0),
    ("openai/gsm8k", "", "72", 0.0),
    ("openai/gsm8k", "#### 0.5", ".5", 0.0),
    ("lighteval/MATH", "So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "$\\boxed{\\dfrac12}$", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "$\\boxed{\\tfrac{1}{2}}$", "\\frac12", 1.0),
    ("lighteval/MATH", "$\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "$\\boxed{.5}$", "\\frac12", 1.0),
    ("lighteval/MATH", "$\\boxed{1/2}$", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "$\\boxed{2/4}$", "\\frac{1}{2}", 0.0),
    ("lighteval/MATH", "$\\boxed{-1/2}$", "\\frac{-1}{2}", 1.0),
    ("lighteval/MATH", "$\\boxed{01/2}$", "\\frac{1}{2}", 0.0),
    ("lighteval/MATH", "$\\boxed{\\left( 1, 2 \\right)}$", "(1,2)", 1.0),
    ("lighteval/MATH", "$\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("lighteval/MATH", "$\\boxed{\\frac{\\sqrt3}2}$", "\\frac{\\sqrt{3}}{2}", 0.0),
    ("lighteval/MATH", "$\\boxed{\\frac1{72}}$", "\\frac{1}{72}", 1.0),
    ("lighteval/MATH", "$\\boxed{\\frac{72}1}$", "72", 0.0),
    ("lighteval/MATH", "$\\boxed{\\frac1}$", "\\frac1", 1.0),
    ("lighteval/MATH", "$\\boxed{\\frac1}$", "\\frac{1}", 0.0),
    ("lighteval/MATH", "$\\boxed{\\frac}$", "\\frac", 1.0),
    ("lighteval/MATH", "$\\boxed{\\sqrt}$", "\\sqrt", 1.0),
    ("lighteval/MATH", "$\\boxed{\\sqrt\\sqrt2}$", "\\sqrt{\\sqrt{2}}", 0.0),
    ("lighteval/MATH", "$\\boxed{10\\%}$", "10", 1.0),
    ("lighteval/MATH", "$\\boxed{10\\\\%}$", "10\\%", 1.0),
    ("lighteval/MATH", "$\\boxed{5 \\text{ cm}}$", "5", 1.0),
    ("lighteval/MATH", "$\\boxed{5\\text{ cm}\\text{ long}}$", "5", 0.0),
    ("lighteval/MATH", "$\\boxed{5\\text{cm}}$", "5", 0.0),
    ("lighteval/MATH", "$\\boxed{90^\\circ}$", "90", 1.0),
    ("lighteval/MATH", "$\\boxed{90^{\\circ}}$", "90^\\circ", 1.0),
    ("lighteval/MATH", "$\\boxed{x = 3}$", "3", 1.0),
    ("lighteval/MATH", "$\\boxed{x_1 = 3}$", "3", 0.0),
    ("lighteval/MATH", "$\\boxed{y=x+1}$", "x+1", 1.0),
    ("lighteval/MATH", "$\\boxed{\\$18.90}$", "18.90", 1.0),
    ("lighteval/MATH", "The answer is $\\boxed 5$.", "5", 1.0),
    ("lighteval/MATH", "\\boxed 5 and then \\boxed{6}", "6", 0.0),
    ("lighteval/MATH", "First $\\boxed{3}$, then $\\boxed{4}$.", "4", 1.0),
    ("lighteval/MATH", "First $\\boxed{3}$, then $\\boxed{4}$.", "3", 0.0),
    ("lighteval/MATH", "$\\boxed{\\boxed{3}}$", "3", 1.0),
    ("lighteval/MATH", "$\\boxed{a}\\boxed{b$", "a", 0.0),
    ("lighteval/MATH", "$\\fbox{4}$", "4", 0.0),
    ("lighteval/MATH", "The answer is 4.", "4", 0.0),
    ("lighteval/MATH", "$\\boxed{4$", "4", 0.0),
    ("lighteval/MATH", "$\\boxed{}$", "0", 0.0),
    ("lighteval/MATH", "$\\boxed{\\text{(B)}}$", "\\text{(B)}", 1.0),
    ("lighteval/MATH", "$\\boxed{B}$", "\\text{(B)}", 0.0),
    ("lighteval/MATH", "$\\boxed{-3}$", "-3", 1.0),
    ("lighteval/MATH", "$\\boxed{1,000}$", "1000", 0.0),
    ("lighteval/MATH", "$\\boxed{ 3}$", "3", 1.0),
    ("lighteval/MATH", "$\\boxed{3\n}$", "3", 1.0),
    ("lighteval/MATH", "$\\boxed{x^2+1}$", "x^{2}+1", 0.0),
    ("lighteval/MATH", "$\\boxed{\\dfrac{3}{4}}$", "0.75", 0.0),
    ("lighteval/MATH", "$\\boxed{7}$" + " and a long tail" * 100, "7", 1.0),  # no window
    ("lighteval/MATH", "$\\boxed{\\!1}$", "1", 1.0),
    ("lighteval/MATH", "$\\boxed{\\pi\\sqrt 2}$", "\\pi\\sqrt{2}", 0.0),
    ("lighteval/MATH", "\\boxed{k=\\frac{1}{2}}", "\\frac12", 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "$\\boxed{\\dfrac{\\pi}{2}}$", "\\frac{\\pi}{2}", 1.0),
    ("HuggingFaceH4/MATH-500",
     "$\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}$",
     "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1.0),
    ("HuggingFaceH4/MATH-500", "$\\boxed{(-\\infty, 3]}$", "(-\\infty,3]", 1.0),
    ("lighteval/MATH", "$\\boxed{5\\text{\\% cm}}$", "5", 0.0),  # the unit goes before the %
    ("lighteval/MATH", "$\\boxed{\\frac{.5}{1}}$", "\\frac{0.5}{1}", 1.0),
    ("lighteval/MATH", "$\\boxed{x + .5}$", "x+0.5", 1.0),
    ("lighteval/MATH", "$\\boxed{k  = 3}$", "3", 0.0),  # the left side before spaces go
    ("lighteval/MATH", "$\\boxed{1 / 2}$", "\\frac{1}{2}", 1.0),
    ("math", "Answer: 34", "34", 1.0),
    ("math", "\\boxed{34}", "34", -1.0),
    ("math_dapo_reasoning", "Answer: $\\frac12$", "\\frac{1}{2}", 1.0),
]


@pytest.mark.needs("normalize", "extract_answer")  # the math rows go to math_dapo
@pytest.mark.parametrize("data_source, response, ground_truth, verl", VERL_SCORES,
                         ids=lambda x: repr(x)[:40] if isinstance(x, str) else str(x))
def test_each_response_scores_as_verls_own_function_scored_it(data_source, response,
                                                              ground_truth, verl):
    assert verify_built_in(data_source, response, ground_truth)["score"] == verl


def test_the_corpus_scores_every_data_source_verl_maps_here():
    assert set(VERL_SCORERS) | {"math", "math_dapo_reasoning"} == \
        {source for source, *_ in VERL_SCORES}
    # right and wrong answers of each verifier
    for source in VERL_SCORERS:
        assert {verl for s, _, _, verl in VERL_SCORES if s == source} <= {0.0, 1.0}
    assert {verl for s, *_, verl in VERL_SCORES if s in ("openai/gsm8k", "lighteval/MATH")} == \
        {0.0, 1.0}


@pytest.mark.parametrize("data_source, response, answered", [
    ("openai/gsm8k", "#### 71", True),  # wrong, but in the format: verl's format_score
    ("openai/gsm8k", "The answer is 72.", False),
    ("lighteval/MATH", "$\\boxed{71}$", True),
    ("lighteval/MATH", "The answer is 72.", False),
    ("lighteval/MATH", "$\\fbox{72}$", False),  # verl finds it, then refuses it
    ("lighteval/MATH", "$\\boxed{72$", False),  # never closed
])
def test_a_response_without_an_answer_counts_as_no_answer(data_source, response, answered):
    result = verify_built_in(data_source, response, "72")
    assert found_answer(result) is answered and result["acc"] is False


# --- the parquet verl's quickstart writes for GSM8K (examples/data_preprocess/gsm8k.py) ---------

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def quickstart_rows(n: int) -> list[dict]:
    """Rows as verl's GSM8K preprocessing writes them: the question and its instruction, the number
    after "####" as the ground truth, the whole solution in extra_info."""
    rows = []
    for i in range(n):
        question = f"Tom has {i} apples and buys 3 more. How many apples does he have?"
        answer = f"{i} + 3 = <<{i}+3={i + 3}>>{i + 3}\n#### {i + 3}"
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(i + 3)},
                     "extra_info": {"split": "train", "index": i, "answer": answer,
                                    "question": question}})
    return rows


@pytest.fixture
def gsm8k_parquet(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(quickstart_rows(8)), path)
    return str(path)


def test_verls_gsm8k_parquet_loads_unchanged(gsm8k_parquet, tiny_model_dir):
    from data import load_tokenizer
    rows = load_rows(gsm8k_parquet, load_tokenizer(tiny_model_dir))
    assert rows == quickstart_rows(8)
    row = rows[5]
    assert verify_built_in(row["data_source"], "5 + 3 = 8\n#### 8",
                          row["reward_model"]["ground_truth"]) == \
        {"score": 1.0, "acc": True, "pred": "8"}


@pytest.mark.needs("all")
def test_dapo_trains_on_verls_gsm8k_parquet_with_verls_scores(gsm8k_parquet, tiny_model_dir,
                                                              tmp_path):
    # the random model writes no "#### N": verl's gsm8k score is 0.0 (math_dapo's would be -1),
    # and with the overlong penalty off that is the reward the step trains on
    dapo.main(_cfg(tiny_model_dir, tmp_path / "run", steps=1, eval_every=1,
                   train_data=gsm8k_parquet, val_data=gsm8k_parquet, overlong_shaping=False))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    step = next(r for r in rows if "rollout/acc" in r)
    assert step["critic/score/mean"] == 0.0 and step["rollout/no_answer"] == 1.0
    assert [r["step"] for r in rows if "val/acc" in r] == [0, 1]
