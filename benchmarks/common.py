"""What several benchmarks do the same way: the clock, rounds that alternate the variants, a random
model whose biases and norms count, transformers' left-padded batches and the lengths of its
outputs, the peak of resident memory, and a prompt source that hands out fixed rows. Not a
benchmark itself (`make bench` runs benchmarks/bench_*.py; checks/ uses it too)."""
import time

import torch


def clock() -> float:
    # one thread: the process's CPU time (time spent descheduled does not count); else wall time
    return time.process_time() if torch.get_num_threads() == 1 else time.perf_counter()


def timed_rounds(rounds: int, runs: dict, timer=clock) -> dict:
    """{name: fn} -> {name: [(seconds, fn's output) per round]}, the fns called in turn each round:
    on a shared machine the other tenants then slow every variant alike."""
    out = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = timer()
            result = fn()
            out[name].append((timer() - t0, result))
    return out


@torch.no_grad()
def randomise_biases_and_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Adds noise to the biases and norm weights (an init makes them 0 and 1), so that a bias or
    a norm read wrong shows as a difference."""
    for name, p in model.named_parameters():
        if name.endswith("bias") or "norm" in name:
            p.add_(torch.randn_like(p) * 0.1)
    return model


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ids, attention mask (N, P), left-padded, as transformers' generate wants."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
    return ids, mask


def lengths_to_eos(tokens: torch.Tensor, eos_ids: list[int]) -> list[int]:
    """transformers' generated tokens (N, T) -> each row's length up to and including its first
    EOS (T where none came)."""
    is_eos = torch.isin(tokens, torch.tensor(eos_ids, device=tokens.device))
    return torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, tokens.shape[1]).tolist()


def proc_status_kib(key: str) -> int:
    """A /proc/self/status field in KiB (Linux): VmRSS, the resident size now; VmHWM, its peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def reset_peak_rss() -> bool:
    """Resets the kernel's resident-size high-water mark (VmHWM) to the current size; False where
    /proc/self/clear_refs is read-only."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class FixedRows:
    """dapo.collect_batch's prompt source: the same rows every generation batch."""

    def __init__(self, rows):
        self.rows, self.batch_size = rows, len(rows)

    def next_batch(self):
        return self.rows
