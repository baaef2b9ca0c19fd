"""checks.py: the start-up checks' messages name the flag at fault, each wrong flag on its own (the wider set of
start-up refusals is tested with config.py's command line, in test_config.py)."""

import pytest

import config
from checks import in_flags
from cli import UsageError
from model import ModelConfig
from optim import OptimConfig


@pytest.mark.parametrize("argv, message", [
    (["--n-layer", "-2"], "--n-layer must be positive, got -2"),
    (["--ffn-dim", "0"], "--ffn-dim must be positive (or unset), got 0"),
    (["--head-dim", "7"], "--head-dim must be even for rotary embeddings, got 7"),
    (["--n-head", "2", "--n-kv-head", "3"], "--n-head (2) must be divisible by --n-kv-head (3)"),
    (["--seq-len", "0"], "--seq-len must be positive, got 0"),  # once, though two checks cover it
    (["--unet-skips", "--n-layer", "1"], "--unet-skips needs at least 2 layers, got --n-layer 1"),
    (["--lr", "-1"], "--lr must be positive, got -1.0"),
    (["--adam-eps", "0"], "--adam-eps must be positive, got 0.0"),
    (["--beta2", "1.5"], "--beta2 must be in [0, 1), got 1.5"),
    (["--optimizer", "adamw", "--muon-momentum-warmup", "3"],
     "--muon-momentum-warmup ramps Muon's momentum: it needs --optimizer muon"),
    (["--decay-frac", "2"], "--decay-frac must be in (0, 1], got 2.0"),
    (["--min-lr-ratio", "-1"], "--min-lr-ratio must be in [0, 1], got -1.0"),
    (["--rollback-lr-factor", "0"], "--rollback-lr-factor must be in (0, 1], got 0.0"),
    (["--max-bad-steps", "0"], "--max-bad-steps must be >= 1, got 0"),
    (["--data", ""], "--data is empty: name a directory of shards (or a mixture), or leave it out for the built-in "
                     "corpus"),
])
def test_a_wrong_flag_is_named_as_a_flag_and_alone(argv, message):
    with pytest.raises(UsageError) as e:
        config.parse_args(argv)
    assert str(e.value) == message


def test_only_identifiers_become_flags():
    model, optim = ModelConfig(), OptimConfig()
    assert in_flags("unknown mlp 'x' with smear", model) == "unknown mlp 'x' with smear"  # plain words stay
    assert in_flags("momentum must be in [0, 1)", optim) == "--muon-momentum must be in [0, 1)"
    assert in_flags("the momentum and --muon-momentum-warmup", optim) == "the momentum and --muon-momentum-warmup"
    assert in_flags("lm_head (--head-lr) and head_lr", optim) == "lm_head (--head-lr) and --head-lr"
