"""
The rollout engine: KV-cached sampling from model.Transformer with continuous batching, returning
what RL training needs. DAPO spends most of its wall time here. As in gpt-fast's generate.py,
generation is a few small functions that compose:

    prefill_slots()     one forward over new prompts: writes their keys/values into free cache slots
    decode_one_token()  one forward of one new token per slot against the cache
    filter_logits()     top-k, then top-p (nucleus) truncation
    sample()            temperature, truncation, the draw, and the log-prob of the drawn token
    generate()          runs them in a loop of named phases over a table of the slots (SlotTable):
                        sample, record, retire, agree across ranks, decode, refill

Continuous batching: the KV cache has B rows ("slots") of max_len positions, allocated once. A
token's index in its slot is its RoPE position and a query sees only its own slot's keys up to its
own position, so every slot keeps its own length, and a slot whose sequence ends takes the next
waiting one instead of decoding padding until the longest response ends. Below, B = 3 and the
sequences a, b, c, d, e wait in this order (lower case: prompt tokens, upper case: response tokens,
`.`: stale keys that no query can see):

    position:   0  1  2  3  4  5  6
    slot 0:     a  a  a  A  A  A             a samples an EOS: its slot is retired ...
    slot 1:     b  b  B  B  B
    slot 2:     c  c  c  c  C

    slot 0:     d  d  d  d  .  .             ... and refilled: d's prompt is prefilled into it,
    slot 1:     b  b  B  B  B  B                 while b and c decode on
    slot 2:     c  c  c  c  C  C

A decode step feeds one token per slot and reads the keys up to the furthest slot's position
(masked past each slot's own), so its shapes change with that length only.

Compact slots (COMPACT_SLOTS): once no sequence waits, a slot that frees up takes the last busy
slot's sequence (its keys copied), so the busy slots are always the first ones and a decode step
feeds only those. transformers' generate decodes every row until the longest ends; at 135M
parameters a row costs a decode step its share of the matmuls, so ended rows are not free:

    slot 0:     b  b  B  B  B             b ends, nothing waits: c, in the last busy slot, moves
    slot 1:     d  d  d  d  D  D              into slot 0
    slot 2:     c  c  c  c  C  C

    slot 0:     c  c  c  c  C  C          the next steps feed slots 0 and 1 only
    slot 1:     d  d  d  d  D  D

Copied prompts (COPY_HELD_PROMPTS): the G samples of a group have one prompt. A slot that takes a
prompt another slot holds copies its positions [0, len(prompt)) and its next-token logits instead
of prefilling it; the prompts no slot holds are prefilled once each, in one forward:

    slot 0:     e  e  e  E  E  E  E
    slot 1:     e  e  e                  the next sample of e: slot 0's positions 0-2 copied

With both switches False and slots=None, generate is plain batched decoding; docs/performance.md
measures what each part buys.
"""
import math
from collections import Counter, deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from infra import distributed
from infra.cuda_graphs import CUDAGraphDecode


@dataclass
class Rollout:
    """Sampled responses, row i answering prompts[i] (whatever slot it ran in). A row's real tokens
    are prompt_ids[i][prompt_mask[i]] followed by response_ids[i, :lengths[i]]."""
    prompt_ids: torch.Tensor  # (N, P) long: the prompts, left-padded with pad_token_id
    prompt_mask: torch.Tensor  # (N, P) bool: True on real prompt tokens
    response_ids: torch.Tensor  # (N, T) long: sampled tokens, pad_token_id after the end
    response_mask: torch.Tensor  # (N, T) bool: True on every generated token, EOS included
    logprobs: torch.Tensor  # (N, T) fp32: each sampled token's log-prob (sample()); 0 if masked
    lengths: torch.Tensor  # (N,) long: response tokens, EOS included; T = lengths.max()
    truncated: torch.Tensor  # (N,) bool: cut by max_new_tokens before any EOS

    @classmethod
    def from_responses(cls, prompts: list[list[int]], responses: list[list[int]],
                       logprobs: list[list[float]], truncated: list[bool], pad_token_id: int,
                       device) -> "Rollout":
        """The same record from responses another engine sampled (launch.py's for
        --rollout-engine vllm): each response's tokens and their log-probs as lists, row i
        answering prompts[i]."""
        prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, device)  # (N, P)
        lengths = torch.tensor([len(r) for r in responses], device=device)  # (N,)
        T = max(1, int(lengths.max()))
        response_ids = torch.full((len(responses), T), pad_token_id, dtype=torch.long)
        logp = torch.zeros(len(responses), T, dtype=torch.float32)
        for i, (ids, lp) in enumerate(zip(responses, logprobs)):
            response_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            logp[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return cls(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                   response_ids=response_ids.to(device),
                   response_mask=torch.arange(T, device=device) < lengths[:, None],  # (N, T)
                   logprobs=logp.to(device), lengths=lengths,
                   truncated=torch.tensor(truncated, device=device))


def left_pad(prompts: list[list[int]], pad_token_id: int, device):
    """Token-id lists -> ids (N, P) long left-padded with pad_token_id, mask (N, P) bool."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = True
    return ids.to(device), mask.to(device)


def last_token_logits(hidden, lm_head_weight):
    """The decode step's `head`: the output layer on the one new position -> (B, V) fp32."""
    return F.linear(hidden[:, -1], lm_head_weight).float()


def prefill_slots(model, prompts: list[list[int]], slots: list[int], kv_cache):
    """Write the keys/values of prompts (n token lists) at positions [0, len) of cache rows `slots`
    -> each prompt's next-token logits (n, V)."""
    device = kv_cache.k[0].device
    P = max(len(p) for p in prompts)
    # right-padded: a prompt starts at position 0 of its slot, and no query sees the pads after it
    ids = torch.zeros(len(prompts), P, dtype=torch.long)  # (n, P)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = torch.tensor(p)
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)  # (n,)

    def head(hidden, w):  # the output layer on each prompt's last real token only
        h = hidden[torch.arange(len(prompts), device=device), last]  # (n, C)
        return F.linear(h, w).float()  # (n, V)

    rows = torch.tensor(slots, device=device)  # (n,)
    return model(ids.to(device), kv_cache=kv_cache.upto(P), cache_rows=rows, head=head)  # (n, V)


def decode_one_token(model, tokens, positions, kv_cache):
    """tokens (B,), one per slot, at positions (B,) -> next-token logits (B, V). kv_cache: a view
    kv_cache.upto(S), S above every position."""
    return model(tokens[:, None], positions=positions[:, None], kv_cache=kv_cache,
                 head=last_token_logits)


# The speed-ups, switchable: False gives the plain loop, for reading or as a reference
COPY_HELD_PROMPTS = True  # a prompt a slot holds is copied, not prefilled
COMPACT_SLOTS = True  # once nothing waits, only the busy slots decode
SPEED_UPS = ("COPY_HELD_PROMPTS", "COMPACT_SLOTS")


def filter_logits(logits, top_k: int = 0, top_p: float = 1.0):
    """Set every logit (..., V; after the temperature) outside the top-k, then outside the top-p
    nucleus, to -inf; top_k=0 and top_p=1.0 are off. Ties stay together: top-k keeps every logit
    equal to the k-th largest, top-p keeps a token iff the tokens strictly more likely hold less
    than top_p of the mass (renormalised after top-k), so the argmax always survives."""
    # exercise: filter_logits
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:  # 1.0 must skip: a float cumsum can reach 1.0 before the last tiny probability
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # (..., V)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        mass_before = F.pad(cum[..., :-1], (1, 0))  # the mass ranked above each token
        n_keep = (mass_before < top_p).sum(-1, keepdim=True)  # >= 1: nothing is before the argmax
        threshold = sorted_logits.gather(-1, n_keep - 1)  # (..., 1): the smallest logit kept
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits
    # end exercise


def sample(logits, temperature: float, top_k: int, top_p: float, generator=None):
    """logits (B, V) fp32 -> tokens (B,) long, logprobs (B,) fp32.

    The log-prob is the drawn token's under log_softmax(logits / temperature) (logits when greedy)
    BEFORE top-k/top-p truncation: the policy's full distribution, which the trainer's forward
    computes too, not the truncated one sampled from."""
    # exercise: sample
    scaled = logits if temperature in (0, 1) else logits / temperature  # (B, V); 0 is greedy
    probs = scaled.softmax(-1)  # (B, V): the policy's, before any truncation
    if temperature == 0:
        token = logits.argmax(-1)  # (B,); top-k and top-p always keep the argmax: nothing to do
    elif top_k == 0 and top_p == 1.0:
        token = draw(probs, generator)  # (B,)
    else:
        token = draw(filter_logits(scaled, top_k, top_p).softmax(-1), generator)
    # a float32 probability is as precise relatively as log_softmax's log-prob is absolutely
    logp = probs.gather(-1, token[:, None]).squeeze(-1).log()  # (B,)
    return token, logp
    # end exercise


def draw(probs, generator=None):
    """probs (B, V), each row a distribution -> one token per row (B,), drawn by inverting the CDF
    in two levels, each with a uniform of its own: which block of tokens (in proportion to its
    mass), then which token in it. torch.multinomial draws V exponentials per row, and one float64
    cumsum over V is a serial loop on a CPU: each costs more than a small model's decode step.
    float32 sums inside a block, float64 across blocks and inside the chosen one: no token's mass
    rounds away (a float32 cumsum loses a 1e-8 added to 0.5)."""
    B, V = probs.shape
    block = math.gcd(V, 512)  # divides V, so the blocks are a view (vocabularies come in 64s)
    blocks = probs.view(B, V // block, block)
    u = 1 - torch.rand(B, 2, dtype=torch.float64, device=probs.device, generator=generator)
    which = first_reaching(blocks.sum(-1).double().cumsum(-1), u[:, :1])  # (B, 1)
    inside = blocks.gather(1, which[..., None].expand(B, 1, block))[:, 0]  # (B, block)
    return (which * block + first_reaching(inside.double().cumsum(-1), u[:, 1:]))[:, 0]


def first_reaching(cdf, u):
    """cdf (B, n) non-decreasing, u (B, 1) in (0, 1] -> (B, 1): the first index where cdf >= u
    times the row's total, which is never an index of zero mass."""
    return torch.searchsorted(cdf, u * cdf[:, -1:])


def agree_across_ranks(working: bool, prefilling: bool) -> tuple[bool, bool]:
    """-> (does any rank still have sequences, does any rank prefill this step). Under FSDP each
    forward is a collective, so every rank runs the same forwards: a rank with nothing to run
    decodes dummy rows and answers another rank's prefill with a dummy one."""
    any_working, any_prefilling = distributed.all_reduce([working, prefilling], op="max",
                                                         name="sampler's decode-loop flags")
    return bool(any_working), bool(any_prefilling)


# one torch.compile per process: it caches the compiled code per shape guard
_compiled_decode = None


def compiled_decode_step(B, max_len, device):
    """decode_one_token compiled once for every batch size and key length (dynamic shapes); on CUDA,
    recorded as CUDA graphs for this call's cache."""
    global _compiled_decode
    if _compiled_decode is None:
        _compiled_decode = torch.compile(decode_one_token, dynamic=True, fullgraph=True)
    if device.type == "cuda":
        return CUDAGraphDecode(_compiled_decode, B, max_len, device)
    return _compiled_decode


def copy_rows(kv_cache, source: list[int], to: list[int], n: int):
    """Copy positions [0, n) of cache row source[i] into row to[i], for every i (all rows are read
    before any is written, so rows may swap)."""
    if not to:
        return
    device = kv_cache.k[0].device
    source, to = torch.tensor(source, device=device), torch.tensor(to, device=device)
    for cache in kv_cache.k + kv_cache.v:
        head = cache[:, :, :n]  # a view: index_copy_ writes through to the cache
        # index_select + index_copy_: faster than an advanced-index gather and put
        head.index_copy_(0, to, head.index_select(0, source))


class SlotTable:
    """The KV cache's B rows ("slots") as the host sees them, and the sequences waiting for one; its
    methods are the moves of the diagrams above. Sequences are numbered 0..N-1; N means none: a
    free slot feeds a dummy token at position 0, and its draw lands in a scratch row."""

    def __init__(self, prompts: list[list[int]], kv_cache, copy_held_prompts: bool):
        B, N = kv_cache.k[0].shape[0], len(prompts)
        self.prompts, self.kv_cache, self.N = prompts, kv_cache, N
        self.seq = [N] * B  # (B,) the sequence each slot holds
        self.position = [0] * B  # (B,) where the slot's next token goes: its RoPE position
        self.n_new = [0] * B  # (B,) the response tokens the slot's sequence has so far
        self.waiting = deque(range(N))
        first = {}  # per sequence, its prompt: the first sequence that has it (or itself)
        self.prompt_of = [first.setdefault(tuple(p), i) if copy_held_prompts else i
                          for i, p in enumerate(prompts)]
        self.left = Counter(self.prompt_of)  # per prompt, its sequences not yet given a slot
        self.prompt_logits = {}  # per prompt with sequences left: its next-token logits (V,)

    def busy(self) -> list[int]:
        return [s for s, i in enumerate(self.seq) if i < self.N]

    def holders(self) -> dict[int, int]:
        """{prompt: a slot whose positions [0, len(prompt)) hold it}."""
        return {self.prompt_of[self.seq[s]]: s for s in self.busy()}

    def needs_prefill(self) -> bool:
        """Will the next refill meet a prompt that no slot holds?"""
        free = min(self.seq.count(self.N), len(self.waiting))
        held = self.holders() if free else {}
        return any(self.prompt_of[self.waiting[i]] not in held for i in range(free))

    def refill(self, model, logits) -> bool:
        """The next waiting sequences into the free slots, their prompts' next-token logits into
        those rows of logits (B, V) -> whether it ran a forward (a prefill)."""
        free = [s for s, i in enumerate(self.seq) if i == self.N][:len(self.waiting)]
        if not free:
            return False
        held, new = self.holders(), {}  # new: prompt -> the slot it is prefilled into
        for s in free:
            self.seq[s] = self.waiting.popleft()
            self.position[s] = len(self.prompts[self.seq[s]])
            if self.prompt_of[self.seq[s]] not in held:
                new.setdefault(self.prompt_of[self.seq[s]], s)
        if new:  # the prompts that no slot holds, once each, in one forward
            firsts = prefill_slots(model, [self.prompts[self.seq[s]] for s in new.values()],
                                   list(new.values()), self.kv_cache)  # (len(new), V)
            self.prompt_logits.update(zip(new, firsts))
            held.update(new)
        wanted = [self.prompt_of[self.seq[s]] for s in free]  # each refilled slot's prompt
        # The other refilled slots copy their prompt's keys from a slot that holds it.
        copies = [(held[p], s) for p, s in zip(wanted, free) if held[p] != s]
        # keys past a prompt's end come along too, stale: no query sees past its own position
        copy_rows(self.kv_cache, [h for h, _ in copies], [s for _, s in copies],
                  max((self.position[s] for _, s in copies), default=0))
        logits[free] = torch.stack([self.prompt_logits[p] for p in wanted])  # (len(free), V)
        for p in wanted:
            self.left[p] -= 1
            if not self.left[p]:
                del self.prompt_logits[p]
        return bool(new)

    def retire(self, ended: list[bool], max_new_tokens: int) -> list[tuple[int, int, bool]]:
        """Count each busy slot's new token; free the slots whose sequence drew an EOS (ended[s])
        or reached max_new_tokens -> (sequence, length, truncated) of each."""
        done = []
        for s in self.busy():
            self.n_new[s] += 1
            if ended[s] or self.n_new[s] == max_new_tokens:
                done.append((self.seq[s], self.n_new[s], not ended[s]))
                self.seq[s], self.position[s], self.n_new[s] = self.N, 0, 0
        return done

    def compact(self, token) -> torch.Tensor:
        """Once no sequence waits: the last busy slots' sequences move into the free slots before
        them (keys copied), so that the busy slots come first -> the tokens (n,) those first n slots
        feed (n >= 1: a rank with nothing left decodes a dummy row, in step with the others);
        token: the tokens of the slots the last step fed, before the move."""
        if self.waiting or not COMPACT_SLOTS:
            return token
        busy = self.busy()
        holes = [s for s in range(len(busy)) if self.seq[s] == self.N]
        # As many movers as holes: the busy slots that lie past the first len(busy) slots.
        movers = busy[len(busy) - len(holes):]
        copy_rows(self.kv_cache, movers, holes, max((self.position[s] for s in movers), default=0))
        token = token.clone()
        for old, new in zip(movers, holes):
            token[new] = token[old]
            moved = self.seq[old], self.position[old], self.n_new[old]
            self.seq[new], self.position[new], self.n_new[new] = moved
            # the old slot is free, as retire() leaves a slot
            self.seq[old], self.position[old], self.n_new[old] = self.N, 0, 0
        return token[:max(len(busy), 1)]

    def decode(self, model, decode, token) -> torch.Tensor:
        """The first slots feed their tokens (n,) at their positions (after compact(), the busy
        ones; else all B) -> next-token logits (n, V); the busy slots move on one position."""
        token = self.compact(token)
        fed = self.position[:len(token)]
        positions = torch.tensor(fed, device=token.device)  # (n,)
        logits = decode(model, token, positions, self.kv_cache.upto(max(fed) + 1))
        for s in self.busy():
            self.position[s] += 1
        return logits


@dataclass
class Responses:
    """What the loop records per sequence, as its tokens come; row N is scratch, for the draws of
    the slots that hold no sequence."""
    ids: torch.Tensor  # (N + 1, max_new_tokens) long: sampled tokens, pad_token_id after the end
    logprobs: torch.Tensor  # (N + 1, max_new_tokens) fp32: each sampled token's log-prob
    lengths: list[int]  # (N,) response tokens, EOS included
    truncated: list[bool]  # (N,) cut by max_new_tokens before any EOS

    @classmethod
    def empty(cls, N: int, max_new_tokens: int, pad_token_id: int, device) -> "Responses":
        ids = torch.full((N + 1, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(N + 1, max_new_tokens, dtype=torch.float32, device=device)
        return cls(ids, logprobs, [0] * N, [False] * N)

    def rollout(self, prompts: list[list[int]], pad_token_id: int) -> Rollout:
        """-> the Rollout of prompts, less the scratch row and the columns no sequence reached."""
        N, device = len(prompts), self.ids.device
        prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, device)  # (N, P)
        lengths = torch.tensor(self.lengths, device=device)  # (N,)
        T = max(self.lengths)
        response_mask = torch.arange(T, device=device) < lengths[:, None]  # (N, T)
        return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                       response_ids=self.ids[:N, :T], response_mask=response_mask,
                       logprobs=self.logprobs[:N, :T], lengths=lengths,
                       truncated=torch.tensor(self.truncated, device=device))


def check_settings(prompts, max_new_tokens, temperature, top_k, top_p, slots):
    """generate's arguments that no rollout can honour -> a ValueError that names them."""
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    if (max_new_tokens < 1 or temperature < 0 or top_k < 0 or not 0 < top_p <= 1
            or (slots is not None and slots < 1)):
        raise ValueError(f"bad sampling settings: max_new_tokens={max_new_tokens} (>= 1), "
                         f"temperature={temperature} (>= 0), top_k={top_k} (>= 0), "
                         f"top_p={top_p} (in (0, 1]), slots={slots} (>= 1)")


def eos_tensor(model, eos_token_ids, device) -> torch.Tensor:
    """An id, a list of ids, or None (the model config's eos_token_id) -> (E,) long, maybe
    empty."""
    if eos_token_ids is None:
        eos_token_ids = model.config.eos_token_id
    if eos_token_ids is None:
        eos_token_ids = []
    elif isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]
    return torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)


def new_slot_table(model, prompts: list[list[int]], max_new_tokens: int,
                   slots: int | None) -> SlotTable:
    """The KV cache, the one big allocation: min(slots, N) rows (None: one per prompt) of the
    longest prompt + max_new_tokens positions, however many prompts; and the table of its rows."""
    B = min(slots or len(prompts), len(prompts))
    kv_cache = model.new_kv_cache(B, max(len(p) for p in prompts) + max_new_tokens)
    return SlotTable(prompts, kv_cache, COPY_HELD_PROMPTS)


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, eos_token_ids=None, pad_token_id: int = 0,
             generator: torch.Generator | None = None, progress: bool = False,
             slots: int | None = None, compile: bool = False) -> Rollout:
    """Sample one response per prompt; repeat a prompt G times in `prompts` for a group.

    prompts: token-id lists of any (non-zero) lengths, as many as wanted. max_new_tokens: the cap on
    response tokens, EOS included. temperature 0 is greedy. top_k=0 and top_p=1.0 turn truncation
    off. eos_token_ids: an id or a list of ids that end a response (a Qwen chat model: <|im_end|>
    and <|endoftext|>); None takes the model config's eos_token_id, an empty list never stops early.
    generator: a torch.Generator on the model's device, for reproducible samples. progress: a tqdm
    bar over finished sequences (under torch.distributed, on one rank only).
    slots: how many sequences decode at once (default: one per prompt); the KV cache holds
    slots x (longest prompt + max_new_tokens) positions.
    compile: decode with a torch.compile'd step (on a GPU, replayed as CUDA graphs).

    Under torch.distributed every rank calls this with its own prompts (any number) and the same
    max_new_tokens and compile. T of the result is this rank's longest response."""
    check_settings(prompts, max_new_tokens, temperature, top_k, top_p, slots)
    device = model.model.embed_tokens.weight.device
    eos = eos_tensor(model, eos_token_ids, device)
    table = new_slot_table(model, prompts, max_new_tokens, slots)
    B, _, max_len, _ = table.kv_cache.k[0].shape
    decode = compiled_decode_step(B, max_len, device) if compile else decode_one_token
    responses = Responses.empty(len(prompts), max_new_tokens, pad_token_id, device)
    logits = torch.zeros(B, model.config.vocab_size, device=device)  # (B, V): next-token logits
    was_training = model.training
    model.eval()  # no dropout in this model, but generation is inference: say so
    bar = tqdm(total=len(prompts), desc="generate", unit="seq", disable=not progress)
    try:
        table.refill(model, logits)  # every rank has a prompt, so every rank runs this forward
        while True:
            # 1) sample: a token for every row fed (a free one too, drawn into the scratch row)
            token, logp = sample(logits, temperature, top_k, top_p, generator)  # (n,), (n,)
            # 2) record: each at its sequence's next response index
            fed = table.seq[:len(token)], table.n_new[:len(token)]
            responses.ids[fed] = token
            responses.logprobs[fed] = logp
            # 3) retire: the sequences that drew an EOS or reached max_new_tokens leave their slots
            ended = torch.isin(token, eos).tolist()  # the host learns which rows ended: one sync
            for i, length, cut in table.retire(ended, max_new_tokens):
                responses.lengths[i], responses.truncated[i] = length, cut
                bar.update(1)
            # 4) agree across ranks: go on while any rank works; prefill when any rank does
            working, prefilling = agree_across_ranks(bool(table.waiting or table.busy()),
                                                    table.needs_prefill())
            if not working:
                break
            # 5) decode: each slot feeds its token at its position (the busy ones, once none waits)
            logits = table.decode(model, decode, token)  # (n, V)
            # 6) refill: the free slots take the next waiting sequences
            if not table.refill(model, logits) and prefilling:
                # another rank prefills: as many forwards, on a dummy
                model(torch.zeros(1, 1, dtype=torch.long, device=device), head=last_token_logits)
    finally:
        bar.close()
        model.train(was_training)
    return responses.rollout(prompts, pad_token_id)

