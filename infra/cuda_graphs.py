"""
The sampler's compiled decode step replayed as CUDA graphs (sampler.compiled_decode_step on a GPU):
machinery that saves kernel launches, apart from the sampling it speeds up.
"""
import math

import torch


class CUDAGraphDecode:
    """The compiled decode step replayed as CUDA graphs, one per key-length bucket (powers of two):
    a step is one launch instead of a few hundred kernels. torch.compile's mode="reduce-overhead"
    records graphs too, but for a cache at one address for the whole run (gpt-fast keeps it as a
    model buffer); ours is allocated per call and freed for training, so the graphs are recorded
    here, per call."""

    def __init__(self, step, B, max_len, device):
        self.step, self.max_len = step, max_len
        self.tokens = torch.zeros(B, dtype=torch.long, device=device)  # the inputs the graphs read
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        # one memory pool for all: the graphs never run at once, and each output is cloned at once
        self.graphs, self.pool = {}, torch.cuda.graph_pool_handle()  # bucket -> (graph, logits)

    def __call__(self, model, tokens, positions, kv_cache):
        S = min(self.max_len, max(64, 2 ** math.ceil(math.log2(kv_cache.length))))
        n = len(tokens)  # the first n rows; the graphs feed all B, the rest a dummy at position 0
        self.tokens.zero_()
        self.positions.zero_()
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        if S not in self.graphs:
            # the graph reads and writes this call's cache, at its addresses
            view = kv_cache.upto(S)
            side = torch.cuda.Stream()  # warm up (compile, allocate) outside the capture
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # this step's keys are written twice: the same values
                self.step(model, self.tokens, self.positions, view)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.step(model, self.tokens, self.positions, view)  # (B, V)
            self.graphs[S] = graph, logits
        graph, logits = self.graphs[S]
        graph.replay()
        return logits[:n].clone()  # the next replay overwrites the graph's output
