"""The run's settings: the sections' dataclasses, the generated parser, TOML files, checks of the flags alone.

    cfg = parse_args(["--n-layer", "12", "--lr", "6e-4"])    # -> Config, validated
    cfg.model.n_layer, cfg.optim.lr, cfg.schedule.warmup      # one section per concern

A field's default and help text are written once, on the field (option.option); its flag is generated from
it (`--n-layer` for `n_layer`, or the field's metadata "flag"), with the default appended to the help. The
sections of the library modules live with them (model.ModelConfig, optim.OptimConfig, fp8.FP8Config,
sizing.SizeConfig), so that code which uses a model or an optimizer without train.py gets the same defaults;
the sections only a training run has live here. This file is the schema: it imports only the sections' homes
and the ground below them, and the modules that act on a setting import from here.

Everything that can be checked from the flags alone is checked (checks.validate) before anything is built; the
quantities derived from several flags (grad accumulation, tokens per step, max steps) are defined once, in
batch.py. A Config is not changed after start-up.
"""

import argparse
import dataclasses
import difflib
import hashlib
import json
import os
import tomllib
import typing
from dataclasses import dataclass, field

import checks
import optim
import sizing
from atomic import write_synced
from cli import ArgumentParser, UsageError, int_or_auto
from fp8 import FP8Config
from model import INIT_ONLY_FIELDS, ModelConfig
from optim import OptimConfig
from option import flag_name, option
from sizing import SizeConfig

PROFILE_WAIT, PROFILE_ACTIVE = 5, 3  # torch.profiler: steps skipped, then steps traced (telemetry.py)


# ----------------------------------------------------------------------------- the sections


@dataclass
class DataConfig:
    """Where the tokens come from and how many one step takes (the loader, batch.BatchLayout)."""

    data: str | None = option(None, "directory of train_*.bin / val_*.bin shards, or a weighted mixture of them: "
                                    "NAME=DIR:WEIGHT,... (e.g. web=data/web:0.7,code=data/code:0.3; weights are "
                                    "normalised; see docs/data.md) (default: the Python stdlib corpus, tokenized "
                                    "once and cached)", metavar="DIR|MIX")
    batch_size: int | str = option(16, "micro-batch size in sequences, or auto: the largest that fits (CUDA: probed; "
                                       "CPU: by the estimate), --grad-accum derived to keep --total-batch-tokens exact",
                                   type=int_or_auto)
    grad_accum: int = option(1, "micro-batches per optimizer step")
    allow_data_change: bool = option(False, "--resume on shards that differ from the ones the checkpoint trained "
                                            "on (without it such a resume is refused)")
    total_batch_tokens: int = option(0, "tokens per optimizer step; derives --grad-accum from it (0: off)")
    seed: int = option(1337, "initialisation and data order")
    packing: str = option("windows", "how training rows are cut from the shards: windows of seq-len + 1 tokens "
                                     "at any offset; or bos: every row starts at a document (its end-of-text "
                                     "token), documents packed best-fit and cropped only to fill a row (the "
                                     "cropped fraction is reported); validation always uses windows",
                          choices=("windows", "bos"))


@dataclass
class ScheduleConfig:
    """How long the run is and the LR over it (schedule.lr_multiplier), with gradient clipping."""

    max_steps: int = option(150, "optimizer steps to train")
    max_tokens: int = option(0, "train for this many tokens instead of --max-steps (0: off)")
    warmup: int = option(1, "linear warm-up steps (docs/recipe.md)")
    schedule: str = option("wsd", "warmup-stable-decay, with a linear decay over the last --decay-frac "
                                  "(docs/recipe.md), or cosine decay", choices=("wsd", "cosine"))
    min_lr_ratio: float = option(0.1, "final LR as a fraction of peak")
    decay_frac: float = option(0.2, "wsd: fraction of steps spent decaying (docs/sizing.md)")
    grad_clip: float = option(1.0, "max global grad norm (0: off)")
    batch_warmup_steps: int = option(0, "batch-size warm-up: the global batch ramps linearly from "
                                        "--batch-warmup-start of itself to all of it over this many steps, in whole "
                                        "micro-steps (needs grad accumulation to ramp; 0: off)")
    batch_warmup_start: float = option(0.25, "the batch warm-up's first step, as a fraction of the global batch")
    allow_lr_rewarm: bool = option(False, "--resume with a schedule that raises the LR again once its decay has "
                                          "begun (a finished run given a larger --max-steps, say); without it such "
                                          "a resume is refused")


@dataclass
class EvalConfig:
    """Validation and samples; evaluation.Evaluator decides when."""

    eval_interval: int = option(50, "steps between val-loss evals (0: off)")
    eval_tokens: int = option(16384, "val tokens per eval")
    sample_tokens: int = option(0, "at each eval, print a sample of this many tokens (0: off)")
    sample_prompt: str = option("", "prompt for those samples (default: a new document)")
    eval_hellaswag: int = option(0, "at each eval, HellaSwag accuracy over the first N examples of "
                                    "--hellaswag-path (0: off; tokenised with the tokenizer the data records)", metavar="N")
    hellaswag_path: str = option("Rowan/hellaswag", "HellaSwag's validation split: a Hugging Face dataset name, "
                                                    "or a local .jsonl / .parquet file in its format")


RESUME_MODES = ("off", "on", "auto")


@dataclass
class CheckpointConfig:
    """Where the run writes, what it resumes from; checkpoint.Checkpointer decides when to save."""

    out_dir: str = option("out", "checkpoints and metrics.jsonl go here")
    ckpt_interval: int = option(50, "steps between checkpoints (0: only at the end)")
    keep_ckpts: int = option(2, "how many recent checkpoints to keep")
    resume: str = option("off", "continue from the newest good checkpoint in --out-dir; auto: if there is one, "
                                "else start fresh (for restart scripts)", choices=RESUME_MODES, nargs="?",
                         const="on")
    overwrite: bool = option(False, "a fresh run may replace what an earlier run left in --out-dir (checkpoints, "
                                    "best, metrics.jsonl); without it such a directory is refused")
    from_hf: str | None = option(None, "start from the weights of a Hugging Face Qwen3 or Qwen3-Next directory, "
                                       "or its look-back class (hf.py writes one); it gives the model (shape, "
                                       "architecture, and the LRs of its width), so model flags other than "
                                       "--seq-len are refused with it",
                                 metavar="DIR")


@dataclass
class ResilienceConfig:
    """What to do about non-finite steps, spikes and a stalled val loss (resilience.Guard)."""

    max_bad_steps: int = option(5, "non-finite steps in a row (each one's update is skipped) before "
                                   "--on-bad-steps acts")
    on_bad_steps: str = option("rollback", "rollback: reload the newest checkpoint and scale the LR by "
                                           "--rollback-lr-factor; stop: exit", choices=("rollback", "stop"))
    rollback_lr_factor: float = option(0.5, "LR multiplier applied at each rollback")
    max_rollbacks: int = option(3, "rollbacks in one run before it stops (exit 1): a run that diverges again "
                                   "after this many needs a lower --lr, not another rollback")
    spike_factor: float = option(3.0, "warn when the loss exceeds this multiple of its running average (0: off)")
    early_stop_patience: int = option(0, "stop after this many evals without a better val loss (0: never)")


@dataclass
class DistConfig:
    """Data parallelism under torchrun (distributed.py)."""

    dist: str = option("none", "data parallelism across the processes torchrun starts: DDP, or FSDP2 "
                               "(fully_shard)", choices=("none", "ddp", "fsdp"))
    ddp_bucket_mb: float = option(25.0, "DDP gradient bucket size in MiB")
    reshard_after_forward: bool = option(True, "FSDP2: free gathered parameters after forward (less memory, "
                                               "one more all-gather)")
    collective_timeout: float = option(600.0, "seconds a rank waits in a collective for the others before it "
                                              "gives up with one line (a rank that died or hung; "
                                              "docs/fault-tolerance.md)")


DEVICES = ("auto", "cuda", "mps", "cpu")
DTYPES = ("auto", "bf16", "fp16", "fp32")
ACT_CKPT_MODES = ("none", "full", "selective", "alternate")
ACTIVATION_DTYPES = ("auto", "fp32", "bf16")


@dataclass
class SpeedConfig:
    """Device, precision, compilation and activation memory (hardware.py, distributed.parallelize, memory.py)."""

    device: str = option("auto", "auto: cuda, then mps, then cpu", choices=DEVICES)
    dtype: str = option("auto", "autocast dtype (auto: bf16 on CUDA that has it, or on a CPU with native bf16 "
                                "where a probe matmul runs faster; else fp32); fp16 adds a GradScaler", choices=DTYPES)
    tf32: bool = option(True, "CUDA: fp32 matmuls on TF32 tensor cores (10-bit mantissa); --no-tf32 keeps them "
                              "true fp32")
    activation_dtype: str = option("auto", "the residual stream between bf16 autocast's GEMMs: fp32 (autocast's "
                                           "own), or bf16 end to end (norms accumulate in fp32 inside their "
                                           "kernels; parameters, optimizer state and the loss stay fp32); auto: "
                                           "bf16 under bf16 autocast on CUDA, else fp32",
                                   choices=ACTIVATION_DTYPES)
    compile: str = option("off", "torch.compile mode for the model (Muon's step compiles too, in default mode)",
                          choices=("off", "default", "reduce-overhead", "max-autotune"))
    act_ckpt: str = option("none", "activation checkpointing: every block, every other block, or each "
                                   "block's MLP", choices=ACT_CKPT_MODES)
    loss_chunk_tokens: int = option(0, "tokens per chunk of the fused lm_head + loss (0: what 1/16 of the "
                                       "device's memory holds, a GPU's or the CPU's RAM, at least 1024; 1024 "
                                       "under fp16)")
    estimate_memory: bool = option(False, "print the memory estimate for these flags (every --act-ckpt mode) "
                                          "and exit")
    target_gpu: str | None = option(None, "--estimate-memory for a GPU this machine need not have: a name "
                                          "(h100, h200, a100-80gb, ...) or a memory size (80GiB); prints whether "
                                          "each --act-ckpt mode fits (--dist fsdp: per rank of WORLD_SIZE=N ranks, "
                                          "as torchrun sets it)", metavar="GPU")


@dataclass
class LogConfig:
    """What the run reports and where (telemetry.py)."""

    log_interval: int = option(10, "steps between progress updates: the loss and grad norm are read back from the "
                                   "device then, and metrics.jsonl gets the steps since the last one")
    peak_tflops: float = option(0.0, "peak FLOP/s (in TFLOP/s) for MFU (0: the GPU's dense bf16 datasheet "
                                     "figure)")
    profile: bool = option(False, f"run torch.profiler over {PROFILE_ACTIVE} steps after {PROFILE_WAIT} warm-up "
                                  "steps; writes OUT/trace.json (open in Perfetto) and prints the top ops")
    wandb: bool = option(False, "log to Weights & Biases (offline when no API key)")
    wandb_project: str = option("pretrain", "wandb project")
    wandb_run_name: str | None = option(None, "wandb run name (default: wandb picks one)")
    wandb_tags: str | None = option(None, "comma-separated tags for the wandb run")
    wandb_mode: str = option("auto", "auto: online with an API key, offline without",
                             choices=("auto", "online", "offline"))
    tensorboard: bool = option(False, "also write each metrics.jsonl record's numbers as TensorBoard scalars to "
                                      "OUT/tensorboard (view: tensorboard --logdir OUT/tensorboard; needs the "
                                      "optional tensorboard package: pip install tensorboard)")


@dataclass
class Config:
    """Every setting of a training run, one section per concern; --help lists them in this order."""

    data: DataConfig = field(default_factory=DataConfig)
    size: SizeConfig = field(default_factory=SizeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self):
        """Unset LRs (optim.default_lrs, by the model's width, whether flags or the size dial gave it) and Adam's
        beta1 take the optimizer's defaults here, where the model meets the optimizer, so that Config() is what
        parsing no flag gives and config.toml holds the values."""
        self.optim = optim.with_optimizer_defaults(self.optim, self.model.tie_embeddings, self.model.n_embd)


SECTION_TITLES = {
    "data": "data and batch", "size": "model size: one dial (see sizing.py)", "model": "model",
    "optim": "optimizer", "schedule": "length and schedule",
    "eval": "evaluation and samples", "ckpt": "checkpoints and output", "resilience": "fault tolerance",
    "dist": "distributed (under torchrun)", "speed": "device, precision, speed and memory",
    "fp8": "FP8 (see fp8.py)", "log": "logging and profiling",
}


# ----------------------------------------------------------------------------- the generated parser


def _value_type(cls, f: dataclasses.Field):
    """The type a flag's text converts to: metadata "type", else the field's annotation (X | None -> X)."""
    if "type" in f.metadata:
        return f.metadata["type"]
    annotation = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def _add_flag(group, section: str, cls, f: dataclasses.Field) -> None:
    """One field's flag. Its default is the dataclass's: the parser holds none (SUPPRESS), so a value in the
    namespace is one the user gave, and the dataclass fills in the rest."""
    kwargs = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS}
    value_type = _value_type(cls, f)
    if value_type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = value_type
    if "nargs" in f.metadata:  # an optional value: the bare flag means `const`
        kwargs["nargs"], kwargs["const"] = f.metadata["nargs"], f.metadata["const"]
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    elif "action" not in kwargs:
        kwargs["metavar"] = f.metadata.get("metavar", f.name.upper())
    shown = f.default
    hidden = shown is None or shown is False or shown == ""  # 0 is a default to show (0 == False)
    kwargs["help"] = f.metadata["help"] + ("" if hidden else f" (default: {shown})")
    group.add_argument(flag_name(f), **kwargs)


# Flags of the sibling scripts that people give train.py: where they belong, said instead of a near miss.
ELSEWHERE = {"--ckpt": "--ckpt is sample.py's, score.py's and hf.py's; train.py continues a run with --resume "
                       "(its --out-dir's newest checkpoint) or starts from a Hugging Face model with --from-hf"}


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                       elsewhere=ELSEWHERE)
    p.add_argument("--config", dest="config_file", metavar="FILE", default=argparse.SUPPRESS,
                   help="a TOML file whose [sections] are the groups below and whose keys are their fields "
                        "(configs/ has examples; every run writes its own to OUT/config.toml); flags override it")
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        group = p.add_argument_group(SECTION_TITLES[section.name])
        for f in dataclasses.fields(cls):
            _add_flag(group, section.name, cls, f)
    return p


# Pairs of alternatives: a flag for either one replaces what a --config file said about both.
ALTERNATIVES = ((("data.total_batch_tokens", "--total-batch-tokens"), ("data.grad_accum", "--grad-accum")),
                (("schedule.max_tokens", "--max-tokens"), ("schedule.max_steps", "--max-steps")))
# Settings of one invocation rather than of the run: not written to OUT/config.toml (so that a file a resumed
# run wrote repeats the run instead of resuming it), not compared on resume.
INVOCATION_KEYS = ("ckpt.resume", "ckpt.overwrite", "speed.estimate_memory", "speed.target_gpu",
                   "schedule.allow_lr_rewarm", "data.allow_data_change")


def explicit_values(flags: dict, from_file: dict) -> dict:
    """What the user set, "section.field" -> value: the file's values under the flags'. Raises UsageError for
    two alternatives set in the same place."""
    for pair in ALTERNATIVES:
        if any(key in flags for key, _ in pair):
            from_file = {key: v for key, v in from_file.items() if key not in (pair[0][0], pair[1][0])}
        for source in (flags, from_file):
            if all(key in source for key, _ in pair):
                raise UsageError(f"give {pair[0][1]} or {pair[1][1]}, not both")
    return {**from_file, **flags}


def from_hf_conflicts(flags: dict, from_hf: str | None) -> list[str]:
    """The flags given with --from-hf that it would override unsaid: the directory gives the whole model (its
    shape, vocabulary and architecture toggles; the size dial has nothing to size), all but --seq-len, the
    context this run trains at. flags: the command line's, as build_parser parses them ("section.field")."""
    if not from_hf:
        return []
    fields = {f"{section}.{f.name}": flag_name(f) for section, cls in (("model", ModelConfig), ("size", SizeConfig))
              for f in dataclasses.fields(cls) if f.name != "max_seq_len"}
    return [f"{fields[key]}: --from-hf {from_hf} gives the model; leave {fields[key]} out" for key in flags
            if key in fields]


def idle_tokens_per_param(flags: dict, given: dict) -> list[str]:
    """--tokens-per-param on a command line where the dial does not size the run's length, which would ignore it
    unsaid: no --depth or --preset (flags or --config file), or --max-tokens / --max-steps given beside it."""
    if "size.tokens_per_param" not in flags:
        return []
    if "size.depth" not in given and "size.preset" not in given:
        return ["--tokens-per-param sizes the run's tokens with the size dial: give --depth or --preset with it"]
    length = [flag for key, flag in (("schedule.max_tokens", "--max-tokens"), ("schedule.max_steps", "--max-steps"))
              if key in flags]
    if length:
        return [f"--tokens-per-param and {length[0]} both set the run's length: give one"]
    # A run's config.toml records the length the dial derived: the file's value would win over the flag
    recorded = [key.split(".")[1] for key in ("schedule.max_tokens", "schedule.max_steps") if given.get(key)]
    return [f"--tokens-per-param: the --config file sets {recorded[0]}, the run's length, which the flag would "
            f"derive; remove {recorded[0]} from the file, or give --max-tokens"] if recorded else []


def from_hf_values(hf_model, directory: str) -> dict:
    """"model.field" -> value of the --from-hf directory's model (hf_model: parse_command_line's), --seq-len
    aside (the context this run trains at)."""
    try:
        model = hf_model(directory)
    except ValueError as e:
        raise UsageError(f"--from-hf: {e}") from None
    return {f"model.{key}": value for key, value in dataclasses.asdict(model).items() if key != "max_seq_len"}


def repeated_config(command_line: dict) -> str | None:
    """The --config file of a command line that does not give --out-dir (parse_command_line's command_line): its
    run goes to the directory the file names, which holds the file's own run when the file is an OUT/config.toml
    (rundir.claim says what to add)."""
    return None if "ckpt.out_dir" in command_line else command_line.get("config_file")


def parse_args(argv=None, description: str | None = None, machine_checks=()) -> Config:
    """Flags (over an optional --config file) -> a validated Config (parse_command_line's)."""
    return parse_command_line(argv, description, machine_checks)[0]


def parse_command_line(argv=None, description: str | None = None, machine_checks=(),
                       data_vocab=None, hf_model=None) -> tuple[Config, dict]:
    """Flags (over an optional --config file) -> (a validated Config, the flags as given: "section.field" and
    "config_file" for --config, for check_config_edits). Values the size dial derives (sizing.py) fill in what
    neither gave. Raises UsageError on bad or contradictory settings. machine_checks: functions Config -> what
    this machine lacks for the run to start, reported with the flags' problems (train.py's start-up; not for
    reading a GPU run's config on a laptop, nor for --estimate-memory). data_vocab: (--data, --vocab-size) ->
    the model's vocabulary (train.py's reads the shards' record), settled before the dial counts parameters.
    hf_model: a --from-hf directory -> its ModelConfig (hf.hf_model_config), the model's shape under --from-hf,
    so that its LRs are its width's."""
    command_line = vars(build_parser(description).parse_args(argv))
    flags = {key: value for key, value in command_line.items() if key != "config_file"}
    config_file = command_line.get("config_file")
    given = explicit_values(flags, read_config_file(config_file) if config_file else {})
    if given.get("schedule.max_tokens", 1) < 1:  # 0 is the field's "unset", not a length a user can ask for
        raise UsageError(f"--max-tokens must be >= 1, got {given['schedule.max_tokens']}")
    as_given = _config(given)
    checks.refuse([*checks.integer_problems(as_given), *checks.dial_problems(as_given),
                   *from_hf_conflicts(flags, as_given.ckpt.from_hf), *idle_tokens_per_param(flags, given)])
    if hf_model and as_given.ckpt.from_hf:  # the directory gives the shape, vocabulary included
        given = {**given, **from_hf_values(hf_model, as_given.ckpt.from_hf)}
    elif data_vocab:
        vocab = data_vocab(as_given.data.data, as_given.model.vocab_size)
        given = given if vocab == as_given.model.vocab_size else {**given, "model.vocab_size": vocab}
    cfg = _config({**sizing.resolve(given, DataConfig.batch_size), **given})
    checks.validate(cfg, () if cfg.speed.estimate_memory else machine_checks)
    return cfg, command_line


def _config(values: dict) -> Config:
    """A Config of these "section.field" values and the defaults, unchecked."""
    sections = {}
    for section in dataclasses.fields(Config):
        fields = {key.split(".", 1)[1]: v for key, v in values.items() if key.split(".", 1)[0] == section.name}
        sections[section.name] = section.default_factory(**fields)
    return Config(**sections)


def to_dict(cfg: Config) -> dict:
    """The whole configuration as plain data (for wandb and the checkpoint's record of the run)."""
    return dataclasses.asdict(cfg)


def flat_values(cfg: Config) -> dict:
    """"section.field" -> value, for every field."""
    return flat_dict(to_dict(cfg))


# ----------------------------------------------------------------------------- configuration files


def _file_value(cls, f: dataclasses.Field, value, where: str):
    """A TOML value checked and converted for its field, as its flag's text would be."""
    expected = _value_type(cls, f)
    if "type" in f.metadata:  # a custom flag type (--batch-size: an int or "auto") reads the value's text
        try:
            value = f.metadata["type"](str(value))
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{where} {e}") from None
    elif expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise UsageError(f"{where} must be {expected.__name__}, got {value!r}")
    if "choices" in f.metadata and value not in f.metadata["choices"]:
        raise UsageError(f"{where} must be one of {', '.join(map(str, f.metadata['choices']))}, got {value!r}")
    return value


def read_config_file(path: str) -> dict:
    """A --config TOML file -> "section.field" -> value. UsageError (one line) for a file that cannot be read, an
    unknown section or key, or a value of the wrong type."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"--config {path}: {e}") from None
    sections = {s.name: s.default_factory for s in dataclasses.fields(Config)}
    values = {}
    for name, table in data.items():
        if name not in sections or not isinstance(table, dict):
            close = difflib.get_close_matches(name, sections, n=1) if isinstance(table, dict) else []
            hint = f"; did you mean [{close[0]}]?" if close else _closest_key(name, sections)  # or a key out of place
            raise UsageError(f"--config {path}: {name!r} is not a section; the sections are "
                             f"{', '.join(sections)}{hint}")
        names, spelled = key_names(sections[name]), {}
        for key, value in table.items():
            f = names.get(key.replace("-", "_"))
            if f is None:
                raise UsageError(f"--config {path}: unknown key {name}.{key}"
                                 + _closest_key(key, {name: sections[name]}, sections))
            if f.name in spelled:
                raise UsageError(f"--config {path}: {name}.{spelled[f.name]} and {name}.{key} set the same field")
            spelled[f.name] = key
            values[f"{name}.{f.name}"] = _file_value(sections[name], f, value, f"--config {path}: {name}.{key}")
    return values


def key_names(cls) -> dict[str, dataclasses.Field]:
    """The keys a --config file may use for cls's fields -> the field: its name, and its flag's spelling (seq_len
    for --seq-len; a key's dashes read as underscores). Pure."""
    names = {}
    for f in dataclasses.fields(cls):
        names[flag_name(f).removeprefix("--").replace("-", "_")] = f
        names[f.name] = f
    return names


def _closest_key(key: str, *places: dict) -> str:
    """"; did you mean SECTION.FIELD (--FLAG)?" for the field whose name or flag spelling is closest to key, from
    the first of places (section name -> its dataclass) that has a close one; "" when none has. Pure."""
    for sections in places:
        candidates = {alias: (section, f) for section, cls in sections.items() for alias, f in key_names(cls).items()}
        close = difflib.get_close_matches(key.replace("-", "_"), candidates, n=1)
        if close:
            section, f = candidates[close[0]]
            return f"; did you mean {section}.{f.name} ({flag_name(f)})?"
    return ""


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON's escapes (\", \\, \n, \uXXXX) are TOML basic-string escapes; other characters go as they are
        # (TOML has no surrogate pairs for an emoji's \uXXXX\uXXXX), but DEL, which TOML wants escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)  # ints, and floats (repr always has a '.' or an exponent; they are finite)


def to_toml(cfg: Config) -> str:
    """The resolved configuration as a --config file: every field, derived ones included, so that the file
    alone reproduces the run. Unset fields (None) are comments: TOML has no null. Its second line is the
    digest of the others (hand_edited)."""
    lines = ["# The resolved settings of a run: `python train.py --config THIS_FILE --out-dir NEW_DIR` repeats it."]
    flat = flat_values(cfg)
    # Of two alternatives, the file holds the one in use: the token count when it is set, else the other.
    unused = {pair[1][0] if flat[pair[0][0]] else pair[0][0] for pair in ALTERNATIVES}
    for section, fields in to_dict(cfg).items():
        lines.append(f"\n[{section}]")
        for key, value in fields.items():
            if f"{section}.{key}" in (*INVOCATION_KEYS, *unused):
                continue
            lines.append(f"# {key}: unset" if value is None else f"{key} = {_toml_value(value)}")
    text = "\n".join(lines) + "\n"
    title, rest = text.split("\n", 1)
    return f"{title}\n{DIGEST_LINE}{settings_digest(text)} (of the other lines: a resume notices an edit)\n{rest}"


# Starts the line of a file to_toml wrote that carries the digest of its other lines.
DIGEST_LINE = "# settings digest: "


def settings_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def hand_edited(text: str) -> bool:
    """Whether a file may have been changed since to_toml wrote it: its lines other than the digest's no
    longer have that digest, or the digest line is gone (deleted with the edits, say)."""
    lines = text.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if line.startswith(DIGEST_LINE)]
    if not found:
        return True
    digest = lines[found[0]][len(DIGEST_LINE):].split(" ", 1)[0].strip()
    return digest != settings_digest("".join(lines[:found[0]] + lines[found[0] + 1:]))


def check_config_edits(path: str, cfg: Config, command_line: dict) -> None:
    """UsageError when OUT/config.toml (path), which this run is about to replace, was edited by hand
    (hand_edited) and this run would drop the edits: its --config is not that file, and the file has values
    that are not this run's, for settings its flags leave alone. command_line: the invocation's flags as
    build_parser parses them ("section.field", and "config_file" for --config). The message names those
    values, or says the file no longer reads as a config."""
    if not os.path.isfile(path):
        return
    config_file = command_line.get("config_file")
    if config_file and os.path.isfile(config_file) and os.path.samefile(path, config_file):
        return  # the edits apply
    try:
        with open(path, encoding="utf-8") as f:
            edited = hand_edited(f.read())
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} cannot be read ({getattr(e, 'strerror', None) or e}); this run replaces it: "
                         "move it aside") from None
    if not edited:
        return
    try:
        now, values = flat_values(cfg), read_config_file(path)
        dropped = [f"{key} = {_toml_value(value)}" for key, value in values.items()
                   if now[key] != value and key not in command_line]
        if not dropped:
            return
        edits = f"this run does not apply {', '.join(dropped)}"
    except UsageError as e:
        edits = f"no longer reads as a config ({str(e).removeprefix(f'--config {path}: ')})"
    resume = {"on": " --resume", "auto": " --resume auto"}.get(cfg.ckpt.resume, "")
    raise UsageError(f"{path} was edited by hand and {edits}; pass --config {path}{resume} to apply the edits, or "
                     "undo them")


def stage_config(cfg: Config, path: str, resume: bool, command_line: dict) -> str:
    """Write the run's OUT/config.toml (path) under a temporary name -> that name (rundir.replace_outputs renames
    it into place), unless the file there holds edits this run would drop (check_config_edits). A fresh run with
    --overwrite replaces the earlier run, its config.toml with the rest."""
    if resume or not cfg.ckpt.overwrite:
        check_config_edits(path, cfg, command_line)
    write_config(cfg, f"{path}.tmp")
    return f"{path}.tmp"


def write_config(cfg: Config, path: str) -> None:
    """cfg as a --config file (to_toml) at path, on disk when this returns."""
    try:
        write_synced(path, lambda f: f.write(to_toml(cfg).encode("utf-8")))
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


def check_resume(saved: dict, cfg: Config) -> list[str]:
    """Compare a checkpoint's configuration with this run's -> the changed settings ("key old -> new"), for a
    warning. UsageError for changes a run cannot survive: the model's shape (its weights would not load) and
    the optimizer (its state would not). Keys a checkpoint from an older version lacks are not compared."""
    changes = [change for change in changed_keys(saved, to_dict(cfg)) if change[0] not in INVOCATION_KEYS
               and not same_directory(*change)]
    # Under --from-hf the model is the directory's, checked against the checkpoint's weights' own record
    # (checkpoint.config_changes); a run started before the flags took it from there recorded the default shape.
    shape_fixed = not cfg.ckpt.from_hf
    fatal = [c for c in changes if c[0] == "optim.name" or (shape_fixed and c[0].startswith("model.") and
                                                          c[0][6:] not in ("max_seq_len", *INIT_ONLY_FIELDS))]
    if fatal:
        raise UsageError("--resume: the checkpoint was trained with settings that cannot change within a run: "
                         + ", ".join(map(describe_change, fatal)))
    return [describe_change(c) for c in changes]


def same_directory(key: str, old, new) -> bool:
    """Whether a changed path setting names the same directory: the run directory given another way, or a
    --data that a checkpoint made before runs recorded it absolute (train.setup) holds relative."""
    paths = key in ("ckpt.out_dir", "data.data") and isinstance(old, str) and isinstance(new, str)
    return paths and os.path.realpath(old) == os.path.realpath(new)


def describe_change(change: tuple) -> str:
    key, old, new = change
    return f"{key} {old!r} -> {new!r}"


# ----------------------------------------------------------------------------- comparing configurations


def flat_dict(nested: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update(flat_dict(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for every key of two nested dicts whose values differ. Keys on one
    side only are left out: they are settings added or removed between versions, not changes."""
    changes = []
    for key in old.keys() & new.keys():
        a, b = old[key], new[key]
        if isinstance(a, dict) and isinstance(b, dict):
            changes += changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append((f"{prefix}{key}", a, b))
    return sorted(changes)
