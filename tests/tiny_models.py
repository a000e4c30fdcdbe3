"""The tiny random model of the exact comparisons (test_dapo.py, test_model.py), in float64: two
computations of the same sums in another order differ by ~1e-16 of the result. And its weights,
or its gradients, as one vector."""
import torch

from model import Transformer, preset


def tiny_float64_model(tied=True) -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("tiny", vocab_size=50, tie_word_embeddings=tied)).double()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])
