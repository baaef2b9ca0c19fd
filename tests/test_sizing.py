"""sizing.py: the --depth dial and the presets, as pure functions, and as the flags resolve them."""

import pytest

import config
import sizing
from cli import UsageError
from model import GPT
from sizing import param_count


@pytest.mark.parametrize("name", list(sizing.PRESETS))
def test_presets_match_the_published_gpt2_sizes(name):
    """Within 10% of GPT-2's parameter counts with this architecture (GQA, SwiGLU, tied embedding), the bigram
    table aside (a lookup of the hash's size: dial_params)."""
    model = config.parse_args(["--preset", name]).model
    params = sizing.dial_params(model)
    assert abs(params / sizing.PUBLISHED_PARAMS[name] - 1) < 0.10
    assert param_count(model) - params == 50304 * model.n_embd


def test_param_count_is_the_built_models():
    cfg = config.parse_args(["--depth", "3", "--max-steps", "1"]).model
    assert param_count(cfg) == GPT(cfg).num_params()


@pytest.mark.parametrize("depth, width, head_dim, heads, kv_heads", [
    (2, 128, 64, 2, 1),      # small: head_dim 64
    (3, 192, 64, 3, 3),      # an odd head count keeps full multi-head attention
    (8, 512, 128, 4, 2),     # from width 512: head_dim 128
    (9, 640, 128, 5, 5),     # 576 rounded up to a multiple of 128
    (12, 768, 128, 6, 3),    # GPT-2 small's width
])
def test_shape_rules(depth, width, head_dim, heads, kv_heads):
    values = {key: value for key, (value, _) in sizing.shape(depth, {}).items()}
    assert values == {"model.n_layer": depth, "model.n_embd": width, "model.head_dim": head_dim,
                      "model.n_head": heads, "model.n_kv_head": kv_heads}


def test_derived_training_settings():
    values = {key: value for key, (value, _) in sizing.derive(12, {"model.tie_embeddings": True}).items()}
    params = sizing.dial_params(config.parse_args(["--preset", "gpt2-124m"]).model)  # depth 12, tied as GPT-2
    assert (values["optim.lr"], values["optim.adam_lr"]) == (0.00245, 0.00122)  # Muon: x (128/768)^0.5
    adamw = {key: value for key, (value, _) in sizing.derive(12, {"optim.name": "adamw"}).items()}
    assert adamw["optim.lr"] == pytest.approx(3e-3 * 128 / 768) and "optim.adam_lr" not in adamw
    assert values["model.ffn_dim"] == 2048
    assert sizing.derive(12, {})["model.ffn_dim"] == (2048, "8/3·n_embd")
    assert sizing.derive(12, {"model.mlp": "relu2"})["model.ffn_dim"] == (3072, "3/2 of SwiGLU's 8/3·n_embd")
    assert values["schedule.max_tokens"] == round(20 * params)
    # 0.292 * (6 * 116.5M * 2.33B)^0.3271 = 2.8e5 tokens -> 2^18
    assert values["data.total_batch_tokens"] == 2**18


def test_batch_is_a_power_of_two_in_whole_micro_batches():
    assert sizing.compute_optimal_batch(10**8, 2 * 10**9, 2048) == 2**18
    assert sizing.compute_optimal_batch(10**8, 2 * 10**9, 3000) % 3000 == 0
    assert sizing.compute_optimal_batch(10, 10, 4096) == 4096  # never below one micro-batch


def test_explicit_values_override_and_steer_the_derivation():
    cfg = config.parse_args(["--depth", "12", "--n-embd", "1024", "--lr", "1e-3", "--max-steps", "7"])
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.n_kv_head) == (12, 1024, 8, 4)
    assert cfg.optim.lr == 1e-3
    assert (cfg.schedule.max_steps, cfg.schedule.max_tokens) == (7, 0)  # --max-steps replaces the horizon
    cfg = config.parse_args(["--depth", "4", "--grad-accum", "2"])
    assert (cfg.data.grad_accum, cfg.data.total_batch_tokens) == (2, 0)


def test_preset_is_a_depth_plus_overrides():
    cfg = config.parse_args(["--preset", "gpt2-350m"])
    assert (cfg.size.depth, cfg.model.n_layer, cfg.model.n_embd, cfg.model.max_seq_len) == (24, 24, 1024, 1024)
    assert config.parse_args(["--preset", "gpt2-350m", "--seq-len", "512"]).model.max_seq_len == 512
    assert sizing.preset_shape("gpt2-1.5b").n_head == 25


def test_without_the_dial_nothing_is_derived():
    assert config.parse_args([]) == config.Config()


def test_describe_names_each_value_and_its_source():
    cfg = config.parse_args(["--preset", "gpt2-350m", "--lr", "1e-3", "--max-steps", "10"])
    text = sizing.describe(cfg.size, config.flat_values(cfg))
    assert text.startswith("preset gpt2-350m, depth 24: ")
    assert "n_embd 1,024 (preset)" in text and "lr 0.001 (given)" in text and "n_head 8 (n_embd/head_dim)" in text
    assert "max_tokens not derived" in text
    plain = config.parse_args(["--n-embd", "512", "--adam-lr", "1e-3"])  # no dial: the LRs by width, as the dial's
    text = sizing.describe(plain.size, config.flat_values(plain))
    assert text.startswith("off (shape from the model flags; lr 0.003 (0.006·(128/n_embd)^0.5; measured")
    assert "adam_lr 0.001 (given), embed_lr 0.01 (10·adam_lr), head_lr 0.002 (2·adam_lr)" in text


@pytest.mark.parametrize("argv, message", [
    (["--depth", "0"], "--depth must be >= 1"),
    (["--depth", str(10**20)], r"--depth must be a 64-bit integer, got"),
    (["--preset", "gpt2-7b"], "invalid choice"),
    *((["--depth", "4", "--tokens-per-param", value], r"--tokens-per-param must be in \[0.001, 1e\+06\], got")
      for value in ("0", "-1", "inf", "nan", "1e300", "1e-30")),
    # The sizes the dial computes with are checked before it runs: these divided by zero, or went negative.
    (["--depth", "4", "--n-embd", "0"], "--n-embd must be >= 1, got 0"),
    (["--depth", "4", "--n-embd", "-64"], "--n-embd must be >= 1, got -64"),
    (["--preset", "gpt2-124m", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--depth", "4", "--n-embd", str(10**30)], "--n-embd must be a 64-bit integer"),
])
def test_bad_dial_values_are_refused(argv, message):
    with pytest.raises(UsageError, match=message) as e:
        config.parse_args(argv)
    assert "\n" not in str(e.value)


def test_the_dial_computes_at_the_ends_of_its_ranges():
    """The largest sizes a flag takes stay within float range, and the smallest horizon is one token, not 0
    (max_tokens' "unset")."""
    huge = config.parse_args(["--depth", str(2**63 - 1), "--n-embd", str(2**63 - 1), "--tokens-per-param", "1e6"])
    assert huge.schedule.max_tokens > 2**200
    tiny = config.parse_args(["--depth", "1", "--n-embd", "1", "--head-dim", "2", "--n-head", "1", "--ffn-dim", "1",
                              "--vocab-size", "1", "--tokens-per-param", "1e-3"])
    assert tiny.schedule.max_tokens == 1


def test_describe_derives_from_the_runs_own_inputs():
    """The optimizer, --tokens-per-param and --seq-len feed the derivation: values that follow from them are
    shown with their rule, not as given."""
    cfg = config.parse_args(["--depth", "3", "--optimizer", "adamw", "--tokens-per-param", "10", "--seq-len", "100"])
    text = sizing.describe(cfg.size, config.flat_values(cfg))
    assert "(given)" not in text and "lr 0.002 (0.003·128/n_embd)" in text and "10/param" in text
    muon = config.parse_args(["--depth", "3"])  # Muon's rule names the sweep it rests on
    rule = "lr 0.0049 (0.006·(128/n_embd)^0.5; measured at widths 128-512 on two corpora, docs/sizing.md)"
    assert rule in sizing.describe(muon.size, config.flat_values(muon))


def test_the_dials_batch_leaves_a_short_run_its_steps():
    assert sizing.batch_for_budget(131_072, 1_000_000, 1024) == 6 * 1024  # 6,666 tokens a step for 150 steps
    assert sizing.batch_for_budget(131_072, 100_000_000, 1024) == 131_072  # the fit leaves 762 steps
    assert sizing.batch_for_budget(131_072, 1_000, 1024) == 1024  # at least one micro-batch
    fit, _ = sizing.derive(6, {"model.max_seq_len": 64}, micro_batch=16)["data.total_batch_tokens"]
    batch, rule = sizing.derive(6, {"model.max_seq_len": 64, "schedule.max_tokens": 2_000_000},
                                micro_batch=16)["data.total_batch_tokens"]
    assert batch == 2_000_000 // 150 // 1024 * 1024 < fit
    assert rule.startswith("DeepSeek's fit ") and rule.endswith(", capped at max_tokens/150 steps")


@pytest.mark.parametrize("argv", [["--preset", "gpt2-124m"], ["--depth", "4", "--max-steps", "200"], []])
def test_every_run_decays_over_the_same_fraction_with_or_without_the_dial(argv):
    """A decay that grows with the run's steps did not hold on both corpora (docs/sizing.md): the dial derives
    none, and every run takes --decay-frac's default unless it is given."""
    cfg = config.parse_args(argv)
    assert cfg.schedule.decay_frac == config.ScheduleConfig.decay_frac == 0.2
    assert "decay_frac" not in sizing.describe(cfg.size, config.flat_values(cfg))
    assert config.parse_args([*argv, "--decay-frac", "0.4"]).schedule.decay_frac == 0.4


def test_a_run_too_short_for_one_micro_batch_a_step_gets_a_smaller_micro_batch():
    """131,072 tokens at seq 256 would be 32 steps of the default 16 sequences: the dial gives 3 sequences a
    step (171 steps), unless the batch is the user's."""
    short = ["--depth", "4", "--seq-len", "256", "--max-tokens", "131072"]
    cfg = config.parse_args(short)
    assert (cfg.data.batch_size, cfg.data.grad_accum, cfg.data.total_batch_tokens) == (3, 1, 768)
    assert config.parse_args([*short, "--batch-size", "16"]).data.total_batch_tokens == 4096  # one micro-batch
    assert config.parse_args([*short, "--grad-accum", "2"]).data.batch_size == 16  # the batch was given
    long = config.parse_args(["--depth", "4", "--seq-len", "256", "--max-tokens", "2000000"])
    assert (long.data.batch_size, long.data.total_batch_tokens) == (16, 12288)  # the cap is whole micro-batches


def test_the_dial_runs_beside_flags_whose_default_is_zero():
    import config

    cfg = config.parse_args(["--depth", "4", "--n-embd", "256"])  # --value-embeds 0, --logit-softcap 0: off
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.value_embeds) == (4, 256, 0)
