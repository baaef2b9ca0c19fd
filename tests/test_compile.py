"""torch.compile through train.py on the CPU: the compiled step trains exactly like the eager one.

One test, one compilation (about 30-60 s on a 2-core CPU, so it is marked slow: -m "not slow" skips it).
Only the "default" mode is compiled here; "reduce-overhead" and "max-autotune" differ in CUDA graphs and
kernel autotuning, which need a GPU to mean anything (bench/gpu_check.sh runs the ladder's compile rung).
"""

import numpy as np
import pytest

import config
import loop
import telemetry
import train
from shards import write_shard


@pytest.mark.slow
def test_compiled_training_steps_match_eager(tmp_path):
    rng = np.random.default_rng(0)
    period = rng.integers(0, 256, 50, dtype=np.uint16)  # a text that repeats: three steps can learn some of it
    write_shard(tmp_path / "train_000000.bin", np.tile(period, 100), vocab_size=256)
    flags = ["--data", str(tmp_path), "--vocab-size", "256", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2",
             "--n-embd", "64", "--seq-len", "32", "--batch-size", "4", "--eval-interval", "0", "--dtype", "fp32",
             "--act-ckpt", "selective"]
    losses = {}
    for mode in ("off", "default"):
        run = train.setup(config.parse_args([*flags, "--compile", mode, "--out-dir", str(tmp_path / mode)]))
        try:
            losses[mode] = [loop.train_step(run)["train_loss"].item() for _ in range(3)]
        finally:
            run.close()
    assert losses["default"] == pytest.approx(losses["off"], rel=1e-5)
    assert losses["off"][2] < losses["off"][0]  # it trains: the same batches, three optimizer steps


def test_compile_seconds_is_the_first_step_minus_the_steady_median():
    assert telemetry.compile_seconds([30.0, 1.0, 2.0, 1.5]) == pytest.approx(28.5)
    assert telemetry.compile_seconds([4.0]) == 4.0
