"""--rollout-engine vllm where vLLM is not installed (this venv): its memory plan, the one-line
error that says what to install, and launch.VLLMRollout with a stand-in for vLLM (its flags are
checked in test_config.py). The engine itself is tested in tests_vllm/ (`make test-vllm`, in
.venv-vllm)."""
import importlib.util
import os
import subprocess
import sys

import pytest

from config import Config
from infra import memory
from model import preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_memory_plan_counts_the_engine_in_place_of_the_samplers_parts():
    m = preset("qwen2.5-1.5b")
    gpu = 80 * memory.GB
    cfg = Config(rollout_engine="vllm", device="cpu", precision="bf16",
                 vllm_gpu_memory_utilization=0.4, rollout_slots=64)
    plan = memory.plan(m, cfg, world=1, capacity=gpu)
    assert plan.engine == int(0.4 * gpu)
    assert plan.kv_cache == plan.sampling == plan.prefill == plan.gathered_rollout == 0
    assert plan.rollout == plan.shards + plan.engine
    assert plan.update - plan.engine_in_update == \
        memory.plan(m, Config(device="cpu", precision="bf16"), world=1, capacity=gpu).update
    assert plan.engine_in_update == plan.engine  # CPU: no sleep mode, the engine stays
    # on a GPU it sleeps through the update (the device is not checked by plan())
    cuda = memory.plan(m, Config(**{**cfg.__dict__, "device": "cuda"}), world=1, capacity=gpu)
    assert cuda.engine_in_update == 0


def test_a_share_smaller_than_the_engines_weights_is_refused():
    m = preset("qwen2.5-7b")  # 7.6B parameters: 15 GB in bf16
    cfg = Config(rollout_engine="vllm", precision="bf16", vllm_gpu_memory_utilization=0.1)
    plan = memory.plan(m, cfg, world=8, capacity=80 * memory.GB)
    with pytest.raises(ValueError, match="less than the model's weights"):
        memory.refuse_if_too_big(plan, "cuda:0")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_run_stops_in_one_line_saying_what_to_install(tmp_path):
    out = subprocess.run([sys.executable, "dapo.py", "--rollout-engine", "vllm", "--steps", "1",
                          "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --rollout-engine vllm needs vLLM, which this Python does not have: pip install -r "
        "requirements-vllm.txt on a CPU (make test-vllm makes .venv-vllm), pip install vllm on a "
        "GPU (No module named 'vllm')"]
    assert not os.listdir(tmp_path)  # stopped before anything was written


def test_the_engine_turns_vllms_token_lists_into_the_samplers_rollout_and_syncs_after_an_update():
    # launch.VLLMRollout, without vLLM: what dapo.rollout() and the loop call
    from infra.vllm_engine import Responses
    from launch import VLLMRollout
    calls = []

    class StandIn:  # what infra/vllm_engine.VLLMEngine answers
        def generate(self, model, prompts, max_new_tokens, **settings):
            calls.append(("generate", prompts, max_new_tokens, settings["temperature"]))
            return Responses(token_ids=[[5, 6, 2], [7]], logprobs=[[-0.5, -1.0, -0.25], [-2.0]],
                             truncated=[False, True])

        def sleep(self):
            calls.append("sleep")

        def sync(self, model):
            calls.append("sync")

    engine = VLLMRollout(Config(max_response_len=3, device="cpu"), StandIn(), pad_token_id=0)
    got = engine.generate("policy", [[1, 2], [3]], temperature=0.7, top_p=1.0, top_k=0,
                          eos_token_ids=[2], generator=None)
    assert got.prompt_ids.tolist() == [[1, 2], [0, 3]]  # left-padded
    assert got.prompt_mask.tolist() == [[True, True], [False, True]]
    assert got.response_ids.tolist() == [[5, 6, 2], [7, 0, 0]]  # right-padded
    assert got.response_mask.tolist() == [[True, True, True], [True, False, False]]
    assert got.logprobs.tolist() == [[-0.5, -1.0, -0.25], [-2.0, 0.0, 0.0]]
    assert got.lengths.tolist() == [3, 1] and got.truncated.tolist() == [False, True]
    with engine.updating("policy"):
        calls.append("update")
    assert calls == [("generate", [[1, 2], [3]], 3, 0.7), "sleep", "update", "sync"]
