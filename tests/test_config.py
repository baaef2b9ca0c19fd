"""config.py: the generated command line, the start-up checks and the derived quantities; and the import
structure of the whole project (no circles, a model.py that knows nothing of the rest)."""

import argparse
import ast
import dataclasses
import glob
import os

import pytest

import config
from cli import UsageError
from config import BatchLayout, Config

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
    assert (cfg.model.n_layer, cfg.model.max_seq_len, cfg.optim.lr) == (4, 128, 3e-3)
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
    with open(os.path.join(REPO, "train.py")) as f:
        assert sum(1 for _ in f) <= 400
