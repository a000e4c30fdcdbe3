"""bf16, the precision of every GPU run, on CPU: torch's CPU autocast runs the machinery CUDA's
does (infra/precision.py). The rollout runs, the weights that a rollout reads after an optimizer
step are the weights after it (the learning canary, checks/canary.py), and bf16 stays within
bf16's rounding of fp32, in one process and on two FSDP2 ranks with a bf16 MixedPrecisionPolicy.

Tolerances are in bf16's unit round-off u = 2^-8 (8 significant bits: a rounding is off by at
most u of the value)."""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import dapo
import sampler
from batches import random_batch
from config import Config, parse_args
from dapo_kernels.linear import accumulate_weight_grad, has_mixed_addmm
from infra import cpu, precision
from model import Transformer, preset
from logprobs import response_logprobs
from test_dapo import _cfg
from two_ranks import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
U = precision.BF16_UNIT_ROUNDOFF
BF16 = torch.autocast("cpu", torch.bfloat16)


@pytest.mark.needs("rope", "attention", "kv_cache", "sample", "filter_logits")
def test_a_bf16_rollout_runs_and_caches_keys_in_bf16():
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=97))
    caches = []
    new_kv_cache = model.new_kv_cache
    model.new_kv_cache = lambda *a: caches.append(new_kv_cache(*a)) or caches[-1]
    with BF16:  # before: RoPE's fp32 tables made the keys fp32, and the bf16 cache refused them
        out = sampler.generate(model, [[1, 2, 3], [4, 5]], 6,
                               generator=torch.Generator().manual_seed(0))
    assert caches[0].k[0].dtype == torch.bfloat16 and out.response_mask.any()
    assert torch.isfinite(out.logprobs).all()


def test_an_optimizer_step_inside_autocast_is_refused():
    """Autocast keeps each weight's bf16 copy for the life of its outermost region: a step inside
    one would leave the region's later forwards on the weights from before the step."""
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with BF16, pytest.raises(RuntimeError, match="optimizer step inside an autocast region"):
        precision.gradient_is_finite(grad_norm)
    assert precision.gradient_is_finite(grad_norm)[1]  # outside: it may step


def test_precision_resolves_by_device_and_the_help_says_so(capsys):
    assert precision.resolve("auto", "cuda:0") == "bf16"
    assert precision.resolve("auto", "cpu") == "fp32"  # a model under 50M parameters: the demo
    assert precision.resolve("bf16", "cpu") == "bf16"
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "auto: bf16 on CUDA, and on a CPU where bf16 matmuls are faster" in help_text


SMOLLM2_PARAMS = 135_000_000


@pytest.mark.parametrize("speedup,chosen", [(6.0, "bf16"), (1.1, "fp32"), (0.12, "fp32")])
def test_auto_on_a_cpu_takes_bf16_only_where_the_probe_finds_it_faster(monkeypatch, speedup,
                                                                         chosen):
    """Native bf16 (AVX-512 BF16, AMX): bf16 matmuls 5-9x fp32's; AVX2 only: 8-40x slower."""
    monkeypatch.setattr(cpu, "bf16_speedup", lambda: speedup)
    choice = precision.choose("auto", "cpu", SMOLLM2_PARAMS)
    assert choice.precision == chosen and f"{speedup:.2g}x" in choice.why
    assert precision.choose("auto", "cpu", SMOLLM2_PARAMS, world=2).precision == "fp32"
    assert precision.choose("fp32", "cpu", SMOLLM2_PARAMS).precision == "fp32"  # --precision wins


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="ONEDNN_MAX_CPU_ISA=AVX2 is x86's")
def test_a_cpu_without_native_bf16_plans_in_fp32_and_says_why(tmp_path):
    """oneDNN limited to AVX2 (ONEDNN_MAX_CPU_ISA; MKL's fp32 likewise) is a laptop's CPU: bf16
    matmuls are emulated, several times slower than fp32. A model of SmolLM2's size or more is
    then planned in fp32, and the memory plan's first line says the probe's figure."""
    model_dir = tmp_path / "qwen2.5-0.5b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(preset("qwen2.5-0.5b").to_hf()))
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    out = subprocess.run([sys.executable, "dapo.py", "--plan", "--model", str(model_dir)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first_line = out.stdout.splitlines()[0]
    assert "1 process(es), fp32 (auto: bf16 matmuls 0." in first_line, first_line


@pytest.mark.needs("logprobs_forward", "rope", "attention")
@pytest.mark.parametrize("fused_head", [True, False])
def test_bf16_log_probs_are_fp32_ones_within_bf16_rounding(fused_head):
    """The tiny random model's logits are small (|z| < 1), so each is off by less than u after
    its rounding to bf16, and the log-prob (z_t - lse) by about that: allowed 2 u (0.0078 nats),
    measured 0.39-0.46 u at 3 seeds. A log-prob itself rounded to bf16 (near -6, spacing 2^-5)
    would be off by up to 4 u."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=300))
    batch = random_batch(300, n=8)
    fp32, _ = response_logprobs(model, batch, 1.0, fused_head)
    with BF16:
        bf16, _ = response_logprobs(model, batch, 1.0, fused_head)
    err = ((bf16 - fp32).abs() * batch.response_mask).max().item()
    assert bf16.dtype == torch.float32 and 0 < err <= 2 * U, err / U


@pytest.mark.needs("all")
def test_a_bf16_update_is_the_fp32_one_within_bf16_rounding():
    """update_policy's two SGD steps (lr 1: the weight change is the gradient) with
    --precision bf16 against fp32: relative error allowed 4 u (a gradient goes through the
    forward's and the backward's roundings of each layer, most of which average out over the
    weights), measured 1.4-1.55 u at 3 seeds."""
    torch.manual_seed(0)
    base = Transformer(preset("tiny", vocab_size=300))
    batch = random_batch(300, n=8)
    moves = {}
    for name in ("fp32", "bf16"):
        model = Transformer(preset("tiny", vocab_size=300))
        model.load_state_dict(base.state_dict())
        cfg = Config(group_size=4, mini_batch_prompts=2, micro_batch_tokens=0, grad_clip=1e9,
                     precision=name)
        dapo.update_policy(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, cfg)
        moves[name] = torch.cat([(p - q).flatten() for p, q in
                                 zip(model.parameters(), base.parameters())]).detach()
    err = ((moves["bf16"] - moves["fp32"]).norm() / moves["fp32"].norm()).item()
    assert 0 < err <= 4 * U, err / U


def test_a_bf16_weight_gradient_sums_its_chunks_in_fp32():
    """The fused head's weight gradient: bf16 products summed into an fp32 buffer, on CPU by
    upcasting each chunk (torch 2.13 has no bf16 x bf16 -> fp32 addmm there; on CUDA, when it has
    one, the GPU check runs it). Either way the products are exact in fp32: the sum equals the
    fp32 matmul of the bf16 values to fp32 round-off."""
    g = torch.Generator().manual_seed(0)
    grad_logits = torch.randn(7, 50, generator=g).bfloat16()
    hidden = torch.randn(7, 16, generator=g).bfloat16()
    grad_weight = torch.zeros(50, 16)
    for rows in (slice(0, 4), slice(4, 7)):  # two chunks
        accumulate_weight_grad(grad_weight, grad_logits[rows], hidden[rows])
    want = grad_logits.double().T @ hidden.double()
    # probed, not crashed (whether CPU torch has the mixed addmm is torch's business, not ours)
    assert isinstance(has_mixed_addmm(torch.device("cpu")), bool)
    assert (grad_weight.double() - want).abs().max() <= 8 * torch.finfo(torch.float32).eps * \
        want.abs().max()


REWARD = "def score(response, ground_truth):\n    return 1.0 if len(response) % 2 else -1.0\n"


def _bf16_flags(model_dir, out_dir, reward_file):
    """A few demo-sized steps with real advantages: the random model's responses scored by the
    parity of their length (so groups are mixed), dynamic sampling on."""
    return ["--model", model_dir, "--out-dir", str(out_dir), "--precision", "bf16",
            "--steps", "2", "--train-prompts", "4", "--gen-prompts", "4", "--group-size", "4",
            "--mini-batch-prompts", "2", "--max-response-len", "12", "--overlong-buffer", "4",
            "--eval-every", "0", "--lr", "1e-3", "--reward-fn", f"{reward_file}:score",
            "--reward-fn-all-rows", "--rollout-slots", "8"]


def _trained(out_dir) -> list[dict]:
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))][1:]
    assert len(rows) == 2 and all(r["train/updates"] > 0 and r["actor/grad_norm"] > 0
                                  for r in rows), rows
    # the sampler and the trainer, both bf16: within bf16 rounding of each other per token
    assert all(r["training/rollout_logp_diff_max"] < 16 * U for r in rows), rows
    return rows


def _spy_on_autocast(monkeypatch) -> list[bool]:
    """Whether CPU autocast was on, for each forward of the model from now on."""
    seen, forward = [], Transformer.forward

    def spy(self, *args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    return seen


@pytest.mark.needs("all")
def test_the_loop_trains_in_bf16_in_one_process(tiny_model_dir, tmp_path, monkeypatch):
    reward_file = tmp_path / "parity.py"
    reward_file.write_text(REWARD)
    before = Transformer.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    in_autocast = _spy_on_autocast(monkeypatch)
    dapo.main(parse_args(_bf16_flags(tiny_model_dir, tmp_path / "run", reward_file)))
    assert in_autocast and all(in_autocast)  # every forward; the steps outside (the guard)
    _trained(tmp_path / "run")
    saved = tmp_path / "run" / "checkpoints" / "step_000002" / "model"
    after = Transformer.from_pretrained(str(saved), dtype=torch.float32).state_dict()
    assert all(after[k].dtype == torch.float32 for k in after)  # fp32 master weights
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.needs("all")
def test_the_loop_trains_in_bf16_on_two_fsdp_ranks(tiny_model_dir, tmp_path):
    reward_file = tmp_path / "parity.py"
    reward_file.write_text(REWARD)
    torchrun("dapo.py", *_bf16_flags(tiny_model_dir, tmp_path / "run", reward_file))
    _trained(tmp_path / "run")


@pytest.mark.needs("all")
def test_the_learning_canary_sees_the_step_in_bf16_on_two_fsdp_ranks(tmp_path):
    """After one update with a planted advantage, the bf16 sampler's log-probs move as the
    trainer's do (checks/canary.py: it fails on a rollout that reads weights from before the
    step, as an autocast region around the whole run makes it). In one process: the canary part
    of tests/test_gpu_check.py, the same command."""
    out = torchrun("-m", "checks.canary", "--precision", "bf16", "--dir", str(tmp_path)).stdout
    assert out.count(": ok") == 1, out


@pytest.mark.needs("all")
def test_the_fp32_loop_enters_no_autocast(tiny_model_dir, tmp_path, monkeypatch):
    """--precision auto on CPU, for a model under 50M parameters, is fp32: every forward out of
    autocast, the path it always was."""
    in_autocast = _spy_on_autocast(monkeypatch)
    dapo.main(replace(_cfg(tiny_model_dir, tmp_path, steps=1, eval_every=0,
                           dynamic_sampling=False), precision="auto"))
    assert in_autocast and not any(in_autocast)
