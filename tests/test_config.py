"""config.py: the flags (one dataclass, as argparse flags with the paper's values in their help),
check_flags' refusals, each naming the flag, and parse_args. What dapo.py does with a refused
flag (nothing loaded, one line on the command line) is in test_loop_guards.py."""
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from config import Config, check_flags, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN, INF = float("nan"), float("inf")


def test_help_lists_the_flags():
    out = subprocess.run([sys.executable, "dapo.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--eps-high", "--no-dynamic-sampling", "--loss-agg-mode", "--overlong-buffer",
                 "--resume", "--micro-batch-tokens", "--on-gen-cap", "--overwrite"):
        assert flag in out.stdout
    # a header before the flags: whose defaults they are, and how the paper's values are marked
    header = out.stdout.split("options:")[0]
    assert "Every default below runs the embedded CPU demo" in header
    assert "(paper: X) is the setting of the paper's run" in header
    assert "--device is cuda where torch sees a GPU, else cpu" in header


# Every flag that the paper's run sets (paper Sec. 4.1, or verl's recipe/dapo script)
PAPER_FLAGS = ["model", "train_data", "val_data", "steps", "train_prompts", "gen_prompts",
               "group_size", "max_gen_batches", "on_gen_cap", "max_prompt_len",
               "max_response_len", "overlong_buffer", "overlong_factor", "temperature", "top_p",
               "top_k", "mini_batch_prompts", "micro_batch_tokens", "lr", "weight_decay",
               "grad_clip", "warmup_steps", "eps_low", "eps_high", "dual_clip", "clip_higher",
               "dynamic_sampling", "loss_agg_mode", "overlong_shaping", "overlong_filtering",
               "eval_every", "eval_samples", "eval_temperature", "eval_top_p", "eval_prompts",
               "save_every", "activation_checkpointing"]


@pytest.mark.parametrize("name", PAPER_FLAGS)
def test_help_gives_the_papers_value(name):
    help_text = {f.name: f.metadata["help"] for f in fields(Config)}[name]
    assert "(paper: " in help_text, help_text


@pytest.mark.parametrize("overrides,message", [
    (dict(eps_high=NAN), "--eps-high must be a finite number, got nan"),  # trained on a NaN loss
    (dict(lr=NAN), "--lr must be a finite number, got nan"),
    (dict(weight_decay=INF), "--weight-decay must be a finite number, got inf"),
    (dict(eval_temperature=NAN), "--eval-temperature must be a finite number, got nan"),
    (dict(overlong_factor=NAN), "--overlong-factor must be a finite number, got nan"),
    (dict(overlong_factor=-1.0), "--overlong-factor must be >= 0, got -1.0"),  # a bonus
    (dict(dist_timeout=INF), "--dist-timeout must be a finite number, got inf"),
    (dict(dist_timeout=1e30), "--dist-timeout must be in (0, 1e+09] seconds, got 1e+30"),
    (dict(reward_timeout=NAN), "--reward-timeout must be a finite number or inf (no limit), "
                               "got nan"),
    (dict(temperature=-INF), "--temperature must be a finite number, got -inf"),
    (dict(plan=-7), "--plan must be a number of processes >= 1 (0: off), got -7"),
    (dict(out_dir=""), "--out-dir must name a directory, got ''"),  # a FileNotFoundError
])
def test_a_non_finite_or_out_of_range_number_is_one_line_naming_the_flag(overrides, message):
    # check_flags alone: before the fix, most of these ran (and trained the demo on a NaN)
    with pytest.raises(ValueError, match="bad flags") as e:
        check_flags(Config(**overrides))
    assert str(e.value) == f"bad flags: {message}"  # that line alone: no second one for a NaN


def test_the_correction_defaults_to_token_truncate_with_vllm_only():
    assert Config(rollout_engine="vllm").rollout_correction == "token_truncate"
    assert Config().rollout_correction == "none"  # the paper's loss, to the last bit
    assert Config(rollout_engine="vllm", rollout_correction="none").rollout_correction == "none"


@pytest.mark.parametrize("flags, says", [
    (dict(vllm_gpu_memory_utilization=0.0), "--vllm-gpu-memory-utilization must be in (0, 1]"),
    (dict(temperature=0.7, top_p=0.9), "--rollout-engine vllm takes --temperature 0.7 or"),
    (dict(temperature=0.7, top_k=20), "--rollout-engine vllm takes --temperature 0.7 or"),
])
def test_vllm_flags_it_cannot_honour_are_refused(flags, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace("]", r"\]")):
        check_flags(Config(rollout_engine="vllm", **flags))
    check_flags(Config(**flags))  # the sampler takes them


def test_bounds_that_would_weigh_an_agreeing_token_are_refused():
    for bad in (dict(rollout_is_max=0.9), dict(rollout_is_min=1.5), dict(rollout_is_min=-1.0)):
        with pytest.raises(ValueError, match="--rollout-is-m"):
            check_flags(Config(**bad))
    with pytest.raises(ValueError, match="--rollout-precision runs in one process only"):
        check_flags(Config(rollout_precision="bf16", train_prompts=32), world=2)


def test_report_to_takes_several_values():
    assert parse_args(["--report-to", "tensorboard", "wandb"]).report_to == ("tensorboard",
                                                                            "wandb")
    assert parse_args([]).report_to == ("jsonl",)
