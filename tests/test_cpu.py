"""infra/cpu.py: a small model runs on one thread, and the bf16 probe leaves torch as it was."""
import pytest
import torch

from infra import cpu


@pytest.fixture
def two_threads(monkeypatch):
    """torch on two threads and no OMP_NUM_THREADS, as a user's shell; restored after."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_small_model_runs_on_one_thread(two_threads):
    assert cpu.set_threads(430_000) == 1 == torch.get_num_threads()


def test_a_big_model_keeps_every_thread(two_threads):
    assert cpu.set_threads(135_000_000) == 2 == torch.get_num_threads()


def test_omp_num_threads_is_the_users_choice(two_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu.set_threads(430_000) == 2


def test_the_bf16_probe_measures_on_one_thread_and_restores_the_count(two_threads):
    cpu.bf16_speedup.cache_clear()
    speedup = cpu.bf16_speedup()
    assert 0 < speedup < float("inf") and torch.get_num_threads() == 2
