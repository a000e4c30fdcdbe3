"""
The rollout engine: batched, KV-cached sampling from model.Qwen2, returning what RL training needs.

DAPO spends most of its wall time here (16 responses per prompt, hundreds of prompts per step). In the spirit of
gpt-fast's generate.py, generation is a few small functions that compose:

    prefill()           one forward over the left-padded prompts: fills the KV cache, returns next-token logits
    decode_one_token()  one forward of one new token per sequence against the cache
    filter_logits()     top-k, then top-p (nucleus) truncation
    sample()            temperature, truncation, the draw, and the log-prob of the drawn token
    generate()          runs them: one prefill, then one decode step per new token for the whole batch

The batch layout, by KV-cache slot (P = the longest prompt):

    slot:     0    1    2    3  |  4    5    6    7  ...
    row 0:   pad  pad  p0   p1  |  r0   r1  EOS  pad ...     a short prompt, left-padded; a response that ended
    row 1:   p0   p1   p2   p3  |  r0   r1   r2   r3 ...

Left padding puts every prompt's last token in the same slot, so each decode step writes one slot for the whole
batch. RoPE positions count real tokens only (row 0's p0 sits at position 0, its r0 at position 2), and the key mask
hides the pads, so every row computes exactly what it would alone.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm


@dataclass
class Rollout:
    """One batch of prompts and their sampled responses, row i answering prompts[i].

    The trainer's full-sequence forward takes `sequences()`: prompt and response side by side, (B, P + T). The
    logits that predict response token t sit in column P - 1 + t of that forward."""
    prompt_ids: torch.Tensor  # (B, P) long: the prompts, left-padded with pad_token_id
    prompt_mask: torch.Tensor  # (B, P) bool: True on real prompt tokens
    response_ids: torch.Tensor  # (B, T) long: sampled tokens, pad_token_id after the EOS; T = lengths.max()
    response_mask: torch.Tensor  # (B, T) bool: True on every generated token up to and including the EOS
    logprobs: torch.Tensor  # (B, T) fp32: log-prob of each sampled token (see sample()); 0 where masked
    lengths: torch.Tensor  # (B,) long: response tokens, EOS included (= response_mask.sum(-1))
    truncated: torch.Tensor  # (B,) bool: cut by max_new_tokens before any EOS

    def sequences(self):
        """prompt + response as one batch -> input_ids, attention_mask, positions, each (B, P + T). The real tokens
        of a row are contiguous (pads, prompt, response, pads), so a position is the count of real tokens before."""
        input_ids = torch.cat([self.prompt_ids, self.response_ids], 1)  # (B, P + T)
        attention_mask = torch.cat([self.prompt_mask, self.response_mask], 1)  # (B, P + T)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, P + T)
        return input_ids, attention_mask, positions


def left_pad(prompts: list[list[int]], pad_token_id: int, device):
    """Token-id lists of different lengths -> ids (B, P) long left-padded with pad_token_id, mask (B, P) bool."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = True
    return ids.to(device), mask.to(device)


def last_token_logits(hidden, lm_head_weight):
    """The model's `head`: project only the last slot, the one that predicts the next token. Applying the output
    layer to all P prompt slots would cost P times more than the rest of a decode step at a large vocab."""
    return F.linear(hidden[:, -1], lm_head_weight).float()  # (B, V)


def prefill(model, prompt_ids, prompt_mask, kv_cache):
    """Run the left-padded prompts (B, P) through the model, writing cache slots [0, P) -> next-token logits (B, V)."""
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, P): each prompt's first real token at 0
    return model(prompt_ids, positions=positions, attention_mask=prompt_mask, kv_cache=kv_cache, cache_start=0,
                 head=last_token_logits)


def decode_one_token(model, token, positions, key_mask, kv_cache, slot):
    """token (B,) at RoPE positions (B,), written to cache slot `slot`; key_mask (B, slot + 1) marks the real keys
    -> next-token logits (B, V)."""
    return model(token[:, None], positions=positions[:, None], attention_mask=key_mask, kv_cache=kv_cache,
                 cache_start=slot, head=last_token_logits)


def filter_logits(logits, top_k: int = 0, top_p: float = 1.0):
    """Set every logit outside the top-k, then outside the top-p nucleus, to -inf (logits (..., V), already divided
    by the temperature). top_k=0 and top_p=1.0 are no-ops. Ties are kept together: top-k keeps every token whose
    logit equals the k-th largest, and top-p keeps a token iff the tokens strictly more likely than it hold less
    than top_p of the mass (renormalised after top-k), so the argmax always survives."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:  # 1.0 must skip, not compute: a float cumsum can reach 1.0 before the last tiny probability
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # (..., V)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        mass_before = F.pad(cum[..., :-1], (1, 0))  # mass of the tokens ranked above each one; a prefix keeps
        n_keep = (mass_before < top_p).sum(-1, keepdim=True)  # >= 1: the argmax has nothing before it
        threshold = sorted_logits.gather(-1, n_keep - 1)  # (..., 1): the smallest logit in the nucleus
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits


def sample(logits, temperature: float, top_k: int, top_p: float, generator=None):
    """logits (B, V) fp32 -> tokens (B,) long, logprobs (B,) fp32.

    The log-prob is that of the drawn token under log_softmax(logits / temperature), BEFORE top-k/top-p truncation
    (under log_softmax(logits) when greedy, temperature 0): the full distribution of the policy at that temperature,
    which is what the trainer's own forward computes, not the truncated one actually sampled from."""
    if temperature == 0:
        token = logits.argmax(-1)  # (B,); top-k and top-p always keep the argmax, so they change nothing here
        scaled = logits
    else:
        scaled = logits / temperature  # (B, V)
        probs = filter_logits(scaled, top_k, top_p).softmax(-1)  # (B, V)
        # draw from probs as argmax(probs / q), q ~ Exp(1) (the exponential race, gpt-fast's no-sync multinomial)
        q = torch.empty_like(probs).exponential_(1, generator=generator)
        token = (probs / q).argmax(-1)  # (B,)
    logp = scaled.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)  # (B,); one pass, unlike logsumexp's four
    return token, logp


def all_ranks_done(done) -> bool:
    """True once every sequence on every rank has finished. Under torch.distributed the all-reduce keeps ranks in
    lockstep: each forward is a collective under FSDP, so no rank may stop while another still decodes."""
    if not (dist.is_available() and dist.is_initialized()):
        return bool(done.all())
    running = (~done).any().to(torch.int32)  # () 1 while this rank has an unfinished sequence
    dist.all_reduce(running, op=dist.ReduceOp.MAX)  # 1 while any rank has one
    return not running.item()


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, eos_token_ids=None, pad_token_id: int = 0, generator: torch.Generator | None = None,
             progress: bool = False) -> Rollout:
    """Sample one response per prompt (repeat a prompt G times in `prompts` for a group).

    prompts: token-id lists of any (non-zero) lengths. max_new_tokens: the cap on response tokens, EOS included.
    temperature 0 is greedy. top_k=0 and top_p=1.0 turn truncation off. eos_token_ids: an id or a list of ids that
    end a response (a Qwen chat model: <|im_end|> and <|endoftext|>); None takes the model config's eos_token_id,
    an empty list never stops early. generator: a torch.Generator on the model's device, for reproducible samples.
    progress: a tqdm bar over decode steps (under torch.distributed, pass it on one rank only).

    Under torch.distributed every rank must call this with the same max_new_tokens: ranks then run the same number
    of forward calls, a finished rank decoding padding until all are done. T of the result is this rank's longest
    response, so it can differ between ranks."""
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    if max_new_tokens < 1 or temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"bad sampling settings: max_new_tokens={max_new_tokens} (>= 1), temperature={temperature} "
                         f"(>= 0), top_k={top_k} (>= 0), top_p={top_p} (in (0, 1])")
    if eos_token_ids is None:
        eos_token_ids = model.config.eos_token_id
    eos_token_ids = [] if eos_token_ids is None else [eos_token_ids] if isinstance(eos_token_ids, int) \
        else list(eos_token_ids)
    was_training = model.training
    model.eval()  # no dropout in Qwen2, but generation is inference: say so
    device = model.model.embed_tokens.weight.device

    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, device)  # (B, P)
    B, P = prompt_ids.shape
    kv_cache = model.new_kv_cache(B, P + max_new_tokens)
    key_mask = torch.ones(B, P + max_new_tokens, dtype=torch.bool, device=device)  # cache slots that hold real tokens
    key_mask[:, :P] = prompt_mask  # response slots are all real (a finished row sees its pads; its output is unused)
    prompt_lengths = prompt_mask.sum(-1)  # (B,): the RoPE position of the first response token
    eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device)

    response_ids = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (B,) True once a row has emitted an EOS
    # asking "all done?" reads a device value back to the host: free on CPU, a pipeline stall per token on a GPU
    check_every = 1 if device.type == "cpu" else 8

    bar = tqdm(total=max_new_tokens, desc="generate", unit="tok", disable=not progress)
    try:
        logits = prefill(model, prompt_ids, prompt_mask, kv_cache)  # (B, V)
        for t in range(max_new_tokens):
            token, logp = sample(logits, temperature, top_k, top_p, generator)  # (B,), (B,)
            response_ids[:, t] = token.masked_fill(done, pad_token_id)  # a finished row keeps emitting padding
            logprobs[:, t] = logp.masked_fill(done, 0.0)
            lengths += ~done
            done |= torch.isin(token, eos)
            bar.update(1)
            if t == max_new_tokens - 1 or ((t + 1) % check_every == 0 and all_ranks_done(done)):
                break
            logits = decode_one_token(model, response_ids[:, t], prompt_lengths + t, key_mask[:, :P + t + 1],
                                      kv_cache, slot=P + t)
    finally:
        bar.close()
        model.train(was_training)

    T = int(lengths.max())  # drop the all-padding columns decoded after the last row finished
    response_mask = torch.arange(T, device=device) < lengths[:, None]  # (B, T)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids[:, :T],
                   response_mask=response_mask, logprobs=logprobs[:, :T], lengths=lengths, truncated=~done)
