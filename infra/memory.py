"""
The memory plan: what a run will hold per GPU (or in RAM on CPU), from the model's config.json and
the flags alone, before any weight is loaded. A configuration that cannot fit is refused then,
naming the numbers and the flag to change, instead of at the first rollout after minutes of
loading; `--rollout-slots auto` takes the KV-cache slots from what is left.

A run has two phases, and its peak is the larger:

    rollout   fp32 shards (weights, AdamW moments) + the gathered weights (bf16: the sampler's
              copy) + the KV cache (slots x positions x bytes per token) + sampling + a prefill;
              the weights, cache and prefill in the sampler's precision (--rollout-precision)
    update    fp32 shards with their gradients + the weights gathered for compute + one
              micro-batch's activations + the output layer's working memory

An --eval-only run builds no optimizer and takes no update: the rollout alone, its shards the fp32
weights.

With --rollout-engine vllm the engine's share (--vllm-gpu-memory-utilization of the device: its
weights, activations and paged KV cache) replaces the sampler's gathered weights, KV cache,
sampling and prefill. On a GPU it sleeps through the update (its memory freed); on CPU, where
vLLM has no sleep mode, it stays (and vLLM takes the share of the machine's total RAM).

The activations are what autograd keeps for the backward, per token and layer, counted on CPU
with torch.autograd.graph.saved_tensors_hooks for every op of a block of each family
(tests/test_memory.py checks the formulas against that count). Not counted: the CUDA context and
the allocator's fragmentation (OVERHEAD_GB and MARGIN below), a backward's transient gradients of
one block.
"""
import math
from dataclasses import dataclass, replace

import torch

from infra.errors import UserError

GB = 2**30
OVERHEAD_GB = 1.0  # the CUDA context, cuBLAS/NCCL workspaces, the allocator's cached blocks
MARGIN = 0.9  # plan to use at most this share of the device
SAMPLING_BYTES = 24  # per slot and vocabulary entry: logits, tempered, softmax, fp64 CDF, log-probs


def parameter_count(m) -> int:
    """Parameters of a ModelConfig's model, of any family (a tied head counted once)."""
    return root_parameter_count(m) + m.num_hidden_layers * block_parameter_count(m)


def root_parameter_count(m) -> int:
    """Parameters outside the blocks: the embeddings, the output layer unless tied to them, the
    final norm."""
    return m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2) + m.hidden_size


def block_parameter_count(m) -> int:
    """Parameters of one block: q, k, v and o with the family's biases (Qwen2: on q, k, v), the
    norms of q's and k's heads (Qwen3), the SwiGLU MLP, the two norms."""
    C, F, D = m.hidden_size, m.intermediate_size, m.head_dim  # F: the MLP's width
    q, kv = m.num_attention_heads * D, m.num_key_value_heads * D
    weights = C * q + 2 * C * kv + q * C + 3 * C * F + 2 * C
    biases = (q + 2 * kv if m.qkv_bias else 0) + (C if m.o_bias else 0)
    return weights + biases + (2 * D if m.qk_norm else 0)


def dtype_bytes(precision: str) -> int:
    """Bytes of a tensor element computed in a resolved precision: bf16 2, fp32 4."""
    return 2 if precision == "bf16" else 4


def kv_bytes_per_token(m, dtype_bytes: int) -> int:
    """Keys and values of every layer for one position."""
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * dtype_bytes


def activation_bytes_per_token(m, mode: str, checkpointing: bool) -> float:
    """What autograd keeps for the backward, per token of a training forward (all layers), by
    compute mode: "fp32"; "autocast" (one process, bf16 matmuls, an fp32 residual stream);
    "bf16" (FSDP2's bf16 weights: everything bf16 but the norms' statistics). Counted op by op on
    CPU; with checkpointing, each block keeps its input and one block at a time its full set."""
    C, F, D = m.hidden_size, m.intermediate_size, m.head_dim  # F: the MLP's width
    H, Hkv, L = m.num_attention_heads, m.num_key_value_heads, m.num_hidden_layers
    # per layer: the norms' inputs and outputs, q/k/v and RoPE's, SDPA's output and its logsumexp
    # (4 H: fp32), the SwiGLU's three I-wide tensors and its product
    layer = {"fp32": 24 * C + 16 * F + 8 * H * D + 8 * Hkv * D + 4 * H + 8,
             "autocast": 26 * C + 8 * F + 4 * H * D + 4 * Hkv * D + 4 * H + 8,
             "bf16": 16 * C + 8 * F + 4 * H * D + 4 * Hkv * D + 4 * H + 8}[mode]
    if m.qk_norm:  # Qwen3's norms of each head of q and k: input, fp32 output, 1/rms per head
        layer += (8 if mode == "fp32" else 6) * (H + Hkv) * D + 4 * (H + Hkv)
    outside = {"fp32": 8 * C + 8 * D + 12, "autocast": 8 * C + 8 * D + 12,
               "bf16": 6 * C + 4 * D + 12}[mode]  # RoPE's tables, the final norm
    if checkpointing:
        kept_input = 2 * C if mode == "bf16" else 4 * C  # the residual stream's dtype
        return outside + L * kept_input + layer
    return outside + L * layer


@dataclass
class Plan:
    """Bytes per GPU (per process on CPU) of each part, and what they add up to."""
    params: int
    world: int
    precision: str  # the trainer's
    sampler_precision: str  # the rollout's (--rollout-precision)
    eval_only: bool  # no update: its parts stay 0
    positions: int  # per slot: --max-prompt-len + --max-response-len
    shards: int  # fp32 weights and (a run that trains) AdamW moments, this rank's share
    gathered_rollout: int  # the weights the rollout computes with, beyond the shards
    capacity: int  # what the device has (0: unknown)
    # the rollout's KV cache and what grows with it (with_slots)
    slots: int = 0
    kv_cache: int = 0
    sampling: int = 0
    prefill: int = 0
    # the update's parts (with_update)
    micro_tokens: int = 0  # padded tokens of a training micro-batch
    grads: int = 0  # fp32 gradients, this rank's share
    gathered_update: int = 0  # the weights the training forward computes with, beyond the shards
    activations: int = 0
    head: int = 0
    # --rollout-engine vllm (with_engine): its share of the device, and what of it the update keeps
    engine_share: float = 0.0  # --vllm-gpu-memory-utilization; 0: the sampler
    engine: int = 0
    engine_in_update: int = 0

    @property
    def rollout(self) -> int:
        return self.shards + self.gathered_rollout + self.kv_cache + self.sampling + \
            self.prefill + self.engine

    @property
    def update(self) -> int:
        return self.shards + self.grads + self.gathered_update + self.activations + self.head + \
            self.engine_in_update

    @property
    def peak(self) -> int:
        return max(self.rollout, self.update) + int(OVERHEAD_GB * GB)

    @property
    def fits(self) -> bool:
        return not self.capacity or self.peak <= MARGIN * self.capacity

    def describe(self, device: str, precision_why: str = "") -> str:
        """The plan in four lines; precision_why (how --precision was chosen) goes in the first."""
        def gb(n):
            return "0" if n == 0 else f"{n / GB:.1f} GiB" if n >= GB / 10 else \
                f"{n / 2**20:.1f} MiB"
        where = f"{gb(self.capacity)} on {device}" if self.capacity else device
        sampler = "" if self.sampler_precision == self.precision else \
            f", rollout {self.sampler_precision}"
        rollout = f"vLLM engine {gb(self.engine) if self.capacity else 'its share'} " \
            f"(--vllm-gpu-memory-utilization {self.engine_share:g})" if self.engine_share else \
            f"gathered weights {gb(self.gathered_rollout)} + KV cache {gb(self.kv_cache)} " \
            f"({self.slots} slots x {self.positions} positions) + sampling " \
            f"{gb(self.sampling)} + prefill {gb(self.prefill)}"
        asleep = f" + vLLM engine {gb(self.engine_in_update)}" if self.engine_in_update else ""
        return "\n".join([
            f"memory plan per process ({_count(self.params)} parameters, {self.world} "
            f"process(es), {self.precision}{sampler}"
            f"{f' ({precision_why})' if precision_why else ''}; {where}):",
            f"  rollout  {gb(self.rollout):>6} = fp32 shards {gb(self.shards)} + {rollout}",
            "  update     none: --eval-only builds no optimizer and takes no update" if
            self.eval_only else
            f"  update   {gb(self.update):>6} = fp32 shards {gb(self.shards)} + gradients "
            f"{gb(self.grads)} + gathered weights {gb(self.gathered_update)} + activations "
            f"{gb(self.activations)} ({self.micro_tokens} tokens) + output layer {gb(self.head)}"
            f"{asleep}",
            f"  peak     {gb(self.peak):>6} with {OVERHEAD_GB:g} GiB of overhead"
            + (f": {'fits' if self.fits else 'does NOT fit'} in {MARGIN:.0%} of "
               f"{gb(self.capacity)}" if self.capacity else "")])


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def plan(m, cfg, world: int, capacity: int = 0, slots: int | None = None) -> Plan:
    """The plan of a run of ModelConfig m with flags cfg (precision resolved) on world processes
    of capacity bytes each; slots: the KV cache's rows (default: what --rollout-slots allocates,
    or, for "auto", the most that fit)."""
    params, sampler = parameter_count(m), cfg.sampler_precision
    if world > 1:  # FSDP2: all weights gathered for the rollout
        gathered_rollout = params * dtype_bytes(sampler)
    else:  # one process: autocast's bf16 copy of each weight it casts (fp32: the weights as is)
        gathered_rollout = params * 2 if sampler == "bf16" else 0
    weight_bytes = 4 if cfg.eval_only else 12  # fp32 weights, and AdamW's moments if it trains
    result = Plan(params=params, world=world, precision=cfg.precision, sampler_precision=sampler,
                  eval_only=cfg.eval_only, positions=cfg.max_prompt_len + cfg.max_response_len,
                  shards=math.ceil(params / world) * weight_bytes,
                  gathered_rollout=gathered_rollout, capacity=capacity)
    if not cfg.eval_only:
        result = with_update(result, m, cfg)
    if cfg.rollout_engine == "vllm":
        return with_engine(result, cfg)
    if slots is not None:
        return with_slots(result, m, cfg, slots)
    if cfg.rollout_slots != "auto":  # 0: all
        return with_slots(result, m, cfg, allocated_slots(cfg, world))
    if not capacity:
        return with_slots(result, m, cfg, 64)  # the default, for a plan against no device
    one = with_slots(result, m, cfg, 1)
    per_slot = one.kv_cache + one.sampling  # the prefill, which grows slower: the loop below
    room = MARGIN * capacity - OVERHEAD_GB * GB - result.shards - result.gathered_rollout
    guess = max(1, min(int(room // per_slot), max_slots(cfg, world)))
    while guess > 1 and not with_slots(result, m, cfg, guess).fits:  # the prefill grows too
        guess -= max(1, guess // 16)
    return with_slots(result, m, cfg, guess)


def with_slots(p: Plan, m, cfg, slots: int) -> Plan:
    """p with the rollout's parts for this many KV-cache slots, in the sampler's precision."""
    act_bytes = dtype_bytes(p.sampler_precision)
    return replace(p, slots=slots,
                   kv_cache=slots * p.positions * kv_bytes_per_token(m, act_bytes),
                   sampling=slots * SAMPLING_BYTES * m.vocab_size,
                   prefill=prefill_bytes(m, cfg, slots, act_bytes))


def with_engine(p: Plan, cfg) -> Plan:
    """p with a vLLM engine in place of the sampler: its share of the device, freed on a GPU
    through the update (sleep mode), kept on CPU. Against no device (capacity 0) it is unknown."""
    engine = int(cfg.vllm_gpu_memory_utilization * p.capacity)
    return replace(p, gathered_rollout=0, engine_share=cfg.vllm_gpu_memory_utilization,
                   engine=engine,
                   engine_in_update=0 if cfg.device.startswith("cuda") else engine)


def with_update(p: Plan, m, cfg) -> Plan:
    """p with the update's parts: the gradients, the weights the training forward computes with,
    one micro-batch's activations and the output layer's working memory."""
    bf16, sharded = p.precision == "bf16", p.world > 1
    mode = "bf16" if bf16 and sharded else "autocast" if bf16 else "fp32"
    act_bytes = dtype_bytes(p.precision)
    if sharded:  # FSDP2: the root and ~2 blocks gathered at a time in a forward
        gathered = (root_parameter_count(m) + 2 * block_parameter_count(m)) * act_bytes
    else:  # one process: autocast's bf16 copy of each weight it casts (fp32: the weights as is)
        gathered = p.params * 2 if bf16 else 0
    # a sequence longer than --micro-batch-tokens goes alone (Batch.micro_batches)
    micro_tokens = max(cfg.micro_batch_tokens, p.positions) if cfg.micro_batch_tokens else \
        cfg.micro_batch_size * p.positions
    if cfg.fused_head:  # a chunk's logits and their gradient; the head's gradient summed in fp32
        chunk = min(micro_tokens, max(1, 2**25 // m.vocab_size))  # dapo_kernels/linear.py's
        head = 2 * chunk * m.vocab_size * act_bytes + (m.vocab_size * m.hidden_size * 4 if bf16
                                                       else 0)
    else:  # the micro-batch's logits, their log-softmax and gradient
        head = micro_tokens * m.vocab_size * (act_bytes + 8)
    per_token = activation_bytes_per_token(m, mode, cfg.activation_checkpointing)
    return replace(p, micro_tokens=micro_tokens, grads=math.ceil(p.params / p.world) * 4,
                   gathered_update=gathered, activations=int(micro_tokens * per_token), head=head)


def allocated_slots(cfg, world: int) -> int:
    """The KV cache's rows of a fixed --rollout-slots: the sampler allocates min(slots, the
    sequences it decodes), so that is planned (before, --rollout-slots 1000000000 for 8 sequences
    was refused as needing 71,266 GiB). Where an evaluation of every held-out row (--eval-prompts
    0) makes that count unknown before the data loads, the slots asked for."""
    most = max_slots(cfg, world)
    if not cfg.rollout_slots:  # 0: a slot for every sequence
        return most
    every_row = (cfg.eval_every or cfg.eval_only) and not cfg.eval_prompts
    return cfg.rollout_slots if every_row else min(cfg.rollout_slots, most)


def max_slots(cfg, world: int) -> int:
    """The most sequences a rank ever decodes at once: a generation batch's (a run that trains),
    or an evaluation's (every --eval-every steps, or --eval-only's one)."""
    generation = 0 if cfg.eval_only else cfg.gen_batch_prompts * cfg.group_size
    evaluation = (cfg.eval_prompts or 1024) * cfg.eval_samples \
        if cfg.eval_every or cfg.eval_only else 0
    return max(1, math.ceil(max(generation, evaluation) / world))


def prefill_bytes(m, cfg, slots: int, act_bytes: int) -> int:
    """One prefill forward over the distinct prompts of the slots (the G samples of a group share
    theirs): a block's widest tensors and the masked attention's (n, H, P, P) scores."""
    n = min(slots, math.ceil(slots / cfg.group_size) + 1)
    P = cfg.max_prompt_len
    width = 2 * m.hidden_size + 3 * m.intermediate_size + \
        (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
    return n * P * (width + m.num_attention_heads * P) * act_bytes


def device_capacity(device: str) -> int:
    """Bytes this process may use: the GPU's total memory, or RAM available now (Linux), or 0 if
    unknown."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[1]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


def refuse_if_too_big(p: Plan, device: str):
    """A one-line reason, naming the numbers and the flags to change, when p cannot fit."""
    engine_weights = p.params * dtype_bytes(p.sampler_precision)
    if p.engine and p.engine < engine_weights:
        raise ValueError(f"--vllm-gpu-memory-utilization gives the vLLM engine "
                         f"{p.engine / GB:.1f} GiB of {device}, less than the model's weights "
                         f"({engine_weights / GB:.1f} GiB): raise it")
    if p.fits:
        return
    parts = {"the KV cache (--rollout-slots, --max-response-len)": p.kv_cache,
             "the vLLM engine (--vllm-gpu-memory-utilization)": p.engine,
             "the gathered weights (a bigger card, or more of them)": p.gathered_rollout,
             "the activations (--micro-batch-tokens, --activation-checkpointing)": p.activations,
             "the fp32 shards (more processes)": p.shards + p.grads}
    biggest = max(parts, key=parts.get)
    raise UserError(
        f"the memory plan needs {p.peak / GB:.1f} GiB per process and {device} has "
        f"{p.capacity / GB:.1f} ({MARGIN:.0%}: {MARGIN * p.capacity / GB:.1f}): the largest part "
        f"is {biggest}, {parts[biggest] / GB:.1f} GiB (python dapo.py --plan ... prints the plan)")

