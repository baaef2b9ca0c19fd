"""config.py: the generated command line, the start-up checks and the configuration files; and the import
structure of the whole project (no circles, a model.py that knows nothing of the rest)."""

import argparse
import dataclasses
import glob
import json
import os

import pytest

import batch
import config
import loop
import telemetry
from cli import UsageError
from config import Config
from model import ModelConfig
from conftest import TINY_FLAGS
from option import flag_name
from test_structure import import_graph, product_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def all_fields():
    """(section name, section class, field) for every setting of a run."""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            yield section.name, section.default_factory, f


# ----------------------------------------------------------------------------- the generated parser


def test_every_field_has_one_flag_with_help():
    actions = {a.dest: a for a in config.build_parser()._actions}
    flags = [flag for a in actions.values() for flag in a.option_strings]
    assert len(flags) == len(set(flags))
    for section, _, f in all_fields():
        action = actions[f"{section}.{f.name}"]
        assert flag_name(f) in action.option_strings
        assert f.metadata["help"] and f.metadata["help"] in action.help, f.name


def test_every_default_is_written_once_on_its_field():
    """The parser holds no defaults of its own: parsing nothing gives every dataclass default."""
    for action in config.build_parser()._actions:
        if action.dest != "help":
            assert action.default is argparse.SUPPRESS, action.dest
    assert config.parse_args([]) == Config()


def test_the_defaults_are_the_small_default_model():
    cfg = config.parse_args([])
    assert (cfg.model.n_layer, cfg.model.max_seq_len, cfg.optim.name, cfg.optim.lr) == (4, 128, "muon", 6e-3)
    assert (cfg.data.batch_size, cfg.schedule.max_steps, cfg.ckpt.out_dir) == (16, 150, "out")


def test_help_shows_the_default_from_the_field():
    text = config.build_parser().format_help()
    assert "(default: 50)" in text  # --eval-interval and --ckpt-interval
    assert "(default: 1337)" in text


@pytest.mark.parametrize("argv, section, name, value", [
    (["--seq-len", "64"], "model", "max_seq_len", 64),
    (["--tie-embeddings"], "model", "tie_embeddings", True),
    (["--optimizer", "muon"], "optim", "name", "muon"),
    (["--beta2", "0.99"], "optim", "beta2", 0.99),
    (["--no-fused-adamw"], "optim", "fused", False),
    (["--batch-size", "auto", "--total-batch-tokens", "4096"], "data", "batch_size", "auto"),
    (["--fp8-attn", "--fp8", "te"], "fp8", "attn", True),
    (["--no-reshard-after-forward"], "dist", "reshard_after_forward", False),
    (["--resume"], "ckpt", "resume", "on"),
    (["--resume", "auto"], "ckpt", "resume", "auto"),
    (["--overwrite"], "ckpt", "overwrite", True),
    (["--head-dim", "32"], "model", "head_dim", 32),
])
def test_flags_land_in_their_section(argv, section, name, value):
    assert getattr(getattr(config.parse_args(argv), section), name) == value
    assert config.parse_args(argv).optim.betas == (0.7, 0.99 if "--beta2" in argv else 0.95)  # muon's AdamW side


def test_adams_beta1_defaults_to_the_optimizers():
    assert config.parse_args([]).optim.beta1 == 0.7  # muon's AdamW side: docs/recipe.md
    assert config.parse_args(["--optimizer", "adamw"]).optim.beta1 == 0.9
    assert config.parse_args(["--optimizer", "adamw8bit", "--beta1", "0.8"]).optim.beta1 == 0.8


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "x"], "must be an integer or auto"),
    (["--batch-size", "auto"], "needs --total-batch-tokens"),
    (["--fp8", "torchao", "--fp8-recipe", "delayed"], "--fp8-recipe delayed needs --fp8 te, not --fp8 torchao"),
    (["--dist", "fsdp", "--optimizer", "adamw8bit"], "adamw8bit does not support"),
    (["--fp8", "te", "--sample-tokens", "4"], "needs the plain backend's KV cache"),
    (["--keep-ckpts", "0"], "--keep-ckpts must be >= 1"),
    (["--ddp-bucket-mb", "0"], r"--ddp-bucket-mb must be in \(0, 1048576\], got 0"),
    (["--ddp-bucket-mb", "1e300"], "--ddp-bucket-mb must be in"),
    (["--batch-size", "auto", "--total-batch-tokens", "16", "--seq-len", "32"],
     r"--total-batch-tokens 16 is less than one sequence \(--seq-len 32\)"),
    (["--collective-timeout", "0"], r"--collective-timeout must be in \[0.001, 1e\+09\] seconds, got 0$"),
    (["--collective-timeout", "0.0005"], "--collective-timeout must be in"),  # torch's 0 ms
    (["--collective-timeout", "1e14"], "--collective-timeout must be in"),  # timedelta's overflow
    (["--seed", str(2**64)], "--seed must be a 64-bit integer, got"),
    (["--n-layer", str(10**20)], "--n-layer must be a 64-bit integer"),
    (["--n-embd", str(-10**30)], "--n-embd must be a 64-bit integer"),
    (["--activation-dtype", "bf16", "--dtype", "fp32"], "--activation-dtype bf16 .* needs --dtype bf16 .*not fp32$"),
])
def test_contradictions_are_caught_from_the_flags_alone(argv, message):
    with pytest.raises(UsageError, match=message):
        config.parse_args(argv)


# ----------------------------------------------------------------------------- a run's config


def test_the_config_is_not_changed_by_a_run(tmp_path, tiny_data):
    import train

    cfg = config.parse_args(["--data", tiny_data, "--out-dir", str(tmp_path), "--vocab-size", "256",
                             "--n-layer", "1", "--n-embd", "64", "--seq-len", "32", "--batch-size", "4",
                             "--max-steps", "2", "--eval-interval", "1", "--ckpt-interval", "1"])
    before = dataclasses.asdict(cfg)
    run = train.setup(cfg)
    try:
        loop.run_loop(run)
    finally:
        run.close()
    assert dataclasses.asdict(cfg) == before


# ----------------------------------------------------------------------------- the builders


def test_build_model_applies_fp8_and_activation_checkpointing(tiny_data):
    import torch

    import train

    cfg = config.parse_args(["--data", tiny_data, "--vocab-size", "256", "--n-layer", "2", "--n-embd", "64",
                             "--seq-len", "32", "--act-ckpt", "full"])
    model, model_cfg, init = train.build_model(cfg, torch.device("cpu"))
    assert model_cfg is cfg.model and init == "random (seed 1337)"
    assert "every block of 2" in train.memory.describe_activation_checkpointing(model)
    layout = train.build_layout(cfg, model, train.distributed.DistInfo(), torch.device("cpu"), None, None)
    assert layout == batch.BatchLayout(micro_batch=16, seq_len=32, grad_accum=1, world_size=1)


# ----------------------------------------------------------------------------- import structure


def test_config_imports_only_the_homes_of_its_sections():
    """The schema sits near the ground: the modules that act on a setting import it, never the reverse."""
    homes = {section.default_factory.__module__ for section in dataclasses.fields(Config)} - {"config"}
    assert homes == {"model", "optim", "fp8", "sizing"}
    graph = import_graph(product_files())
    assert graph["config"] == homes | {"cli", "atomic", "option", "checks"}  # the ground, and its start-up checks


# ----------------------------------------------------------------------------- configuration files


def test_an_untied_run_resolves_its_embedding_and_head_lrs_and_the_gpt2_presets_stay_tied():
    cfg = config.parse_args(["--adam-lr", "2e-3"])
    assert (cfg.model.tie_embeddings, cfg.optim.embed_lr, cfg.optim.head_lr) == (False, 0.02, 0.004)
    tied = config.parse_args(["--adam-lr", "2e-3", "--tie-embeddings"])
    assert (tied.optim.embed_lr, tied.optim.head_lr) == (None, None)
    dial = config.parse_args(["--depth", "4", "--seq-len", "64"])  # the dial's AdamW-side LR carries them
    assert (dial.optim.embed_lr, dial.optim.head_lr) == (10 * dial.optim.adam_lr, 2 * dial.optim.adam_lr)
    assert config.parse_args(["--preset", "gpt2-124m"]).model.tie_embeddings  # GPT-2 is tied


def test_toml_round_trip_reproduces_the_config(tmp_path):
    """Every field, derived ones included, survives to_toml -> --config; strings with quotes, backslashes,
    non-ASCII text (an emoji beyond the BMP too) and control characters."""
    prompt = 'a "quoted" \\ line\nnaïve 😀\x7f\t'
    cfg = config.parse_args(["--depth", "3", "--sample-prompt", prompt, "--tie-embeddings",
                             "--wandb-tags", "x,y", "--lr", "1e-05", "--batch-size", "8", "--optimizer", "muon"])
    path = tmp_path / "run.toml"
    config.write_config(cfg, str(path))
    assert config.parse_args(["--config", str(path)]) == cfg
    cfg = config.parse_args(["--grad-accum", "3", "--max-steps", "9"])  # the other two alternatives
    config.write_config(cfg, str(path))
    assert config.parse_args(["--config", str(path)]) == cfg


def test_flags_override_the_file_and_the_file_overrides_the_dial(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[size]\ndepth = 12\n[model]\nn_embd = 1024\n[schedule]\nmax_steps = 40\n'
                    '[optim]\nlr = 2e-3\n[data]\nbatch_size = "auto"\ntotal_batch_tokens = 65536\n')
    cfg = config.parse_args(["--config", str(path), "--lr", "1e-3"])
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head) == (12, 1024, 8)  # heads follow the width
    assert (cfg.optim.lr, cfg.schedule.max_steps, cfg.schedule.max_tokens) == (1e-3, 40, 0)
    assert (cfg.data.batch_size, cfg.data.total_batch_tokens) == ("auto", 65536)
    cfg = config.parse_args(["--config", str(path), "--max-tokens", "1000000", "--grad-accum", "2", "--batch-size", "4"])
    assert (cfg.schedule.max_tokens, cfg.data.grad_accum, cfg.data.total_batch_tokens) == (1000000, 2, 0)


@pytest.mark.parametrize("text, message", [
    ("[modle]\nn_layer = 2\n", "'modle' is not a section"),
    ("[model]\nn_layers = 2\n", "unknown key model.n_layers"),
    ("[model]\nn_layer = 2.5\n", "model.n_layer must be int, got 2.5"),
    ("[model]\nn_layer = true\n", "model.n_layer must be int, got True"),
    ("[optim]\nname = \"sgd\"\n", "optim.name must be one of adamw"),
    ("[data]\nbatch_size = \"big\"\n", "data.batch_size must be an integer or auto"),
    ("[model]\nn_layer = \n", "--config"),  # not TOML
    ("[schedule]\nmax_steps = 5\nmax_tokens = 100\n", "give --max-tokens or --max-steps, not both"),
    ("[model]\nn_layer = 0\n", "--n-layer must be positive"),
    ("[model]\nn_layer = 100000000000000000000\n", r"--n-layer must be a 64-bit integer, got"),
    ("[size]\ndepth = 100000000000000000000\n", "--depth must be a 64-bit integer"),
    ("[size]\ndepth = 4\ntokens_per_param = 1e-30\n", r"--tokens-per-param must be in \[0.001, 1e\+06\]"),
])
def test_bad_config_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=message) as e:
        config.parse_args(["--config", str(path)])
    assert "\n" not in str(e.value)


def test_a_missing_config_file_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        config.parse_args(["--config", str(tmp_path / "nope.toml")])


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.toml"))))
def test_example_configs_parse(path):
    cfg = config.parse_args(["--config", path])
    assert config.read_config_file(path)  # not empty
    assert cfg.model.n_layer >= 4


def test_example_configs_exist():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "configs", "*.toml"))}
    assert {"cpu-default.toml", "gpt2-124m-h100.toml", "gpt2-350m-fsdp-8gpu.toml"} <= names


def test_cpu_default_config_is_the_default_run():
    assert config.parse_args(["--config", os.path.join(REPO, "configs", "cpu-default.toml")]) == Config()


def test_toml_keys_may_be_spelled_as_their_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nseq_len = 64\nn-layer = 3\n[optim]\noptimizer = "adamw"\nadam_eps = 1e-6\n'
                    '[fp8]\nfp8 = "off"\n')
    cfg = config.parse_args(["--config", str(path)])
    assert (cfg.model.max_seq_len, cfg.model.n_layer, cfg.optim.name, cfg.optim.eps) == (64, 3, "adamw", 1e-6)
    path.write_text("[model]\nmax_seq_len = 64\nseq_len = 32\n")
    with pytest.raises(UsageError, match=r"model.max_seq_len and model.seq_len set the same field$"):
        config.parse_args(["--config", str(path)])


@pytest.mark.parametrize("section", [s.name for s in dataclasses.fields(Config)])
def test_a_flag_spelling_is_no_other_fields_name(section):
    cls = next(s.default_factory for s in dataclasses.fields(Config) if s.name == section)
    names = config.key_names(cls)
    assert all(names[f.name] is f for f in dataclasses.fields(cls))


@pytest.mark.parametrize("text, message", [
    ("[model]\nn_layers = 2\n", r"unknown key model.n_layers; did you mean model.n_layer \(--n-layer\)\?$"),
    ("[model]\nmax_seqlen = 2\n", r"unknown key model.max_seqlen; did you mean model.max_seq_len \(--seq-len\)\?$"),
    ("[model]\nlr = 1e-3\n", r"unknown key model.lr; did you mean optim.lr \(--lr\)\?$"),  # the wrong section
    ("[optim]\noptimiser = \"adamw\"\n", r"unknown key optim.optimiser; did you mean optim.name \(--optimizer\)\?$"),
    ("lr = 1e-3\n", r"'lr' is not a section; the sections are data, .*, log; did you mean optim.lr \(--lr\)\?$"),
    ("[modle]\nn_layer = 2\n", r"'modle' is not a section; the sections are .*; did you mean \[model\]\?$"),
    ("[model]\nxyzzy = 2\n", r"unknown key model.xyzzy$"),
])
def test_an_unknown_toml_key_names_the_closest_key_and_its_flag(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        config.parse_args(["--config", str(path)])


def test_a_config_file_holds_the_runs_settings_not_its_invocation(tmp_path):
    """A resumed run's OUT/config.toml repeats the run: it does not resume, overwrite or waive a resume's checks."""
    cfg = config.parse_args(["--resume", "--allow-data-change", "--allow-lr-rewarm", "--lr", "1e-3"])
    path = tmp_path / "config.toml"
    config.write_config(cfg, str(path))
    assert set(config.read_config_file(str(path))).isdisjoint(config.INVOCATION_KEYS)
    repeat = config.parse_args(["--config", str(path)])
    assert repeat.optim.lr == 1e-3 and (repeat.ckpt, repeat.data.allow_data_change) == (Config().ckpt, False)
    assert not repeat.schedule.allow_lr_rewarm


def train_losses(out_dir) -> list[float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["train_loss"] for line in f]


def test_a_run_repeats_from_its_config_toml_bit_for_bit_even_after_a_resume(tiny_data, tmp_path, capsys):
    """`--config OUT/config.toml --out-dir NEW_DIR` repeats a run, also when the file was written by a resume of it
    (it does not carry --resume); without --out-dir the refusal says to add it."""
    import train

    first, written = tmp_path / "first", str(tmp_path / "first" / "config.toml")
    train.main(["--data", tiny_data, "--out-dir", str(first), *TINY_FLAGS, "--device", "cpu", "--max-steps", "3",
                "--ckpt-interval", "2", "--eval-interval", "0"])
    losses = train_losses(first)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # the file names its own run's directory
        train.main(["--config", written])
    assert refused.value.code == 2 and capsys.readouterr().err == (
        f"error: --out-dir {first} already holds a run (ckpt_00000002.pt, ckpt_00000003.pt, curves.png, ...): add "
        f"--out-dir NEW_DIR to repeat --config {written} in a new directory, or pass --resume to continue it, "
        "--overwrite to replace it\n")
    for name in ("ckpt_00000003.pt", "ckpt_00000003.pt.sha256"):  # as if killed before its last checkpoint
        os.remove(first / name)
    train.main(["--config", written, "--resume"])  # redoes step 3, and writes config.toml again
    train.main(["--config", written, "--out-dir", str(tmp_path / "again")])  # fresh: nothing to resume there
    assert len(losses) == 3 and train_losses(first) == losses and train_losses(tmp_path / "again") == losses


def test_resume_check_refuses_shape_and_optimizer_changes_and_names_the_rest():
    saved = config.to_dict(config.parse_args([]))
    assert config.check_resume(saved, config.parse_args(["--resume"])) == []  # invocation keys are not compared
    assert config.check_resume(saved, config.parse_args(["--lr", "1e-3", "--max-steps", "300"])) == [
        "optim.lr 0.006 -> 0.001", "schedule.max_steps 150 -> 300"]
    assert config.check_resume(saved, config.parse_args(["--seq-len", "256"])) == ["model.max_seq_len 128 -> 256"]
    with pytest.raises(UsageError, match="model.n_embd 128 -> 256"):
        config.check_resume(saved, config.parse_args(["--n-embd", "256"]))
    del saved["size"]  # a checkpoint from before the size dial
    plain = config.parse_args([])
    assert config.check_resume(saved, dataclasses.replace(plain, size=dataclasses.replace(plain.size,
                                                                                          tokens_per_param=10.0))) == []
    # a checkpoint that recorded a relative --data, resumed with it absolute (train.setup) or given another way
    here = config.parse_args(["--data", os.getcwd()])
    assert config.check_resume({**saved, "data": {**saved["data"], "data": "."}}, here) == []
    assert config.check_resume({**saved, "data": {**saved["data"], "data": "elsewhere"}}, here) == [
        f"data.data 'elsewhere' -> {os.getcwd()!r}"]


def test_tokens_per_param_where_the_dial_does_not_size_the_run_is_refused(tmp_path):
    for argv, problem in [([], "give --depth or --preset with it"),
                          (["--depth", "2", "--max-tokens", "9"], "--tokens-per-param and --max-tokens both set")]:
        with pytest.raises(UsageError, match=problem):
            config.parse_args(["--tokens-per-param", "5", *argv])
    assert config.parse_args(["--depth", "2", "--tokens-per-param", "5"]).size.tokens_per_param == 5
    config.write_config(config.parse_args(["--depth", "2"]), str(tmp_path / "run.toml"))  # records its max_tokens
    with pytest.raises(UsageError, match="--tokens-per-param: the --config file sets max_tokens, the run's length"):
        config.parse_args(["--config", str(tmp_path / "run.toml"), "--tokens-per-param", "40"])


def test_resume_does_not_call_the_same_out_dir_given_another_way_a_change(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = config.to_dict(config.parse_args(["--out-dir", str(tmp_path / "a")]))
    assert config.check_resume(saved, config.parse_args(["--out-dir", "a"])) == []
    moved = config.check_resume(saved, config.parse_args(["--out-dir", "b"]))
    assert moved == [f"ckpt.out_dir {str(tmp_path / 'a')!r} -> 'b'"]


def test_resume_may_change_init_only_model_fields():
    saved = config.to_dict(config.parse_args([]))
    assert config.check_resume(saved, config.parse_args(["--no-zero-init-proj"])) == [
        "model.zero_init_proj True -> False"]


def test_every_problem_with_the_flags_is_reported_at_once(monkeypatch):
    monkeypatch.setattr(telemetry, "wandb_key_present", lambda: False)
    with pytest.raises(UsageError) as e:
        config.parse_args(["--batch-size", "auto", "--device", "cpu", "--warmup", "-1", "--wandb", "--wandb-mode",
                           "online"], machine_checks=(telemetry.wandb_problems,))
    text = str(e.value)
    assert text.startswith("3 problems: (1) --warmup must be >= 0") and "\n" not in text
    assert "needs --total-batch-tokens" in text and "wandb" in text
    with pytest.raises(UsageError, match="--target-gpu names the GPU for --estimate-memory"):
        config.parse_args(["--target-gpu", "h100"])


def test_a_zero_seq_len_with_the_size_dial_is_a_usage_error():
    with pytest.raises(UsageError, match="--seq-len must be >= 1"):
        config.parse_args(["--depth", "4", "--seq-len", "0"])


def test_the_shards_vocabulary_is_settled_with_the_flags_for_the_dial_and_the_config_file(tmp_path):
    import mixture
    from shards import DATA_RECORD
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / DATA_RECORD).write_text(json.dumps({"tokenizer": "tokenizer.json", "n_vocab": 151_669}))
    parse = lambda *argv: config.parse_command_line(list(argv), data_vocab=mixture.data_vocab)[0]  # noqa: E731
    cfg, gpt2 = parse("--depth", "4", "--data", str(qwen)), parse("--depth", "4")
    assert (cfg.model.vocab_size, gpt2.model.vocab_size) == (151_669, 50_257)
    # the dial's horizon (20 tokens a parameter) counts the embedding and the untied head of the shards' vocabulary
    vocab_params = 2 * 256 * (151_680 - 50_304)
    assert cfg.schedule.max_tokens - gpt2.schedule.max_tokens == pytest.approx(20 * vocab_params, rel=0.01)
    assert parse("--data", f"a={qwen}:1,b={tmp_path / 'none'}:1").model.vocab_size == 151_669
    assert parse("--data", str(qwen), "--vocab-size", "1000").model.vocab_size == 1000  # check_vocab refuses it
    assert config.parse_args(["--data", str(qwen)]).model.vocab_size == 50_257  # bench scripts: the flags alone
    config.stage_config(cfg, str(tmp_path / "config.toml"), False, {})
    assert "vocab_size = 151669" in (tmp_path / "config.toml.tmp").read_text()



def test_model_flags_with_from_hf_are_refused_naming_each():
    """The directory gives the model: a model or size-dial flag beside --from-hf would be overridden unsaid."""
    assert config.from_hf_conflicts({"model.n_layer": 3, "model.max_seq_len": 64, "size.depth": 4}, "hf") == [
        "--n-layer: --from-hf hf gives the model; leave --n-layer out",
        "--depth: --from-hf hf gives the model; leave --depth out"]
    assert config.from_hf_conflicts({"model.n_layer": 3}, None) == []
    with pytest.raises(UsageError, match=r"^--n-layer: --from-hf hf gives the model; leave --n-layer out$"):
        config.parse_args(["--from-hf", "hf", "--n-layer", "3"])


def test_a_from_hf_run_resumes_though_its_checkpoint_recorded_another_shape():
    """Runs started before --from-hf gave the flags the directory's model recorded the default shape; the
    weights' own record (checkpoint.config_changes) is what the resume checks the shape against."""
    saved = config.to_dict(config.parse_args(["--from-hf", "hf"]))
    exported = ModelConfig(n_layer=2, n_embd=64, n_head=4, n_kv_head=2)
    now = dataclasses.replace(config.parse_args(["--from-hf", "hf"]), model=exported)
    assert any(change.startswith("model.n_layer") for change in config.check_resume(saved, now))
    plain = dataclasses.replace(config.parse_args([]), model=exported)
    with pytest.raises(UsageError, match="cannot change within a run: model"):
        config.check_resume(config.to_dict(config.parse_args([])), plain)


@pytest.mark.parametrize("flags, message", [
    (["--sample-tokens", "5"], "--sample-tokens runs at evals: it needs --eval-interval > 0"),
    (["--early-stop-patience", "1"], "--early-stop-patience counts at evals: it needs --eval-interval > 0")])
def test_a_setting_that_acts_at_evals_is_refused_without_them(flags, message):
    with pytest.raises(UsageError, match=message):
        config.parse_args([*flags, "--eval-interval", "0"])
    config.parse_args(flags)  # with evals, as by default
