"""
The policy's log-probs of sampled responses, which the RL loss reads: log pi(o_t | q, o_<t) and
the entropy there, for every response token of a batch.Batch, from model.py's Transformer. The
loss's pi_theta (with gradient) and pi_old (without) both come from response_logprobs().

    response_logprobs()        each row through the model from column 0, its prompt then its
                               response; the output layer on response positions only
    output_layer()             fused (dapo_kernels/: the (B, R, V) logits never exist) or plain
    shared_prompt_logprobs()   the same numbers with each distinct prompt through the model once
                               (a group's G responses share theirs), where shares_prompts() says
"""
import torch

from dapo_kernels import linear_logprobs_and_entropy, logprobs_and_entropy
from infra import distributed
from model import KVCache, Transformer



def response_logprobs(model: Transformer, batch, temperature: float, fused_head: bool = True):
    """log pi(o_t | q, o_<t) and the entropy of that distribution, for every response token of a
    batch.Batch (its prompt_ids/mask, left-padded, and response_ids/mask, right-padded): (B, R)
    each, fp32 (0 on padding with the fused head): the policy loss's pi_theta and pi_old.
    Each row goes through the model from column 0, its prompt then its response, the padding
    after both:

        batch:     pad pad p0 p1 p2 | r0 r1 r2 pad        row i of the model's input:
                                                          p0 p1 p2 r0 r1 r2 pad pad pad
    so plain causal attention is the whole mask and SDPA may take a flash kernel (none takes an
    explicit mask). The output layer runs inside the model's forward (where FSDP has it gathered)
    on response positions only; fused (the default), chunk by chunk inside the log-prob kernel, so
    the (B, R, V) logits never exist (unfused: 6 GB for a 20k-token response at Qwen2.5's vocab).
    Rows that repeat a prompt (a group's G responses) may share its forward instead:
    shared_prompt_logprobs(), where shares_prompts() says so."""
    if shares_prompts(model, batch):
        return shared_prompt_logprobs(model, batch, temperature, fused_head)
    P, (B, R) = batch.prompt_ids.shape[1], batch.response_ids.shape
    prompt_len = batch.prompt_mask.sum(-1)  # (B,)
    T = int((prompt_len + batch.response_mask.sum(-1)).max())  # the longest row's real tokens
    # column j of row i is column j + (P - prompt_len_i) of [prompt | response], which starts at
    # the prompt's first real token; past the row's end it is padding (clamped, then ignored)
    source = (torch.arange(T, device=prompt_len.device) + (P - prompt_len)[:, None]).clamp(
        max=P + R - 1)  # (B, T)
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1).gather(1, source)  # (B, T)
    # response token t of row i sits at column prompt_len_i + t: the column before predicts it
    predicting = (prompt_len[:, None] - 1 + torch.arange(R, device=ids.device)).clamp(
        max=T - 1)  # (B, R)

    def head(hidden, weight):  # hidden (B, T, C)
        hidden = hidden.gather(1, predicting[..., None].expand(B, R, hidden.shape[-1]))  # (B, R, C)
        return output_layer(hidden, weight, batch, temperature, fused_head)

    # -> logp, entropy (B, R) each; the positions are 0.. and causal attention needs no mask
    return model(ids, head=head)


def output_layer(hidden, weight, batch, temperature: float, fused_head: bool):
    """hidden (B, R, C) at the positions predicting each response token -> its log-prob and the
    entropy there, (B, R) each."""
    if fused_head:
        return linear_logprobs_and_entropy(hidden, weight, batch.response_ids, temperature,
                                           mask=batch.response_mask)
    logits = hidden @ weight.T  # (B, R, V)
    logp, entropy = logprobs_and_entropy(logits, batch.response_ids, temperature)
    return logp.clone(), entropy.clone()  # not views: FSDP2 loses the hooks of in-place views


# The training forward's speed-up, switchable: False always takes the plain forward
PROMPT_FORWARD_ONCE = True  # a prompt that several rows repeat goes through the model once


def shares_prompts(model: Transformer, batch) -> bool:
    """Does response_logprobs run each distinct prompt once: when rows repeat a prompt, on a CPU
    (whose SDPA kernel takes the explicit mask this needs; a GPU's flash kernel takes none, and
    the mask of 64 rows of 20k tokens is 28 GB), in one process on an unsharded model (under
    FSDP2, in any number of processes, each block would run two forwards a micro-batch, and its
    hooks hand the forward views that the KV cache's in-place write refuses) and without
    activation checkpointing (which recomputes a block from its input alone, not its KV cache)."""
    if not PROMPT_FORWARD_ONCE or batch.prompt_ids.device.type != "cpu":
        return False
    sharded = distributed.world_size() > 1 or distributed.is_sharded(model)
    if sharded or model.activation_checkpointing:
        return False
    prompts = torch.cat([batch.prompt_ids, batch.prompt_mask.long()], 1)  # (B, 2P)
    return len(torch.unique(prompts, dim=0)) < len(prompts)


def shared_prompt_logprobs(model: Transformer, batch, temperature: float, fused_head: bool):
    """response_logprobs' numbers with each distinct prompt through the model once (a group's G
    responses repeat theirs: with make real's ~40-token prompts, over half the tokens). Two
    forwards: the prompts, from column 0, writing their keys and values into a KV cache; then the
    responses alone at their positions, each row reading its prompt's cache rows, copied:

        prompts (U rows):   p0 p1 p2 pad      ->  cache row u: keys of p0 p1 p2
        responses (B rows): r0 r1 r2 pad          row i reads its prompt's keys, then its own
    Autograd sums each prompt token's gradient over the rows that read it, as the plain forward's
    separate copies would."""
    P, (B, R) = batch.prompt_ids.shape[1], batch.response_ids.shape
    prompts = torch.cat([batch.prompt_ids, batch.prompt_mask.long()], 1)  # (B, 2P)
    _, group = torch.unique(prompts, dim=0, return_inverse=True)  # (B,): row -> its prompt
    U, device = int(group.max()) + 1, group.device
    first = torch.full((U,), B, device=device).scatter_reduce(  # (U,): a row of each prompt
        0, group, torch.arange(B, device=device), "amin")
    prompt_len = batch.prompt_mask.sum(-1)  # (B,)
    length = prompt_len[first]  # (U,)
    # from column 0: column j of prompt u is column j + (P - length_u) of its left-padded row
    source = (torch.arange(int(length.max()), device=device) + (P - length)[:, None]).clamp(
        max=P - 1)  # (U, P_u)
    ids = batch.prompt_ids[first].gather(1, source)  # (U, P_u)
    # room for each prompt's keys, then for its responses' keys after them
    cache = model.new_kv_cache(U, ids.shape[1] + R)
    last = model(ids, kv_cache=cache, head=lambda hidden, weight: hidden[
        torch.arange(U, device=device), length - 1])  # (U, C): predicts each response's r0
    rows = KVCache([k[group] for k in cache.k], [v[group] for v in cache.v])  # (B, Hkv, S, D)
    positions = prompt_len[:, None] + torch.arange(R, device=device)  # (B, R)

    def head(hidden, weight):  # hidden (B, R, C): response position t predicts token t + 1
        hidden = torch.cat([last[group][:, None], hidden[:, :-1]], 1)  # (B, R, C)
        return output_layer(hidden, weight, batch, temperature, fused_head)

    # each response token writes its keys at its position, after its prompt's (overwriting the
    # keys of a longer prompt's padding) and reads those up to its own: the causal mask
    return model(batch.response_ids, positions=positions, kv_cache=rows, head=head)
