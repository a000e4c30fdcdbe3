"""
vLLM as the rollout engine (`--rollout-engine vllm`): the one file that knows vLLM.

The sampler (sampler.py) is the one to read; vLLM is the engine to run a real 7B or 32B model on,
as verl, TRL and OpenRLHF do: a paged KV cache (no slots x the full length reserved), its own
kernels, tensor parallelism. Each process owns one engine beside its trainer ("colocated"), in
the same process (VLLM_ENABLE_V1_MULTIPROCESSING=0), with tensor parallel size 1, and samples its
own share of the prompts, as the sampler does.

    VLLMEngine(cfg, model)            the engine, built from the policy's config.json alone with
                                      dummy weights; the policy's weights come next, by sync
    engine.sync(model)                the policy's weights into the engine, one parameter at a
                                      time (under FSDP2 each gathered alone, then dropped): after
                                      the set-up and after every optimizer step
    engine.generate(...)              the sampler's generate(), answered by vLLM: each response's
                                      tokens and the log-prob of each, as the sampler records them
    with updating(engine, model):     around the update: on a GPU the engine sleeps (its memory
                                      the trainer's), then takes the new weights

The weight version: each parameter's in-place version counter (what autograd uses to catch a
tensor changed after it was saved) moves with every optimizer step. The engine keeps the counters
it was synced at, and generate() refuses to sample from weights that are not the policy's.

Log-probs: the sampler records log_softmax(logits / T) of the drawn token, before top-k/top-p
truncation. vLLM's `processed_logprobs` are after temperature and after truncation (renormalised
over the tokens kept), its `raw_logprobs` before both: the first is the sampler's without
truncation, the second at T = 1, and neither with both (config.py refuses that).

Tensor parallelism across the ranks (a 32B engine over 8 GPUs) would take vLLM's
`external_launcher` executor, where the torchrun ranks of a TP group are the engine's workers, and
the sync feeding each its shard: not done here (one engine per rank holds the whole model).
"""
import contextlib
import json
import os
import tempfile
from dataclasses import dataclass

import torch

from infra.errors import UserError

# on a GPU the engine sleeps through the update: its KV cache freed, its weights dropped (level 2,
# the sync overwrites them anyway), so that the trainer has the memory back
SLEEP_LEVEL = 2
INSTALL = ("--rollout-engine vllm needs vLLM, which this Python does not have: pip install -r "
           "requirements-vllm.txt on a CPU (make test-vllm makes .venv-vllm), pip install vllm on "
           "a GPU")


@dataclass
class Responses:
    """What the engine sampled, row i answering prompts[i]."""
    token_ids: list[list[int]]  # each response's tokens, the EOS included
    logprobs: list[list[float]]  # the log-prob of each of them, as the sampler records it
    truncated: list[bool]  # cut at max_new_tokens before any EOS


def import_vllm():
    """vLLM, imported only when asked for; a missing install is a one-line error."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury ours
    try:
        import vllm
    except ImportError as e:
        raise UserError(f"{INSTALL} ({e})") from None
    return vllm


def logprobs_mode(cfg) -> str:
    """The vLLM log-probs that are the sampler's for the training rollout's settings."""
    if cfg.top_p < 1 or cfg.top_k > 0:
        return "raw_logprobs"  # before truncation; at T = 1 (config.py) also before temperature
    return "processed_logprobs"  # after temperature, and no truncation to renormalise over


def policy_version(model) -> tuple[int, ...]:
    """Each parameter's in-place version counter: an optimizer step (or a load) moves them."""
    return tuple(p._version for p in model.parameters())


class VLLMEngine:
    def __init__(self, cfg, model):
        vllm = import_vllm()
        self.vllm, self.cuda = vllm, cfg.device.startswith("cuda")
        with tempfile.TemporaryDirectory() as model_dir:  # vLLM reads config.json as it starts
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(model.config.to_hf(), f)
            try:
                self.llm = vllm.LLM(
                    model=model_dir, skip_tokenizer_init=True, load_format="dummy",
                    dtype="bfloat16" if cfg.sampler_precision == "bf16" else "float32",
                    tensor_parallel_size=1, enforce_eager=not (self.cuda and cfg.compile),
                    gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                    max_model_len=cfg.max_prompt_len + cfg.max_response_len, seed=cfg.seed,
                    logprobs_mode=logprobs_mode(cfg), enable_sleep_mode=self.cuda,
                    # a prompt prefilled in chunks rewinds its request's seeded generator, which
                    # a CPU generator cannot ("CPU Generator does not use offset")
                    enable_chunked_prefill=self.cuda)
            except (ValueError, RuntimeError) as e:  # vLLM's: too little or too much memory
                raise UserError(
                    f"vLLM could not start with --vllm-gpu-memory-utilization "
                    f"{cfg.vllm_gpu_memory_utilization}: {_first_line(e)}") from None
        self.synced_at = None
        _engines.append(self)
        self.sync(model)

    def sync(self, model):
        """The policy's weights into the engine, parameter by parameter (a tied output layer is
        the embedding, one parameter). Under FSDP2 every rank gathers each parameter in turn
        (a collective), so every rank calls this at the same points."""
        if self.cuda:  # the weights' memory back first, the KV cache's after the copy
            self.llm.wake_up(tags=["weights"])

        def weights():  # a generator: vLLM copies each before the next is gathered
            tied = model.config.tie_word_embeddings
            for name, p in model.named_parameters():
                full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                yield name, full
                if tied and name == "model.embed_tokens.weight":  # vLLM's head is its own
                    yield "lm_head.weight", full

        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
        if self.cuda:
            self.llm.wake_up(tags=["kv_cache"])
        self.synced_at = policy_version(model)

    def sleep(self):
        """On a GPU: the engine's memory to the trainer until the next sync (CPU: a no-op)."""
        if self.cuda:
            self.llm.sleep(level=SLEEP_LEVEL)

    def generate(self, model, prompts: list[list[int]], max_new_tokens: int, *, temperature,
                 top_p, top_k, eos_token_ids, generator) -> Responses:
        """Sample one response to each prompt (a group's G copies are G requests: vLLM's prefix
        cache computes their prompt once). The seeds come from `generator`, so a resumed run
        draws what an uninterrupted one would."""
        if policy_version(model) != self.synced_at:
            raise RuntimeError("the vLLM engine's weights are not the policy's: the policy "
                               "changed after the last sync (call engine.sync(model) after "
                               "each optimizer step)")
        seed = int(torch.randint(2**31 - len(prompts), (), generator=generator,
                                 device=generator.device))
        params = [self.vllm.SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k or -1, max_tokens=max_new_tokens,
            logprobs=0, seed=seed + i, stop_token_ids=list(eos_token_ids), ignore_eos=False)
            for i in range(len(prompts))]
        requests = [{"prompt_token_ids": p} for p in prompts]
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        except Exception as e:  # the engine died (vLLM's EngineDeadError, or worse)
            raise RuntimeError(f"the vLLM engine failed during a rollout ({type(e).__name__}: "
                               f"{_first_line(e)}); --resume continues from the last "
                               "checkpoint") from e
        completions = [o.outputs[0] for o in outputs]
        return Responses(
            token_ids=[list(c.token_ids) for c in completions],
            logprobs=[[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
                      for c in completions],
            truncated=[c.finish_reason == "length" for c in completions])

    def close(self):
        """Stop the engine and free its memory, before the process group goes (vLLM's own
        teardown at exit would find it gone)."""
        if self in _engines:
            _engines.remove(self)
            self.llm.llm_engine.engine_core.shutdown()


_engines: list[VLLMEngine] = []  # the engines started in this process, for close_all()


def close_all():
    for engine in list(_engines):
        engine.close()


@contextlib.contextmanager
def updating(engine: VLLMEngine, model):
    """Around the policy update: the engine asleep on a GPU, then synced to the new weights."""
    engine.sleep()
    yield
    engine.sync(model)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]
