"""The memory plan (infra/memory.py): its parts against what the model really holds on CPU (the
parameters, the optimizer's state, the KV cache, and what autograd keeps for the backward, counted
with saved_tensors_hooks), its figures for the Qwen2.5 shapes from a config.json alone, and a
configuration that cannot fit refused before anything loads."""
import contextlib
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from config import Config
from infra import memory, precision
from model import ModelConfig, Transformer, num_params, preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {  # small shapes with every dimension distinct, so a wrong coefficient shows
    "a": dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "b": dict(vocab_size=131, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=1, head_dim=24),
}


def small(name, **kw) -> ModelConfig:
    return ModelConfig(**{**SHAPES[name], "max_position_embeddings": 4096,
                          "tie_word_embeddings": False, **kw})


@pytest.mark.parametrize("family", ["qwen2", "llama", "llama-bias", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("name", list(SHAPES))
def test_parameter_count_is_the_models(name, tied, family):
    m = small(name, tie_word_embeddings=tied, model_type=family.removesuffix("-bias"),
              attention_bias=family.endswith("-bias"))
    assert memory.parameter_count(m) == num_params(Transformer(m))


def saved_for_backward(model, ids, context) -> int:
    """Bytes of the distinct tensors autograd keeps from a training forward, the parameters left
    out (they are counted as weights)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        model(ids, head=lambda hidden, weight: hidden.sum())
    return sum(kept.values())


@pytest.mark.needs("rope", "attention")
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16"])
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # a Llama keeps what a Qwen2 keeps
def test_activations_are_what_autograd_keeps(name, mode, checkpointing, family):
    """The plan's activation bytes per token against the count (within 10%: measured exact on
    these shapes, except the checkpointed forward, whose one block kept whole is recomputed in the
    backward, not held by the forward: the plan counts it, the forward's count does not)."""
    m = small(name, model_type=family)
    torch.manual_seed(0)
    model = Transformer(m).train()
    model.activation_checkpointing = checkpointing
    if mode == "bf16":  # FSDP2's mixed precision: bf16 weights and compute
        model = model.bfloat16()
    context = torch.autocast("cpu", torch.bfloat16) if mode == "autocast" else \
        contextlib.nullcontext()
    per_token = memory.activation_bytes_per_token(m, mode, checkpointing)
    counts = [saved_for_backward(model, torch.randint(0, m.vocab_size, (2, n)), context)
              for n in (50, 150)]
    measured = (counts[1] - counts[0]) / 200  # per token: what grows with the tokens
    if checkpointing:  # the forward holds the inputs only; the plan adds one block's activations
        measured += memory.activation_bytes_per_token(replace(m, num_hidden_layers=1), mode,
                                                      False) - \
            memory.activation_bytes_per_token(replace(m, num_hidden_layers=0), mode, False)
    assert abs(per_token - measured) <= 0.1 * measured, (per_token, measured)


@pytest.mark.needs("rope", "attention")  # a forward, for the gradients
@pytest.mark.parametrize("precision,dtype_bytes", [("fp32", 4), ("bf16", 2)])
def test_the_kv_cache_and_the_optimizer_state_are_what_gets_allocated(precision, dtype_bytes):
    m = small("a")
    cfg = Config(precision=precision, rollout_slots=5, max_prompt_len=20,
                 max_response_len=11)
    plan = memory.plan(m, cfg, world=1)
    model = Transformer(m)
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        cache = model.new_kv_cache(5, 31)
    assert plan.kv_cache == sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 97, (1, 4))).sum().backward()
    opt.step()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if t.dim() > 0)
    assert plan.shards == held  # weights and AdamW's two moments, fp32
    assert plan.grads == sum(p.grad.numel() * p.grad.element_size()
                             for p in model.parameters())


@pytest.mark.parametrize("trainer,sampler", [("fp32", "bf16"), ("bf16", "fp32")])
def test_the_rollout_is_planned_in_the_samplers_precision(trainer, sampler):
    """--rollout-precision: the KV cache is what the sampler's autocast allocates, and the
    rollout's parts those of a --precision {sampler} run (bf16: autocast's copy of each weight;
    fp32: none, and 4 bytes a value); the update stays the trainer's."""
    m = small("a")
    cfg = Config(precision=trainer, rollout_precision=sampler, rollout_slots=5, max_prompt_len=20,
                 max_response_len=11)
    plan = memory.plan(m, cfg, world=1)
    with precision.autocast(cfg.sampler_precision, cfg.device):
        cache = Transformer(m).new_kv_cache(5, 31)
    assert plan.kv_cache == sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    as_sampler = memory.plan(m, replace(cfg, precision=sampler, rollout_precision="same"), 1)
    assert plan.rollout - plan.shards == as_sampler.rollout - as_sampler.shards
    assert plan.gathered_rollout == (memory.parameter_count(m) * 2 if sampler == "bf16" else 0)
    as_trainer = memory.plan(m, replace(cfg, rollout_precision="same"), 1)
    assert plan.update == as_trainer.update

def write_config(directory, name) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(preset(name).to_hf(), f)
    return str(directory)


def dapo_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "dapo.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name,parameters", [("qwen2.5-0.5b", "494M"), ("qwen2.5-7b", "7.62B"),
                                             ("qwen2.5-32b", "32.8B")])
def test_plan_prints_from_a_config_json_alone(tmp_path, name, parameters):
    """No weights, no tokenizer: --plan reads config.json and exits 0."""
    model_dir = write_config(tmp_path / name, name)
    out = dapo_cli("--plan", "8", "--precision", "bf16", "--model", model_dir,
                   "--max-prompt-len", "2048", "--max-response-len", "20480",
                   "--overlong-buffer", "4096",
                   "--rollout-slots", "8", "--micro-batch-tokens", "22528")
    assert out.returncode == 0, out.stderr
    assert f"({parameters} parameters, 8 process(es), bf16" in out.stdout, out.stdout
    assert "KV cache" in out.stdout and "activations" in out.stdout and "peak" in out.stdout


def test_a_bare_plan_plans_this_launch(tmp_path):
    """--plan without N: this launch's processes (1 without torchrun) on this device. Before, the
    flag's marker value -1 was taken for the count: "-1 process(es)" and negative shards."""
    model_dir = write_config(tmp_path / "0.5b", "qwen2.5-0.5b")
    out = dapo_cli("--plan", "--model", model_dir, "--precision", "fp32")
    assert out.returncode == 0, out.stderr
    assert "(494M parameters, 1 process(es), fp32" in out.stdout and " -" not in out.stdout


def test_a_run_that_cannot_fit_stops_before_loading(tmp_path):
    """A 32B shape with 4096 slots on this machine's RAM: refused naming the numbers, before the
    (absent) weights are looked for."""
    model_dir = write_config(tmp_path / "32b", "qwen2.5-32b")
    out = dapo_cli("--model", model_dir, "--out-dir", str(tmp_path / "run"),
                   "--rollout-slots", "4096", "--max-response-len", "4096",
                   "--overlong-buffer", "1024")
    assert out.returncode != 0
    assert "the memory plan needs" in out.stderr and "--rollout-slots" in out.stderr
    assert "safetensors" not in out.stderr  # it never got to the weights


def test_auto_slots_fill_what_is_left_and_no_more_than_a_rank_decodes():
    m = preset("qwen2.5-7b")
    # activation checkpointing (the paper's): a 10,240-token sequence's activations without it
    # are 60 GiB, which leave no room on 80 GB
    cfg = Config(precision="bf16", rollout_slots="auto", max_prompt_len=2048,
                 max_response_len=8192, gen_prompts=1536, group_size=16,
                 activation_checkpointing=True)
    big = memory.plan(m, cfg, world=8, capacity=80 * memory.GB)
    assert 1 <= big.slots <= memory.max_slots(cfg, 8) and big.fits
    more = memory.plan(m, cfg, world=8, capacity=141 * memory.GB)
    assert more.slots > big.slots
    assert not memory.plan(m, cfg, world=8, capacity=80 * memory.GB, slots=big.slots * 4).fits


def test_an_eval_only_plan_holds_the_weights_and_nothing_of_training():
    """--eval-only builds no optimizer and takes no update: the weights in fp32 (what the model's
    parameters take), no AdamW moments, no gradients, no update phase. A 7B evaluation then fits
    one 80 GB card (before: planned as a training run, 137.8 GiB, refused)."""
    m = small("a")
    plan = memory.plan(m, Config(eval_only=True, precision="fp32", rollout_slots=5), world=1)
    assert plan.shards == sum(p.numel() * p.element_size() for p in Transformer(m).parameters())
    assert plan.grads == plan.gathered_update == plan.activations == plan.head == 0
    assert plan.peak == plan.rollout + int(memory.OVERHEAD_GB * memory.GB)
    cfg = Config(eval_only=True, precision="bf16", rollout_slots="auto", max_prompt_len=2048,
                 max_response_len=20480)
    seven = memory.plan(preset("qwen2.5-7b"), cfg, world=1, capacity=80 * memory.GB)
    assert seven.fits and seven.slots >= 1, seven.describe("80 GB")


def test_eval_only_decodes_the_evaluation_whatever_eval_every():
    """The KV cache's most slots: the evaluation's (--eval-prompts x --eval-samples per rank)
    under --eval-only, even with --eval-every 0, never a generation batch's."""
    cfg = Config(eval_only=True, eval_every=0, eval_prompts=30, eval_samples=32, gen_prompts=1536,
                 group_size=16)
    assert memory.max_slots(cfg, 2) == memory.max_slots(replace(cfg, eval_every=5), 2) == 480
    training = replace(cfg, eval_only=False, eval_every=5)
    assert memory.max_slots(training, 2) == 1536 * 16 // 2
    assert memory.max_slots(replace(training, gen_prompts=2), 2) == 480
    assert memory.max_slots(replace(training, gen_prompts=2, eval_every=0), 2) == 2 * 16 // 2


def test_slots_beyond_the_sequences_decoded_are_planned_as_the_sequences():
    """The sampler allocates min(--rollout-slots, the sequences of a call): before, a billion
    slots for 8 sequences were planned, and refused as needing 71,266 GiB."""
    cfg = Config(precision="fp32", rollout_slots=10**9, train_prompts=2, gen_prompts=2,
                 mini_batch_prompts=2, group_size=4, eval_every=0)
    plan = memory.plan(small("a"), cfg, world=1, capacity=16 * memory.GB)
    assert plan.slots == 8 and plan.fits
    memory.refuse_if_too_big(plan, "cpu")
    # an evaluation of every held-out row: how many is unknown before the data loads
    every_row = replace(cfg, eval_every=5, eval_prompts=0)
    assert memory.plan(small("a"), every_row, world=1).slots == 10**9


def test_a_sequence_longer_than_micro_batch_tokens_is_planned_as_its_own_micro_batch():
    """Batch.micro_batches puts a sequence longer than --micro-batch-tokens alone in a
    micro-batch: the plan counts the larger of the two (before: 7B at 22,528 positions with
    --micro-batch-tokens 1024 was planned at 11.3 GiB of activations, and needs ~248)."""
    from batches import random_batch
    batch = random_batch(97, n=8)
    longest = int((batch.prompt_mask.sum(-1) + batch.response_lengths).max())
    widest = max(len(rows) * int(batch.prompt_mask[rows].sum(-1).max()
                                 + batch.response_lengths[rows].max())
                 for rows in batch.micro_batch_rows(64, max_tokens=4))
    assert widest == longest > 4  # the longest sequence alone, past the 4 tokens asked for
    cfg = Config(precision="fp32", max_prompt_len=batch.prompt_ids.shape[1],
                 max_response_len=batch.response_ids.shape[1], micro_batch_tokens=4)
    assert memory.plan(small("a"), cfg, world=1).micro_tokens >= widest
    paper = Config(precision="bf16", max_prompt_len=2048, max_response_len=20480)
    seven = [memory.plan(preset("qwen2.5-7b"), replace(paper, micro_batch_tokens=t), world=8)
             for t in (1024, 22528)]
    assert seven[0].micro_tokens == 22528 and seven[0].activations == seven[1].activations
