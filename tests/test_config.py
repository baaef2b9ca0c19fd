"""config.py: the generated command line, the start-up checks and the derived quantities; and the import
structure of the whole project (no circles, a model.py that knows nothing of the rest)."""

import argparse
import ast
import dataclasses
import glob
import os
import re

import pytest

import config
from cli import UsageError
from config import BatchLayout, Config
from optim import lr_multiplier

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
        assert config.flag_name(f) in action.option_strings
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
    (["--untied"], "model", "tie_embeddings", False),
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
    assert config.parse_args(argv).optim.betas == (0.9, 0.99 if "--beta2" in argv else 0.95)


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "x"], "must be an integer or auto"),
    (["--batch-size", "auto"], "needs --total-batch-tokens"),
    (["--fp8", "torchao", "--fp8-recipe", "delayed"], "apply to --fp8 te only"),
    (["--dist", "fsdp", "--optimizer", "adamw8bit"], "adamw8bit does not support"),
    (["--fp8", "te", "--sample-tokens", "4"], "needs the plain backend's KV cache"),
    (["--keep-ckpts", "0"], "--keep-ckpts must be >= 1"),
    (["--ddp-bucket-mb", "0"], "--ddp-bucket-mb must be positive"),
    (["--n-layer", str(10**20)], "--n-layer must be a 64-bit integer"),
    (["--n-embd", str(-10**30)], "--n-embd must be a 64-bit integer"),
])
def test_contradictions_are_caught_from_the_flags_alone(argv, message):
    with pytest.raises(UsageError, match=message):
        config.parse_args(argv)


# ----------------------------------------------------------------------------- derived quantities


def test_batch_layout_is_the_one_tokens_per_step():
    cfg = config.parse_args(["--batch-size", "4", "--seq-len", "32", "--grad-accum", "3"])
    layout = config.batch_layout(cfg, world_size=2)
    assert layout == BatchLayout(micro_batch=4, seq_len=32, grad_accum=3, world_size=2)
    assert layout.tokens_per_step == 4 * 32 * 3 * 2 and layout.sequences_per_rank == 12


def test_a_smaller_micro_batch_keeps_the_global_batch():
    layout = BatchLayout(micro_batch=8, seq_len=16, grad_accum=2, world_size=1)
    smaller = layout.with_micro_batch(4)
    assert (smaller.micro_batch, smaller.grad_accum) == (4, 4)
    assert smaller.tokens_per_step == layout.tokens_per_step


def test_auto_batch_layout_derives_accumulation_from_the_probed_size():
    cfg = config.parse_args(["--batch-size", "auto", "--total-batch-tokens", "4096", "--seq-len", "64"])
    assert config.per_rank_sequences(cfg, world_size=2) == 32
    assert config.batch_layout(cfg, world_size=2, micro_batch=8).grad_accum == 4


def test_the_config_is_not_changed_by_a_run(tmp_path, tiny_data):
    import train

    cfg = config.parse_args(["--data", tiny_data, "--out-dir", str(tmp_path), "--vocab-size", "256",
                             "--n-layer", "1", "--n-embd", "64", "--seq-len", "32", "--batch-size", "4",
                             "--max-steps", "2", "--eval-interval", "1", "--ckpt-interval", "1"])
    before = dataclasses.asdict(cfg)
    run = train.setup(cfg)
    try:
        train.run_loop(run)
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
    assert layout == BatchLayout(micro_batch=16, seq_len=32, grad_accum=1, world_size=1)


# ----------------------------------------------------------------------------- import structure


def project_imports() -> dict[str, set[str]]:
    """{module: the project's top-level modules it imports}, read with ast from every file at the root."""
    files = sorted(glob.glob(os.path.join(REPO, "*.py")))
    modules = {os.path.basename(f)[:-3] for f in files}
    graph = {}
    for path in files:
        names = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        name = os.path.basename(path)[:-3]
        graph[name] = (names & modules) - {name}
    return graph


def test_no_import_circle():
    graph = project_imports()
    done, on_path = set(), []

    def visit(module):
        assert module not in on_path, "import circle: " + " -> ".join(on_path[on_path.index(module):] + [module])
        if module in done:
            return
        on_path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_model_imports_nothing_of_the_project_nor_transformer_engine():
    assert project_imports()["model"] == set()
    assert "transformer_engine" not in open(os.path.join(REPO, "model.py")).read()


def test_train_is_a_thin_file():
    """train.py wires the components and runs the loop; its size grows with the loop's decisions (checkpoint
    before eval, rollback, the out-of-memory retry), never with a component's own code."""
    with open(os.path.join(REPO, "train.py")) as f:
        assert sum(1 for _ in f) <= 450


# ----------------------------------------------------------------------------- configuration files


def test_toml_round_trip_reproduces_the_config(tmp_path):
    """Every field, derived ones included, survives to_toml -> --config; strings with quotes, backslashes and
    non-ASCII text too."""
    cfg = config.parse_args(["--depth", "3", "--sample-prompt", 'a "quoted" \\ line\nnaïve', "--untied",
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
    ("[model]\nn_layer = 0\n", "n_layer must be positive"),
    ("[model]\nn_layer = 100000000000000000000\n", r"--n-layer must be a 64-bit integer, in \[-2\*\*63, 2\*\*63\)"),
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


def test_resume_check_refuses_shape_and_optimizer_changes_and_names_the_rest():
    saved = config.to_dict(config.parse_args([]))
    assert config.check_resume(saved, config.parse_args(["--resume"])) == []  # invocation keys are not compared
    assert config.check_resume(saved, config.parse_args(["--lr", "1e-3", "--max-steps", "300"])) == [
        "optim.lr 0.006 -> 0.001", "schedule.max_steps 150 -> 300"]
    assert config.check_resume(saved, config.parse_args(["--seq-len", "256"])) == ["model.max_seq_len 128 -> 256"]
    with pytest.raises(UsageError, match="model.n_embd 128 -> 256"):
        config.check_resume(saved, config.parse_args(["--n-embd", "256"]))
    del saved["size"]  # a checkpoint from before the size dial
    assert config.check_resume(saved, config.parse_args(["--tokens-per-param", "10"])) == []


def test_resume_may_change_init_only_model_fields():
    saved = config.to_dict(config.parse_args([]))
    assert config.check_resume(saved, config.parse_args(["--zero-init-proj"])) == [
        "model.zero_init_proj False -> True"]


def test_resume_at_another_world_size_derives_grad_accum_or_refuses():
    cfg = config.parse_args(["--batch-size", "4", "--seq-len", "32"])
    saved = {"batch_tokens": 256, "world_size": 2, "train_config": config.to_dict(cfg)}
    notes = []
    one_rank = config.batch_layout(cfg, world_size=1)
    assert config.resume_layout(cfg, one_rank, saved, notes.append).grad_accum == 2
    assert "grad accumulation 1 -> 2 keeps the global batch of 256 tokens/step" in notes[0]
    with pytest.raises(UsageError, match="not a whole number of micro-steps of 384 tokens"):
        config.resume_layout(cfg, config.batch_layout(cfg, world_size=3), saved, notes.append)
    # The same world size, a checkpoint that predates batch_tokens, or a batch changed on purpose: as asked.
    assert config.resume_layout(cfg, one_rank, {**saved, "world_size": 1}, notes.append) == one_rank
    assert config.resume_layout(cfg, one_rank, {"train_config": saved["train_config"]}, notes.append) == one_rank
    bigger = config.parse_args(["--batch-size", "4", "--seq-len", "32", "--grad-accum", "4"])
    layout = config.batch_layout(bigger, world_size=1)
    assert config.resume_layout(bigger, layout, saved, notes.append) == layout
    assert len(notes) == 1


def lr_on_resume(saved_flags, flags, step, lr_scale=1.0, **meta):
    """config.resume_lr for the checkpoint at `step` of a run with saved_flags (its last LR multiplier as the
    Checkpointer records it), resumed with flags."""
    saved = config.parse_args(saved_flags)
    s = saved.schedule
    multiplier = lr_scale * lr_multiplier(step - 1, s.max_steps, s.warmup, s.schedule, s.min_lr_ratio, s.decay_frac)
    meta = {"step": step, "lr_multiplier": multiplier, "lr_scale": lr_scale, "train_config": config.to_dict(saved),
            **meta}
    cfg = config.parse_args(flags)
    return config.resume_lr(cfg, meta, cfg.schedule.max_steps)


def test_a_resume_that_changes_the_lr_schedule_says_what_it_does_and_refuses_a_rewarm():
    extended = "the LR goes from 0.0006 at the checkpoint (step 20) to 0.00384 at the next step"
    with pytest.raises(UsageError, match=f"^--resume: {re.escape(extended)}, up again after its decay had begun"):
        lr_on_resume(["--max-steps", "20"], ["--max-steps", "24"], 20)  # a finished WSD run, 10% of its peak
    assert lr_on_resume(["--max-steps", "20"], ["--max-steps", "24", "--allow-lr-rewarm"], 20) == f"note: {extended}"
    with pytest.raises(UsageError, match="after its decay had begun"):  # cosine, halfway down, made longer
        lr_on_resume(["--schedule", "cosine", "--max-steps", "100"], ["--schedule", "cosine", "--max-steps", "150"], 60)
    with pytest.raises(UsageError, match="after its decay had begun"):  # a higher peak, mid-decay
        lr_on_resume(["--max-steps", "20"], ["--max-steps", "20", "--lr", "2e-2"], 18)
    # Told, not refused: in the warm-up, in the stable phase (a new peak there is no re-warm), after a rollback
    # halved the LR, a lower LR mid-decay, and a rise within rounding.
    assert lr_on_resume(["--max-steps", "2"], ["--max-steps", "3"], 2) == (
        "note: the LR goes from 0.0008 at the checkpoint (step 2) to 0.0012 at the next step")
    assert lr_on_resume(["--max-steps", "100"], ["--max-steps", "200", "--lr", "1e-2"], 50) == (
        "note: the LR goes from 0.006 at the checkpoint (step 50) to 0.01 at the next step")
    assert lr_on_resume(["--max-steps", "100"], ["--lr", "1e-2"], 50, lr_scale=0.5).endswith(
        "from 0.003 at the checkpoint (step 50) to 0.005 at the next step")
    assert lr_on_resume(["--max-steps", "20"], ["--max-steps", "24", "--lr", "5e-4"], 20).endswith(
        "to 0.00032 at the next step")
    assert not config.is_rewarm(20, 15, 0.1, 6e-4, 1.005 * 6e-4) and config.is_rewarm(20, 15, 0.1, 6e-4, 6.1e-4)
    # Nothing the LR depends on changed, or a checkpoint from before the multiplier was recorded: nothing to say.
    assert lr_on_resume(["--max-steps", "20"], ["--max-steps", "20", "--eval-interval", "5"], 20) is None
    assert lr_on_resume(["--max-steps", "20"], ["--max-steps", "24"], 20, lr_multiplier=None) is None


def test_every_problem_with_the_flags_is_reported_at_once():
    with pytest.raises(UsageError) as e:
        config.parse_args(["--batch-size", "auto", "--device", "cpu", "--warmup", "-1"], check_machine=True)
    text = str(e.value)
    assert text.startswith("3 problems: (1) --warmup must be >= 0") and "\n" not in text
    assert "needs --total-batch-tokens" in text and "needs CUDA" in text
    with pytest.raises(UsageError, match="--target-gpu names the GPU for --estimate-memory"):
        config.parse_args(["--target-gpu", "h100"])


def test_wandb_online_without_a_key_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(UsageError, match="--wandb-mode online needs a W&B API key"):
        config.parse_args(["--wandb", "--wandb-mode", "online"], check_machine=True)
    assert config.parse_args(["--wandb", "--wandb-mode", "online"]).log.wandb  # reading a config is not starting it
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert config.parse_args(["--wandb", "--wandb-mode", "online"], check_machine=True).log.wandb_mode == "online"


def test_a_zero_seq_len_with_the_size_dial_is_a_usage_error():
    with pytest.raises(UsageError, match="--seq-len must be >= 1"):
        config.parse_args(["--depth", "4", "--seq-len", "0"])
