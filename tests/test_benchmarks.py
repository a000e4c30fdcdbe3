"""The benchmarks' own set-up, run here without what they compare against (TRL, vLLM) or the
93 MB model: a benchmark whose set-up rots with the code fails in `make test`, not in the next
`make bench` (bench_step's SmolLM2 workload once called load_rows with a keyword that was gone)."""
import argparse

from benchmarks import bench_step
from examples import smollm2


def test_bench_steps_smollm2_workload_is_make_reals_step_with_one_optimizer_step(
        tmp_path, monkeypatch):
    from model import Transformer, preset
    from toy import make_toy_tokenizer
    model_dir = str(tmp_path / "llama")
    tok = make_toy_tokenizer(model_dir)
    Transformer(preset("tiny", model_type="llama", vocab_size=tok.vocab_size)).save_pretrained(
        model_dir)
    monkeypatch.setattr(smollm2, "OUT", model_dir)
    monkeypatch.setattr(bench_step.from_gguf, "is_converted", lambda d: d == model_dir)
    args = argparse.Namespace(precision="fp32", warmup=1, rounds=2, profile=False,
                              trl_micro_batch=0)
    work = bench_step.smollm2_workload(str(tmp_path), args)
    assert (work.prompts, work.group) == (8, 8)  # make real's 8 prompts x G 8
    assert len(work.rows) >= work.prompts * 3  # the warm-up's and both rounds' prompts
    assert work.cfg.mini_batch_prompts == work.cfg.train_prompts  # TRL's one step a rollout
    assert not work.cfg.dynamic_sampling and work.trl_micro_batch == 16
