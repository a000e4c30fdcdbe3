"""
Course assignments from this repository: a student handout generated from the code, and a grader.

An exercise is a function body (or a few lines of one) between a comment pair at the body's
indentation, in the reference code itself, so the handout never drifts from it:

    # exercise: group_advantages
    ...  (the reference's lines: the handout has a raise here)
    # end exercise

    python -m course.assign list          # the exercises: id, file, points, difficulty
    python -m course.assign handout OUT   # the student copy, with EXERCISES.md
    python -m course.assign check [ID]    # exercises' tests, pytest's output (make check EX=ID)
    python -m course.assign todo          # one line naming the exercises that still raise
    python -m course.assign grade         # run each exercise's tests, then a short demo run
    python -m course.assign grade --extra-tests DIR --json FILE   # private tests, an autograder

The handout is every file git tracks but the instructor's (INSTRUCTOR_ONLY, and any test file
that marks a test @pytest.mark.grades: a private test), each marked body replaced by a `raise`
that names its exercise (signatures, docstrings and the markers stay), the notebooks without
their outputs (the students run them; the outputs answer the written part). Tests that run a
student's code but grade another exercise carry `@pytest.mark.needs(...)` (tests/conftest.py):
in the handout they fail until those exercises are done. EXERCISES below is the registry: what
each exercise asks, where the paper defines it, its points, and the tests that grade it (each
passes with that exercise alone written: the tests of sample() stand in for filter_logits(), and
so on). The optional exercises (DAPO's neighbours in losses.py) are bonus points on top of the
100 that the others and the integration check make: the demo never runs them.
"""
import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, above course/
# The builtin exception the handout raises, spelled in two parts so that a search of the
# reference for unfinished code (that word) finds none here
NOT_DONE = "NotImplemented" + "Error"
START = re.compile(r"^(\s*)# exercise: (\w+)\s*$")
END = re.compile(r"^(\s*)# end exercise\s*$")
# Never part of a handout, even where git tracks something under them
SKIP_DIRS = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"}
# What a handout wrote, "<sha256>  <path>" a line (as sha256sum writes): what writing it again into
# the same directory may replace, and nothing else
MANIFEST = ".handout.sha256"
# The instructor's own: the answer sketches of the written part, the tests of this file and of
# its grader, which expect the reference's answers, and the style check, which the blanked bodies
# fail (ruff: the code after them uses their names)
INSTRUCTOR_ONLY = {"docs/instructors.md", "tests/test_assign.py", "tests/test_grader.py",
                   "tests/test_style.py"}
# A test file that holds a private test (--extra-tests' mark) is the instructor's wherever it is
PRIVATE_TEST = re.compile(r"@pytest\.mark\.grades\(")


@dataclass(frozen=True)
class Exercise:
    id: str
    file: str
    title: str
    paper: str  # where the paper (or the code it follows) defines it
    difficulty: str  # easy, medium or hard
    points: int
    todo: str  # the one line the handout's raise says
    hints: tuple[str, ...]
    # pytest node ids that grade it: a parametrized test's name grades every case, name[id] one
    tests: tuple[str, ...]
    idea: tuple[str, ...]  # the tests (names, among tests) that check what the paper says it is
    optional: bool = False  # bonus points on top of the 100; the integration check never waits


def _tests(file, *names):
    return tuple(f"tests/{file}::{name}" for name in names)


EXERCISES = [
    Exercise(
        "group_advantages", "dapo.py", "the group-normalised advantage", "Eq. 9", "easy", 5,
        "A_i = (R_i - mean) / (std + eps) per group, Eq. 9",
        ("A group's G responses are contiguous: view the rewards as (N / G, G).",
         "torch.std is the unbiased (N - 1) one, as verl; a group of one has mean 0 and std 1."),
        _tests("test_dapo.py", "test_group_advantages_normalise_each_group_with_unbiased_std",
               "test_all_equal_group_has_zero_advantage", "test_group_of_one_keeps_its_reward"),
        idea=("test_group_advantages_normalise_each_group_with_unbiased_std",)),
    Exercise(
        "keep_groups", "dapo.py", "the dynamic-sampling filter", "Eq. 11 (Sec. 3.2)", "easy", 5,
        "which groups have mixed accuracy, Eq. 11",
        ("Filter on acc (right or wrong), not on the shaped reward.",
         "verl keeps a group iff the population std (ddof 0) of its accuracy is > 0, or G = 1."),
        _tests("test_dapo.py", "test_keep_groups_drops_all_right_and_all_wrong",
               "test_keep_groups_keeps_groups_of_one"),
        idea=("test_keep_groups_drops_all_right_and_all_wrong",)),
    Exercise(
        "policy_loss", "dapo.py", "the clipped surrogate with decoupled bounds, summed per token",
        "Eq. 10, 12 (Sec. 3.1, 3.3)", "medium", 12,
        "the clipped surrogate (Eq. 10) over denom (Eq. 12)",
        ("r = exp(logp - old_logp); clamp the log-ratio to [-20, 20] first (exp(90) is inf).",
         "Take the max of the two per-token losses (the pessimistic one).",
         "Return PolicyLoss(sum(l * mask) / denom, l, r): the loop reads its clip statistics "
         "from your l and r (and verl's additions, losses.dual_clip_and_weights, reweigh your l)."),
        _tests("test_dapo.py", "test_clip_higher_surrogate_on_hand_cases",
               "test_clipped_tokens_get_no_gradient",
               "test_token_level_loss_weighs_every_token_equally",
               "test_log_ratio_is_clamped_so_an_overflowing_ratio_keeps_the_gradient_finite"),
        idea=("test_clip_higher_surrogate_on_hand_cases",
              "test_token_level_loss_weighs_every_token_equally")),
    Exercise(
        "token_count", "dapo.py", "the token-level loss's denominator, before the split",
        "Eq. 12 (Sec. 3.3)", "medium", 8,
        "mask, n_tokens, n_seqs of the whole mini-batch",
        ("Set mask (the mini-batch's loss mask), n_tokens and n_seqs; the loop below uses them.",
         "Count before the micro-batch loop: a count per micro-batch makes the gradient depend "
         "on the split (verl PR #623, TRL #5619).",
         "distributed.all_reduce sums a list of numbers over the ranks (one process: as is)."),
        _tests("test_dapo.py", "test_the_loss_denominator_is_the_mini_batch_token_count",
               "test_a_stand_in_policy_update_is_the_same_for_any_micro_batch_split"),
        idea=("test_the_loss_denominator_is_the_mini_batch_token_count",)),
    Exercise(
        "overlong_penalty", "reward.py", "the soft overlong punishment", "Eq. 13 (Sec. 3.4)",
        "easy", 5, "the soft overlong punishment of Eq. 13",
        ("Three cases; check the boundaries: length == max_len - buffer_len and == max_len.",
         "Refuse a buffer outside (0, max_len] with a ValueError."),
        _tests("test_reward.py", "test_overlong_penalty_at_the_paper_settings",
               "test_overlong_penalty_is_linear_inside_the_buffer",
               "test_overlong_penalty_factor_scales_it",
               "test_overlong_penalty_rejects_a_buffer_outside_the_max_length"),
        idea=("test_overlong_penalty_at_the_paper_settings",
              "test_overlong_penalty_is_linear_inside_the_buffer")),
    Exercise(
        "extract_answer", "reward.py", "math_dapo's answer extraction", "Eq. 7 (Sec. 2.4)",
        "easy", 4, "the text after the last Answer: in the window",
        ("ANSWER_RE and WINDOW are defined at the top of reward.py.",
         "The last match of a left-to-right scan, not a search from the end."),
        _tests("test_reward.py", "test_extract_answer_matches_math_dapo",
               "test_extract_answer_reads_only_the_last_300_characters",
               "test_extract_answer_takes_the_last_answer_of_a_response_that_corrects_itself",
               "test_extract_answer_takes_the_last_of_thousands_of_lines"),
        idea=("test_extract_answer_reads_only_the_last_300_characters",
              "test_extract_answer_takes_the_last_answer_of_a_response_that_corrects_itself")),
    Exercise(
        "normalize", "reward.py", "math_dapo's answer normalisation", "Eq. 7 (Sec. 2.4)",
        "medium", 5, "REPLACEMENTS, REMOVED, REWRITES, in order",
        ("Keep the text after the last '=' first; the order of every later step matters.",
         "Drop the commas of a number only (str.isdigit after removing them)."),
        _tests("test_reward.py", "test_normalize_matches_math_dapo"),
        idea=("test_normalize_matches_math_dapo",)),
    Exercise(
        "filter_logits", "sampler.py", "top-k, then top-p (nucleus) truncation", "Sec. 4.1",
        "medium", 8, "-inf outside the top-k, then outside the top-p nucleus",
        ("Top-k keeps every logit equal to the k-th largest (ties stay together).",
         "Top-p: keep a token iff the mass strictly above it is < top_p, after top-k.",
         "top_k = 0 and top_p = 1.0 must return the logits unchanged."),
        _tests("test_sampler.py", "test_top_k_keeps_the_k_largest",
               "test_top_k_keeps_every_token_tied_with_the_kth",
               "test_top_p_keeps_the_smallest_nucleus_holding_top_p",
               "test_top_p_nucleus_stops_as_soon_as_it_holds_top_p",
               "test_top_p_always_keeps_the_argmax",
               "test_top_p_applies_to_the_top_k_renormalised_distribution",
               "test_top_k_0_and_top_p_1_are_no_ops", "test_rows_are_filtered_independently"),
        idea=("test_top_k_keeps_the_k_largest",
              "test_top_p_keeps_the_smallest_nucleus_holding_top_p",
              "test_top_p_applies_to_the_top_k_renormalised_distribution")),
    Exercise(
        "sample", "sampler.py", "the sampling draw and the drawn token's log-prob",
        "Algorithm 1, line 3", "medium", 6, "draw a token per row; return it and its log-prob",
        ("Divide by the temperature, filter_logits, softmax, then draw with the generator.",
         "The log-prob is under log_softmax(logits / T) before truncation: the policy's own.",
         "temperature 0 is greedy: the argmax, and log_softmax of the raw logits."),
        _tests("test_sampler.py", "test_sample_draws_in_proportion_to_the_tempered_softmax",
               "test_sample_logprob_is_the_policys_before_truncation",
               "test_greedy_sample_takes_the_argmax",
               "test_sample_is_reproducible_with_a_generator",
               "test_sampling_never_draws_a_token_of_zero_probability"),
        idea=("test_sample_draws_in_proportion_to_the_tempered_softmax",
              "test_sample_logprob_is_the_policys_before_truncation")),
    Exercise(
        "logprobs_forward", "dapo_kernels/reference.py",
        "log-softmax and entropy of a chunk of rows",
        "Fig. 2b (entropy)", "hard", 9, "log-prob, entropy, lse and mean logit of each row",
        ("Work relative to the row max m: d = sum exp(z - m), lse = m + log d.",
         "entropy = lse - E[z], E[z] = sum p z; a -inf logit has p = 0 and 0 * -inf is NaN.",
         "Compute in fp32 whatever the chunk's dtype; divide by the temperature first."),
        _tests("test_kernels.py", "test_forward_chunk_matches_float64"),
        idea=("test_forward_chunk_matches_float64",)),
    Exercise(
        "logprobs_backward", "dapo_kernels/reference.py", "the gradient of log-prob and entropy",
        "Fig. 2b (entropy)", "hard", 9, "the loss's gradient w.r.t. the chunk's logits",
        ("p_j = exp(z_j - lse) from the saved lse; d logp / dz_j = 1[j = t] - p_j.",
         "d H / dz_j = -p_j (z_j - E[z]); a gradient that is None contributes nothing.",
         "z is the tempered logit: multiply the result by 1 / T."),
        _tests("test_kernels.py", "test_backward_chunk_matches_float64"),
        idea=("test_backward_chunk_matches_float64",)),
    Exercise(
        "rope", "model.py", "rotary position embeddings (rotate-half layout)", "Qwen2 (RoPE)",
        "medium", 5, "rotary embeddings, rotate-half layout",
        ("angle = position * inv_freq; Qwen2 pairs dimension i with i + head_dim / 2.",
         "Compute the angles in fp32 and cast cos and sin to the activations' dtype."),
        _tests("test_model.py", "test_rope_matches_transformers",
               "test_rope_attention_scores_depend_on_the_relative_position_only"),
        idea=("test_rope_matches_transformers",)),
    Exercise(
        "attention", "model.py", "causal grouped-query attention", "Qwen2 (GQA)", "medium", 5,
        "causal grouped-query attention of q over k, v",
        ("Query head h reads key/value head h // (n_head / n_kv_head).",
         "mask is None (causal) or (B, 1, T, S) bool, True where a query sees a key.",
         "F.scaled_dot_product_attention takes a bool mask; y is (B, H, T, D)."),
        _tests("test_model.py", "test_attention_matches_the_textbook_formula"),
        idea=("test_attention_matches_the_textbook_formula",)),
    Exercise(
        "kv_cache", "model.py", "the KV-cache write", "gpt-fast's KVCache", "medium", 4,
        "write k, v at their positions; return the rows",
        ("Advanced indexing: rows (n, 1) and positions (n, T) index dims 0 and 2 together.",
         "Return the rows' keys and values up to S = self.length (0: the whole cache)."),
        _tests("test_model.py", "test_kv_cache_writes_each_token_at_its_position_in_its_row",
               "test_kv_cache_without_rows_writes_the_first_rows"),
        idea=("test_kv_cache_writes_each_token_at_its_position_in_its_row",)),
    # Optional: DAPO's neighbours (losses.py), bonus points. Each is verl's function of the same
    # idea, pinned to verl's values; the demo trains with DAPO's Eq. 9 and 10 and never calls them.
    Exercise(
        "dr_grpo", "losses.py", "the advantage with the group's std, the batch's, or none",
        "arXiv 2503.20783 (Dr. GRPO)", "easy", 4,
        "R_i - group mean, over the group std, batch std or 1",
        ("The three scales share the group's mean; they differ in what they divide by: the "
         "group's std, batch_std(rewards) (every rank's), or nothing (Dr. GRPO).",
         "A group of one has mean 0 and std 1 (verl's convention): with none, A_i = R_i.",
         "group must be dapo.group_advantages to the bit: the same operations, in its order."),
        _tests("test_losses.py", "test_group_scale_equals_verl_grpo_outcome_advantage",
               "test_no_scale_equals_verl_grpo_advantage_without_std_as_dr_grpo",
               "test_a_group_of_one_has_mean_0_and_std_1_as_in_verl",
               "test_batch_scale_divides_by_the_std_of_every_reward"),
        idea=("test_no_scale_equals_verl_grpo_advantage_without_std_as_dr_grpo",), optional=True),
    Exercise(
        "gspo", "losses.py", "one clipped ratio per response",
        "arXiv 2507.18071 (GSPO-token)", "medium", 6,
        "the sequence ratio s_i on each token, clipped as Eq. 10",
        ("log s_i is the mean of logp - old_logp over the response's tokens in the mask (at "
         "least 1), not over the padded width.",
         "x - x.detach() is 0 in value and carries x's gradient: s_it's value is s_i, its "
         "gradient each token's own; a log s_i left undetached counts its gradient twice.",
         "Clamp log s_it at 10 (verl), then Eq. 10's max of the two losses with s_it as the "
         "ratio; return PolicyLoss(sum(l * mask) / denom, l, s_it)."),
        _tests("test_losses.py", "test_gspo_loss_equals_verl_compute_policy_loss_gspo",
               "test_gspo_gives_every_token_of_a_response_its_sequence_ratio",
               "test_gspo_loss_equals_trls_sequence_ratio_without_stop_gradients",
               "test_gspo_loss_is_the_same_whatever_the_micro_batches",
               "test_the_losses_compute_in_float32_what_they_compute_in_float64[gspo]"),
        idea=("test_gspo_gives_every_token_of_a_response_its_sequence_ratio",
              "test_gspo_loss_equals_trls_sequence_ratio_without_stop_gradients"),
        optional=True),
    Exercise(
        "cispo", "losses.py", "the clip bounds a weight, not the gradient",
        "arXiv 2506.13585 (CISPO)", "easy", 4,
        "REINFORCE on log pi, weighted by the clipped ratio, detached",
        ("Clamp the log-ratio to [-20, 20] before exp, as policy_loss does.",
         "The loss is linear in logp: its gradient on a token is -weight * A, clipped or not; "
         "a weight that is not detached adds a gradient of its own.",
         "clipped: where the ratio and its clip differ, on either side, whatever A's sign."),
        _tests("test_losses.py", "test_cispo_loss_equals_verl_compute_policy_loss_cispo",
               "test_cispo_clipped_is_verl_pg_clipfrac",
               "test_cispo_gives_every_clipped_token_a_gradient",
               "test_cispo_loss_is_the_same_whatever_the_micro_batches",
               "test_the_losses_compute_in_float32_what_they_compute_in_float64[cispo]"),
        idea=("test_cispo_gives_every_clipped_token_a_gradient",), optional=True),
    Exercise(
        "kl_cov", "losses.py", "a KL penalty on the tokens of largest covariance",
        "arXiv 2505.22617 (KL-Cov)", "hard", 6,
        "-A r, and a KL penalty on the top-k covariance tokens",
        ("The covariance is over the valid tokens only (those in the mask), in row-major order, "
         "centred by their own means and detached.",
         "k = max(1, int(n_valid * kl_cov_ratio)); torch.topk's indices are among the valid "
         "tokens: map them back to positions of the (B, R) batch.",
         "No clip: -A r everywhere, plus ppo_kl_coef |logp - old_logp| on the k tokens; "
         "clipped is that selection."),
        _tests("test_losses.py", "test_kl_cov_loss_equals_verl_compute_policy_loss_kl_cov",
               "test_kl_cov_clipped_marks_the_top_k_tokens_that_verl_penalises",
               "test_kl_cov_penalises_the_top_k_tokens_and_no_other",
               "test_kl_cov_depends_on_the_micro_batch_split",
               "test_kl_cov_with_no_token_in_the_loss_penalises_nothing",
               "test_the_losses_compute_in_float32_what_they_compute_in_float64[kl_cov]"),
        idea=("test_kl_cov_clipped_marks_the_top_k_tokens_that_verl_penalises",
              "test_kl_cov_penalises_the_top_k_tokens_and_no_other"), optional=True),
]
BY_ID = {e.id: e for e in EXERCISES}
REQUIRED = [e for e in EXERCISES if not e.optional]  # with the integration check: 100 points
OPTIONAL = [e for e in EXERCISES if e.optional]  # bonus points on top
EXAMPLE = "keep_groups"  # the exercise the student copy's README and EXERCISES.md show checked

# The integration check: a short run of the demo (make run's task and settings), the student's
# code everywhere. Measured with the reference (one thread): val/acc (avg@4) 0.33 -> 0.79 after 6
# steps at seed 0, the check's (0.33 -> 0.80 under ATEN_CPU_CAPABILITY=default); 0.29-0.35 ->
# 0.66-0.79 over seeds 0-4; 15-20 s after the warm-up. The bar sits well above the base model and
# well below the reference.
INTEGRATION_ARGS = ("--steps", "6", "--eval-every", "6")
INTEGRATION_MIN_ACC = 0.55
INTEGRATION_POINTS = 10


# ------------------------------------------------------------------------------------------------
# Markers and the handout

@dataclass(frozen=True)
class Region:
    id: str
    start: int  # the line index of "# exercise: id"
    end: int  # the line index of "# end exercise"
    indent: str


def find_regions(text: str, where: str) -> list[Region]:
    """The marked regions of a file's text; malformed markers are an error naming the line."""
    regions, open_ = [], None
    for i, line in enumerate(text.splitlines()):
        start, end = START.match(line), END.match(line)
        if start:
            if open_:
                raise ValueError(f"{where}:{i + 1}: exercise inside exercise {open_[1]!r}")
            open_ = (i, start.group(2), start.group(1))
        elif end:
            if not open_ or end.group(1) != open_[2]:
                raise ValueError(f"{where}:{i + 1}: an end marker without a start at its indent")
            if i == open_[0] + 1:
                raise ValueError(f"{where}:{i + 1}: exercise {open_[1]!r} marks nothing")
            regions.append(Region(open_[1], open_[0], i, open_[2]))
            open_ = None
    if open_:
        raise ValueError(f"{where}:{open_[0] + 1}: exercise {open_[1]!r} is never closed")
    return regions


def blank(text: str, regions: list[Region]) -> str:
    """The text with each region's lines replaced by a raise that names its exercise."""
    lines = text.splitlines(keepends=True)
    for r in sorted(regions, key=lambda r: r.start, reverse=True):
        message = json.dumps(f"{r.id}: {BY_ID[r.id].todo}")
        lines[r.start + 1:r.end] = [f"{r.indent}raise {NOT_DONE}({message})\n"]
    return "".join(lines)


def functions(root: str, exercise: Exercise, regions: dict[str, list[Region]]) -> list[str]:
    """The functions an exercise's regions sit in: ['rope_cos_sin', 'apply_rope']."""
    with open(os.path.join(root, exercise.file), encoding="utf-8") as f:
        text = f.read()
    return list(dict.fromkeys(enclosing(text, r.start) for r in regions[exercise.file]
                              if r.id == exercise.id))


def enclosing(text: str, line: int) -> str:
    """The qualified name of the innermost def holding line (0-based): 'KVCache.update'."""
    best = []

    def visit(node, path):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                inner = path + [child.name]
                if child.lineno <= line + 1 <= child.end_lineno:
                    if isinstance(child, ast.FunctionDef) and len(inner) > len(best):
                        best[:] = inner
                visit(child, inner)

    visit(ast.parse(text), [])
    return ".".join(best)


def source_files(root: str) -> list[str]:
    """The files of the repository, relative to root: what git tracks (so that untracked files,
    run outputs and caches stay out), or, outside a git checkout (a handout), every file but
    those under SKIP_DIRS."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True,
                             check=True).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(set(dirs) - SKIP_DIRS)  # os.walk descends into what is left
            files += [os.path.relpath(os.path.join(d, name), root) for name in names]
    return sorted(f for f in files if not SKIP_DIRS & set(f.split("/")[:-1]) and
                  os.path.isfile(os.path.join(root, f)) and not f.endswith(".pyc"))


def marked_regions(root: str, files: list[str]) -> dict[str, list[Region]]:
    """{file: its regions}, checked against the registry: every id known and in its own file,
    every exercise marked."""
    found = {}
    for path in files:
        # this file's docstring shows a marker
        if path.endswith(".py") and path != "course/assign.py":
            with open(os.path.join(root, path), encoding="utf-8") as f:
                regions = find_regions(f.read(), path)
            if regions:
                found[path] = regions
    for path, regions in found.items():
        for r in regions:
            if r.id not in BY_ID:
                raise ValueError(f"{path}:{r.start + 1}: {r.id!r} is not in assign.EXERCISES")
            if BY_ID[r.id].file != path:
                raise ValueError(f"{path}:{r.start + 1}: {r.id!r} belongs to {BY_ID[r.id].file}")
    marked = {r.id for regions in found.values() for r in regions}
    missing = [e.id for e in EXERCISES if e.id not in marked]
    if missing:
        raise ValueError(f"no marked region for {', '.join(missing)}")
    return found


def write_handout(out: str, root: str = ROOT) -> list[str]:
    """Write the student copy into out (empty but for SKIP_DIRS, or holding a handout written
    before, unchanged: its .git, .venv and runs/ are kept) and return its files."""
    out, root = os.path.realpath(out), os.path.realpath(root)
    common = os.path.commonpath([out, root])
    if common == out or (common == root and not out.startswith(os.path.join(root, "runs", ""))):
        raise ValueError(f"{out}: holds the repository, or lies in it outside runs/")
    for path in replaceable_files(out):  # all checked before the first is removed
        os.remove(os.path.join(out, path))
    files = source_files(root)
    regions = marked_regions(root, files)
    left_out = instructor_files(root, files)  # reads every test file: once, not once a file
    files = [f for f in files if f not in left_out]
    for path in files:
        src, dst = os.path.join(root, path), os.path.join(out, path)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if path in regions or path in STUDENT_VERSIONS or path.endswith(".ipynb"):
            with open(src, encoding="utf-8") as f:
                text = f.read()
            with open(dst, "w", encoding="utf-8") as f:
                f.write(blank(text, regions[path]) if path in regions else
                        strip_outputs(text) if path.endswith(".ipynb") else
                        STUDENT_VERSIONS[path](text, root, regions))
            shutil.copymode(src, dst)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)
    with open(os.path.join(out, "EXERCISES.md"), "w", encoding="utf-8") as f:
        f.write(exercises_md(root, regions))
    files.append("EXERCISES.md")
    with open(os.path.join(out, MANIFEST), "w", encoding="utf-8") as f:
        f.writelines(f"{digest(os.path.join(out, path))}  {path}\n" for path in files)
    return files


def replaceable_files(out: str) -> list[str]:
    """The files of out (outside SKIP_DIRS) when each is one a handout wrote, as it wrote it (its
    MANIFEST says); raise naming out when any is not: make handout once emptied any directory
    holding an EXERCISES.md, work not committed included."""
    present = []
    for d, dirs, names in os.walk(out):
        dirs[:] = sorted(set(dirs) - SKIP_DIRS)
        present += [os.path.relpath(os.path.join(d, name), out) for name in names]
    if not present:
        return []
    if not os.path.isfile(os.path.join(out, MANIFEST)):
        raise ValueError(f"{out} is not empty and holds no handout ({MANIFEST} lists what one "
                         "wrote): refusing to replace it; give an empty or new directory")
    written = {}  # {path: sha256}
    with open(os.path.join(out, MANIFEST), encoding="utf-8") as f:
        for line in f:
            sha, _, path = line.rstrip("\n").partition("  ")
            written[path] = sha
    for path in sorted(present):
        if path != MANIFEST and written.get(path) != digest(os.path.join(out, path)):
            what = ("changed since the handout wrote it" if path in written else
                    "is not the handout's")
            raise ValueError(f"{out}: {path} {what}: refusing to replace it; move it out, or give "
                             "an empty or new directory")
    return present


def digest(path: str) -> str:
    """The sha256 of a file's bytes (of a link's target path: copied as a link)."""
    if os.path.islink(path):
        return hashlib.sha256(os.readlink(path).encode()).hexdigest()
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def instructor_files(root: str, files: list[str]) -> set[str]:
    """The files of `files` that a handout leaves out: INSTRUCTOR_ONLY, and every test file (as
    pytest finds them, test_*.py) that holds a private test."""
    private = set()
    for path in files:
        if os.path.basename(path).startswith("test_") and path.endswith(".py"):
            with open(os.path.join(root, path), encoding="utf-8") as f:
                if PRIVATE_TEST.search(f.read()):
                    private.add(path)
    return (INSTRUCTOR_ONLY & set(files)) | private


def strip_outputs(notebook: str) -> str:
    """A notebook's JSON without what running it left: outputs, execution counts and times."""
    nb = json.loads(notebook)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
        cell.get("metadata", {}).pop("execution", None)
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def student_readme(readme: str, root: str, regions: dict[str, list[Region]]) -> str:
    """The README with, under its title, what a student copy is and how to check an exercise,
    and without its "Teaching with it" section (the instructor's, whose docs stay out)."""
    title, _, rest = readme.partition("\n")
    rest = re.sub(r"\n## Teaching with it\n.*?(?=\n## |\Z)", "", rest, flags=re.S)
    example = BY_ID[EXAMPLE]
    intro = (f"**This is a student copy**, generated for a course: {len(REQUIRED)} pieces of "
             f"the code are left for you to write (and {len(OPTIONAL)} optional ones, for bonus "
             f"points), each a function body that raises `{NOT_DONE}` until you do. "
             "[EXERCISES.md](EXERCISES.md) says what each asks, with the paper's equation and "
             "hints; the rest of this README describes the finished project. `make run` (the "
             "demo) runs every exercise but the optional ones: until all are written, it names "
             "those left.")
    header = [
        "", *textwrap.wrap(intro, 98, initial_indent="> ", subsequent_indent="> "), "",
        "| exercise | file | function | points |", "| --- | --- | --- | --- |",
        *[f"| `{e.id}` | `{e.file}` | "
          f"{', '.join(f'`{name}()`' for name in functions(root, e, regions))} | "
          f"{points_text(e)} |" for e in EXERCISES], "",
        "```bash",
        f"{'make check EX=' + example.id:<28}# its tests (the first time, this installs pytest)",
        f"{'make grade':<28}# the score out of 100 (and the bonus): every exercise, a demo run",
        "```", "",
        "The same tests by hand, once pytest is installed:", "",
        "```bash",
        f".venv/bin/python -m pytest -q {example.tests[0].split('::')[0]} -k {example.id}  # " +
        ", ".join(t.split("::")[1] for t in example.tests),
        "```"]
    return title + "\n" + "\n".join(header) + "\n" + rest.rstrip("\n") + "\n"


def student_makefile(makefile: str, root: str, regions) -> str:
    """The Makefile whose `make run` first stops, in one line, while an exercise is not written."""
    return (re.sub(r"^(run:.*\n)", r"\1\t$(if $(UNWRITTEN),$(error $(UNWRITTEN)))\n", makefile,
                   count=1, flags=re.M) +
            "\n# The student copy: make run runs every exercise, so while some still raise it "
            "says which\n# (one line) instead of a traceback\n"
            "UNWRITTEN = $(shell $(PYTHON) -m course.assign todo)\n")


# The files a handout rewrites: {path: (text, root, regions) -> the student's text}
STUDENT_VERSIONS = {"README.md": student_readme, "Makefile": student_makefile}


def todo(root: str = ROOT) -> list[str]:
    """The exercises that the demo runs (all but the optional ones) whose body in root still
    raises the handout's error (a student copy's)."""
    left = []
    for e in REQUIRED:
        with open(os.path.join(root, e.file), encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        if any(f"raise {NOT_DONE}(\"{e.id}: " in line for r in find_regions(text, e.file)
               if r.id == e.id for line in lines[r.start + 1:r.end]):
            left.append(e.id)
    return left


def check(ids=(), root: str = ROOT) -> int:
    """Run the chosen exercises' tests (all: every exercise's) with pytest, in the foreground
    -> pytest's exit code."""
    tests = [t for e in EXERCISES if not ids or e.id in ids for t in e.tests]
    cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", *tests]
    print(" ".join(["python", *cmd[1:]]), flush=True)
    return subprocess.run(cmd, cwd=root).returncode


def exercises_md(root: str, regions: dict[str, list[Region]]) -> str:
    total = sum(e.points for e in REQUIRED) + INTEGRATION_POINTS
    lines = [
        "# Exercises", "",
        "Each exercise is a body in the code that raises `" + NOT_DONE + "` between "
        "`# exercise: <id>` and `# end exercise`. Write it there (the docstring above it is the "
        "specification), run its tests, and keep the markers: the grader needs nothing else.", "",
        "```bash",
        f"make check EX={EXAMPLE}   # one exercise's tests (the first time, installs pytest)",
        "make test    # the whole suite: a test that needs an unfinished exercise fails naming it",
        "make grade   # the score: each exercise's tests, then a short training run of the demo",
        "```", "",
        "`make run` (the demo) runs every exercise but the optional ones: until all are written, "
        "it names those left.",
        "",
        f"The grade is out of {total}. Each exercise: half its points if every test of its idea "
        "(the tests marked *idea* below: what the paper says the exercise is) passes, half in "
        "proportion to all its tests that pass, so a solution that misses the idea scores at "
        f"most half; and {INTEGRATION_POINTS} for the integration check, a "
        f"{INTEGRATION_ARGS[1]}-step run of the demo (`make run`'s task) with your code "
        f"everywhere that must reach val/acc >= {INTEGRATION_MIN_ACC} (the base model: ~0.3). "
        "The paper: "
        "[arXiv 2503.14476](https://arxiv.org/abs/2503.14476); the README maps it to the code.",
        "",
        f"The last {len(OPTIONAL)} are optional: DAPO's neighbours in `losses.py` (the losses that "
        "followed it, each equal to verl's own), scored the same way, as bonus points on top of "
        f"the {total} (up to {sum(e.points for e in OPTIONAL)} more). The demo never runs them, "
        "so the integration check does not wait on them; `docs/neighbours.md` puts each beside "
        "DAPO's equations.",
        "", "| exercise | file | difficulty | points |", "| --- | --- | --- | --- |"]
    lines += [f"| `{e.id}` | `{e.file}` | {e.difficulty} | {points_text(e)} |" for e in EXERCISES]
    for n, e in enumerate(EXERCISES, 1):
        where = functions(root, e, regions)
        lines += [
            "", f"## {n}. `{e.id}`: {e.title}", "",
            f"- **Where**: {', '.join(f'`{name}()`' for name in where)} in `{e.file}`",
            f"- **Paper**: {e.paper}",
            f"- **Difficulty**: {e.difficulty}, " +
            (f"{e.points} bonus points (optional)" if e.optional else f"{e.points} points"),
            f"- **What to write**: {e.todo}",
            "- **Hints**:", *[f"  - {h}" for h in e.hints],
            "- **Idea** (half the points): " + ", ".join(f"`{t}`" for t in e.idea),
            "- **Tests** (`make check EX=" + e.id + "` runs them): " +
            ", ".join(f"`{t.split('::')[1]}`" for t in e.tests)]
    lines += ["", "## Written part: run, look, explain", "",
              "Answer each in a few sentences (not graded by `make grade`)."]
    lines += [f"{n}. {q}" for n, q in enumerate(WRITTEN, 1)]
    return "\n".join(lines) + "\n"


def points_text(exercise: Exercise) -> str:
    """An exercise's points as the tables write them: "6", or "+6 (optional)" for a bonus."""
    return f"+{exercise.points} (optional)" if exercise.optional else str(exercise.points)


# The handout's written part, one question per technique (an answer sketch: docs/instructors.md)
WRITTEN = [
    "**Clip-higher (Eq. 10).** Run `notebooks/dapo_step.ipynb`'s clip cell. For A > 0, up to which "
    "ratio does a token still get a gradient with eps_high 0.2, and with 0.28? Why does that "
    "matter for a token whose old probability is 0.01, and why is eps_low left at 0.2?",
    "**Dynamic sampling (Eq. 11).** Run `python -m experiments.ablate --rows 1 3 --seeds 0 1` "
    "and compare the groups-with-signal curves in `runs/ablate/ablation.png`. Why is DAPO's "
    "curve flat at the batch size by construction, and what would show a benefit instead?",
    "**Token-level loss (Eq. 12).** In the notebook's token weights (its Eq. 12 cell), what "
    "weight does one token of the long response get under Eq. 12 and under GRPO's per-sample "
    "mean? Which responses does that dilute, and why must the count be taken before the "
    "micro-batch split?",
    "**Overlong shaping (Eq. 13).** From the notebook's penalty curve: which lengths cost "
    "nothing, which are penalised, and why is a smooth ramp better than -1 at the limit alone?",
]


# ------------------------------------------------------------------------------------------------
# The grader

class Recorder:
    """A pytest plugin, loaded in the grader's pytest process: keeps the tests it is asked for
    (all, when none are named) and those an extra file marks with @pytest.mark.grades(id), and
    writes each one's outcome as a JSON line as soon as it ends, so that a run stopped by the
    timeout keeps what finished."""

    def __init__(self, path, only=()):
        self.out, self.only = open(path, "w"), tuple(only)
        self.marks, self.failure, self.skipped = {}, {}, set()

    def pytest_configure(self, config):
        config.addinivalue_line("markers", "grades(exercise): a test of --extra-tests that "
                                           "counts for that exercise")

    def pytest_collection_modifyitems(self, config, items):
        if self.only:
            keep = [item for item in items if item.get_closest_marker("grades") or
                    any(_matches(item.nodeid, t) for t in self.only)]
            left = [item for item in items if item not in keep]
            config.hook.pytest_deselected(items=left)
            items[:] = keep
            tests = os.path.join(os.getcwd(), "tests", "")
            for item in left:  # an extra test that names no exercise would count for nothing
                if not str(item.path).startswith(tests):
                    self._write(nodeid=item.nodeid, outcome="unmarked", message="")
        for item in items:
            self.marks[item.nodeid] = {name: [a for m in item.iter_markers(name) for a in m.args]
                                       for name in ("grades", "needs")}

    def pytest_collectreport(self, report):
        if report.failed:
            self._write(nodeid=report.nodeid, outcome="error", message=_message(report))

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failure.setdefault(report.nodeid, (_message(report), _exercise(report)))
        elif report.skipped:
            self.skipped.add(report.nodeid)
        if report.when == "teardown":
            message, exercise = self.failure.get(report.nodeid, ("", None))
            outcome = "failed" if message else \
                "skipped" if report.nodeid in self.skipped else "passed"
            self._write(nodeid=report.nodeid, outcome=outcome, message=message,
                        exercise=exercise, **self.marks.get(report.nodeid, {}))

    def _write(self, **record):
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash else str(report.longrepr)
    return text.strip().splitlines()[0] if text.strip() else "failed"


def _exercise(report) -> str | None:
    """The exercise whose unwritten body a failure came from: the first whose raise message is in
    its report (the traceback, or a subprocess's output), or None."""
    text = str(report.longrepr) + "".join(content for _, content in report.sections)
    return next((e.id for e in EXERCISES if f"{e.id}: {e.todo}" in text), None)


def _matches(nodeid: str, test: str) -> bool:
    """Whether nodeid is test, or one of its parametrized cases."""
    return nodeid == test or nodeid.startswith(test + "[")


def pytest_main(results: str, only: list[str], args: list[str]) -> int:
    """What the grader's subprocess runs: pytest with a Recorder."""
    import pytest
    return pytest.main(args, plugins=[Recorder(results, only)])


def run_tests(args: list[str], only=(), root: str = ROOT, timeout: float = 900,
              log: str | None = None) -> list[dict]:
    """Run pytest on args in a fresh process in root, keeping the tests of `only` (node ids) if
    given; -> one record per test: nodeid, outcome, message, grades, needs. A test that had not
    ended at the timeout is missing."""
    env = dict(os.environ, PYTHONPATH=root, PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny tensors: threads only wait on each other
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.jsonl")
        code = ("import json, sys; from course import assign; "
                "sys.exit(assign.pytest_main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]))")
        # native tracebacks: pytest's own take ~0.1 s each to format, and a blank handout has 100s
        cmd = [sys.executable, "-c", code, results, json.dumps(list(only)), "-q", "--tb=native",
               "-p", "no:cacheprovider", "--continue-on-collection-errors", *args]
        with open(log or os.devnull, "w") as out:
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        if not os.path.exists(results):  # pytest never started
            return []
        with open(results) as f:
            return [json.loads(line) for line in f]


def grade(ids=(), extra_tests=None, json_path=None, integration=True, root=ROOT,
          timeout=900) -> dict:
    """Each chosen exercise's tests (and the extra tests marked for it), the integration check
    (when every exercise is graded), a table on stdout and a JSON file -> the JSON's dict."""
    chosen = [BY_ID[i] for i in ids] if ids else EXERCISES
    wanted = [t for e in chosen for t in e.tests]
    files = list(dict.fromkeys(t.split("::")[0] for t in wanted))
    if extra_tests:
        files.append(os.path.abspath(extra_tests))
    json_path = json_path or os.path.join(root, "runs", "grade.json")
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    log = os.path.splitext(json_path)[0] + "-tests.log"
    t0 = time.time()
    records = run_tests(files, wanted, root, timeout, log)
    results = []
    for e in chosen:
        mine = [r for r in records if r.get("outcome") != "error" and
                (any(_matches(r["nodeid"], t) for t in e.tests) or e.id in r.get("grades", []))]
        # a test never run (its file did not import, or the timeout) counts as failed
        missing = [t for t in e.tests if not any(_matches(r["nodeid"], t) for r in mine)]
        failures = [(r["nodeid"], r["message"]) for r in mine if r["outcome"] != "passed"]
        failures += [(t, why_missing(t, records)) for t in missing]
        total = len(mine) + len(missing)
        passed = total - len(failures)
        results.append(dict(id=e.id, file=e.file, passed=passed, total=total,
                            score=round(exercise_score(e, passed, total, failures), 2),
                            max_score=e.points, failures=failures, optional=e.optional))
    unknown = sorted({g for r in records for g in r.get("grades", [])} - set(BY_ID))
    if unknown:
        raise ValueError(f"{extra_tests}: tests mark unknown exercises {', '.join(unknown)}")
    unmarked = [r["nodeid"] for r in records if r["outcome"] == "unmarked"]
    if unmarked:
        raise ValueError(f"{extra_tests}: {len(unmarked)} test(s) name no exercise (mark each "
                         f"@pytest.mark.grades(<exercise id>)), first {unmarked[0]}")
    check = None
    # the training loop runs every exercise but the optional ones: none of those may be unwritten
    if integration and not ids:
        unwritten = [e.id for e in REQUIRED if any(r.get("exercise") == e.id for r in records)]
        check = integration_check(root) if not unwritten else dict(
            passed=False, acc=None, message=f"not run: it needs every exercise but the optional "
                                            f"ones, and {len(unwritten)} still raise: "
                                            f"{', '.join(unwritten)}")
    seconds = time.time() - t0
    report = as_json(results, check, seconds)
    print_table(results, check, report, log)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"the grade, for an autograder: {json_path} (Gradescope's results.json format)")
    return report


def exercise_score(exercise: Exercise, passed: int, total: int, failures) -> float:
    """Half the points if every test of the exercise's idea passes (all its cases), half in
    proportion to all its tests that pass: a solution that misses the idea (Eq. 10's two bounds,
    Eq. 12's denominator, ...) cannot score above half, whatever else it gets right."""
    idea_failed = any(test.split("::")[-1].split("[")[0] in exercise.idea
                      for test, _ in failures)
    return exercise.points * (0.5 * (not idea_failed) + 0.5 * passed / total)


def why_missing(test, records) -> str:
    errors = [r["message"] for r in records if r.get("outcome") == "error" and
              test.startswith(r["nodeid"])]
    return f"not run: {errors[0]}" if errors else "not run (the test run stopped first)"


def integration_check(root: str, timeout: float = 600) -> dict:
    """The demo trained for a few steps with the code in root (dapo.py in a fresh process)
    -> {passed, acc, message}. The base model is warmed up with this code too, and cached under
    runs/grade/ by the content of model.py, the only exercise file the warm-up runs: a cache
    left by earlier code is never reused."""
    with open(os.path.join(root, "model.py"), "rb") as f:
        key = f"{zlib.crc32(f.read()):08x}"
    work = os.path.join(root, "runs", "grade", "base-" + key)
    if os.path.isdir(os.path.dirname(work)):
        for old in os.listdir(os.path.dirname(work)):
            if old.startswith("base-") and old != os.path.basename(work):
                shutil.rmtree(os.path.join(os.path.dirname(work), old))
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory() as out_dir:
        # run in `work`: dapo.py caches the demo's base model under ./runs/demo-base
        cmd = [sys.executable, os.path.join(root, "dapo.py"), "--out-dir", out_dir,
               "--overwrite", *INTEGRATION_ARGS]
        try:
            proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return dict(passed=False, acc=None, message=f"did not finish in {timeout:.0f} s")
        evals = []
        if os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
            with open(os.path.join(out_dir, "metrics.jsonl")) as f:
                evals = [row["val/acc"] for row in map(json.loads, f) if "val/acc" in row]
    if proc.returncode != 0 or len(evals) < 2:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return dict(passed=False, acc=None, message="the run failed: " +
                    (lines[-1] if lines else f"exit code {proc.returncode}"))
    acc = evals[-1]
    return dict(passed=acc >= INTEGRATION_MIN_ACC, acc=acc,
                message=f"val/acc {evals[0]:.3f} -> {acc:.3f} after {INTEGRATION_ARGS[1]} steps "
                        f"(needs >= {INTEGRATION_MIN_ACC})")


def as_json(results, check, seconds) -> dict:
    """Gradescope's results.json: one entry per exercise (and the integration check). An
    optional exercise's entry is tagged "optional": its points count in score (the bonus: a score
    above the maximum is extra credit) and not in max_score, which is 100 when all are graded."""
    tests = [{"name": r["id"], "score": r["score"], "max_score": r["max_score"],
              "status": "passed" if r["passed"] == r["total"] else "failed",
              "tests_passed": r["passed"], "tests_total": r["total"],
              "output": "\n".join(f"{t}: {m}" for t, m in r["failures"]),
              **({"tags": ["optional"]} if r["optional"] else {})} for r in results]
    if check is not None:
        tests.append({"name": "integration", "score": INTEGRATION_POINTS if check["passed"] else 0,
                      "max_score": INTEGRATION_POINTS,
                      "status": "passed" if check["passed"] else "failed",
                      "output": check["message"]})
    return {"score": round(sum(t["score"] for t in tests), 2),
            "max_score": sum(t["max_score"] for t in tests if "tags" not in t),
            "execution_time": round(seconds), "tests": tests}


def clip(line, width=100):
    return line if len(line) <= width else line[:width - 3] + "..."


def print_table(results, check, report, log):
    """One row per exercise; under a row, its first failure unless every failure is its own
    unwritten body. The total out of 100, then the optional exercises and their bonus."""
    print(f"{'exercise':<18} {'file':<21} {'tests':>7} {'points':>12}")
    required = [r for r in results if not r["optional"]]
    bonus = [r for r in results if r["optional"]]
    for r in required:
        print_row(r)
    points = 0
    if check is not None:
        points = INTEGRATION_POINTS if check["passed"] else 0
        print(f"{'integration':<18} {'dapo.py (demo run)':<21} {'':>7} "
              f"{points:>6.1f} / {INTEGRATION_POINTS:<3}")
        print(clip(f"    {check['message']}"))
    if required or check is not None:
        score = sum(r["score"] for r in required) + points
        print(f"{'total':<48} {score:>6.1f} / {report['max_score']}")
    if bonus:
        print("optional: bonus points, on top of the 100")
        for r in bonus:
            print_row(r)
        print(f"{'bonus':<48} {sum(r['score'] for r in bonus):>6.1f} / "
              f"{sum(r['max_score'] for r in bonus)}")
    print(f"pytest's output: {log}")


def print_row(r):
    """An exercise's row of the table, and its first failure unless it is not written."""
    unwritten = r["failures"] and all(m.startswith(f"{NOT_DONE}: {r['id']}:")
                                      for _, m in r["failures"])
    print(f"{r['id']:<18} {r['file']:<21} {r['passed']:>3}/{r['total']:<3} "
          f"{r['score']:>6.1f} / {r['max_score']:<3}" + ("  not written" if unwritten else ""))
    if r["failures"] and not unwritten:
        test, message = r["failures"][0]
        more = f" (+{len(r['failures']) - 1} more)" if len(r["failures"]) > 1 else ""
        print(clip(f"    {test.split('::')[-1]}{more}"))
        print(clip(f"    {message}"))


# ------------------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the exercises: id, file, function, points, difficulty")
    p = sub.add_parser("handout", help="write the student copy into OUT")
    p.add_argument("out", metavar="OUT")
    p = sub.add_parser("check", help="run some exercises' tests with pytest (default: all)")
    p.add_argument("ids", nargs="*", metavar="ID")
    sub.add_parser("todo", help="one line naming the exercises that still raise (none: nothing)")
    p = sub.add_parser("grade", help="run each exercise's tests and the integration check")
    p.add_argument("ids", nargs="*", metavar="ID", help="only these exercises (default: all)")
    p.add_argument("--extra-tests", metavar="DIR",
                   help="private tests; each marked @pytest.mark.grades(<exercise id>)")
    p.add_argument("--json", metavar="FILE", help="default: runs/grade.json")
    p.add_argument("--no-integration", action="store_true", help="skip the demo run")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the tests (%(default)s)")
    args = parser.parse_args(argv)
    try:
        run(args, parser)
    except ValueError as e:  # a refused handout directory, a marker or an extra test: no traceback
        sys.exit(f"assign.py {args.command}: {e}")


def run(args, parser):
    if args.command == "list":
        files = source_files(ROOT)
        regions = marked_regions(ROOT, files)
        print(f"{'exercise':<18} {'where':<40} {'points':>6}  difficulty  paper")
        for e in EXERCISES:
            where = f"{e.file} {', '.join(n + '()' for n in functions(ROOT, e, regions))}"
            shown = f"+{e.points}" if e.optional else e.points
            print(f"{e.id:<18} {where:<40} {shown:>6}  {e.difficulty:<10}  {e.paper}")
            if e is REQUIRED[-1]:  # the optional ones come last (test_assign checks it)
                print(f"{'integration':<18} "
                      f"{'dapo.py (the demo, ' + INTEGRATION_ARGS[1] + ' steps)':<40} "
                      f"{INTEGRATION_POINTS:>6}")
                if OPTIONAL:
                    print("optional: bonus points, on top of the 100")
        return
    if args.command == "handout":
        files = write_handout(args.out)
        print(f"wrote {args.out}: {len(files)} files, {len(REQUIRED)} exercises and "
              f"{len(OPTIONAL)} optional ones (EXERCISES.md); the tests of an unfinished "
              "exercise fail naming it")
        return
    if args.command == "todo":  # for the student copy's Makefile (make run)
        left = todo()
        if left:
            print(f"make run needs every exercise but the optional ones, and {len(left)} are "
                  f"not written yet: "
                  f"{', '.join(left)} (EXERCISES.md; make check EX=<id> tests one)")
        return
    unknown = [i for i in args.ids if i not in BY_ID]
    if unknown:
        parser.error(f"unknown exercise {', '.join(unknown)}; known: {', '.join(BY_ID)}")
    if args.command == "check":
        sys.exit(check(args.ids))
    else:
        grade(args.ids, args.extra_tests, args.json, not args.no_integration,
              timeout=args.timeout)


if __name__ == "__main__":
    main()
