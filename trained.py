"""A trained model as sample.py, score.py and hf.py find it: weights, recorded config, its tokenizer.

A trained model as the tools that use it find it (sample.py, score.py, hf.py's export): its config and
weights from a train.py checkpoint (a file or a sharded directory) or from a run directory, whose newest
checkpoint that verifies is taken as a resume would; the meta and config that checkpoint recorded; and the
tokenizer the model was trained with, with the check that a tool is about to use that one.

    config, weights = read_ckpt("out", print)         # out/ckpt_N.pt, a ckpt_N directory, or a run directory
    enc = model_tokenizer("out")                      # the tokenizer of the data it trained on, if recorded
    check_tokenizer("out", tokenizer_id(enc.record()), print)   # UsageError if it trained with another
"""

import os

import tiktoken

import checkpoint
from checkpoint import CheckpointError
from cli import DataError, UsageError
from data import data_tokenizer, same_tokenizer, tokenizer_id
from fp8 import te_to_plain_state_dict
from mixture import Source, parse_data, record_dir
from model import GPT, ModelConfig
from shards import data_record
from tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer, recorded_tokenizer_spec


def read_checkpoint(path: str) -> tuple[ModelConfig, dict]:
    """A train.py checkpoint's model config and weights (TE `_extra_state` entries dropped), from a single
    file or a sharded DCP directory. Raises CheckpointError for a missing, corrupt or foreign one."""
    def config_of(meta):
        try:
            return ModelConfig.from_record(meta["model_config"])
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: unreadable model_config ({e})") from None

    # A DCP directory is read into the tensors it is given: the model's own, no optimizer.
    meta, tensors = checkpoint.load(path, lambda meta: {"model": GPT(config_of(meta)).state_dict()})
    return config_of(meta), te_to_plain_state_dict(tensors["model"])


def is_run_directory(path: str) -> bool:
    """A directory that is not itself a sharded checkpoint (no meta, checksums or DCP metadata): a train.py
    --out-dir, whose checkpoints are its ckpt_N entries."""
    own = (checkpoint.META_FILE, checkpoint.CHECKSUMS_FILE, ".metadata")
    return os.path.isdir(path) and not any(os.path.exists(os.path.join(path, name)) for name in own)


def read_newest_checkpoint(run_dir: str, warn) -> tuple[str, ModelConfig, dict]:
    """(path, config, weights) of the newest checkpoint of a train.py --out-dir that verifies and loads, either
    format. As a resume does (checkpoint.load_newest), each damaged or foreign one on the way is reported
    through warn and skipped, never deleted. CheckpointError (one line) when none is left."""
    newest = checkpoint.load_newest(run_dir, read_checkpoint, warn)
    if newest is not None:
        return newest
    candidates = checkpoint.list_checkpoints(run_dir)
    found = {0: "it holds no checkpoint", 1: "its one checkpoint does not verify and load"}.get(
        len(candidates), f"none of its {len(candidates)} checkpoints verifies and loads")
    best = _verified_best(run_dir)
    hint = f"; its best-val-loss checkpoint {best} verifies: pass that path" if best else ""
    raise CheckpointError(f"{run_dir}: {found} (ckpt_N.pt files or ckpt_N directories){hint}")


def read_ckpt(path: str, report) -> tuple[ModelConfig, dict]:
    """(config, weights) of a --ckpt: a checkpoint (file or sharded directory), or a run directory (a train.py
    --out-dir), whose newest checkpoint that verifies and loads is taken, as --resume would (damaged ones are
    reported and skipped); which one it took is said through report."""
    if not is_run_directory(path):
        return read_checkpoint(path)
    found, config, state = read_newest_checkpoint(path, report)
    report(f"checkpoint {found} (step {checkpoint.checkpoint_step(found)}): the newest good one in {path}")
    return config, state


def _verified_best(run_dir: str) -> str | None:
    """The run's best-val-loss checkpoint (checkpoint.best_path), if there is one and it verifies: kept apart
    from the ckpt_N ones, it may be all that is left of a run stopped before its first regular checkpoint."""
    for sharded in (False, True):
        path = checkpoint.best_path(run_dir, sharded)
        try:
            checkpoint.verify(path)
            return path
        except CheckpointError:
            continue
    return None


def trained_meta(path: str) -> dict | None:
    """The meta of the checkpoint at path (for a run directory, of its newest checkpoint whose meta reads), {}
    when there is none; None for an hf.py directory. Only the meta is read: a file's tensors are
    memory-mapped, not loaded."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    if is_run_directory(path):
        found = checkpoint.load_newest(path, checkpoint.read_meta, warn=lambda line: None)
    else:
        found = (path, *checkpoint.read_meta(path))
    return found[1] if found else {}


def trained_config(path: str) -> dict | None:
    """The train.py config that the checkpoint at path recorded (trained_meta's train_config), {} when it has
    none; None for an hf.py directory."""
    meta = trained_meta(path)
    return None if meta is None else meta.get("train_config") or {}


def describe_tokenizer(found: dict) -> str:
    sha = f"sha256 {found['tokenizer_sha256'][:12]}, " if found["tokenizer_sha256"] else ""
    return f"the tokenizer {found['tokenizer']} ({sha}{found['n_vocab']:,} ids, separator {found['eot']})"


def check_tokenizer(path: str, found: dict | None, warn, flag: str = "--tokenizer") -> None:
    """UsageError (one line, naming both, and what to pass with `flag`: --tokenizer, or --data for shards to
    score) when the checkpoint at path recorded another tokenizer than `found` (data.tokenizer_id of the one a
    tool would use: its --tokenizer, or the data's data.json, which a preparation since may have replaced). A
    checkpoint from before checkpoints recorded their tokenizer is warned about through warn; an hf.py directory
    carries its own tokenizer, and shards without data.json record none: nothing to compare."""
    meta = trained_meta(path)
    if meta is None or found is None:
        return
    if "tokenizer" not in meta:
        warn(f"note: {path} does not record the tokenizer it was trained with (it was written before checkpoints "
             f"did): {found['tokenizer']} is taken unchecked")
        return
    recorded = meta["tokenizer"]
    if recorded is not None and not same_tokenizer(recorded, found):
        raise UsageError(f"{path} was trained with {describe_tokenizer(recorded)}, not {describe_tokenizer(found)} "
                         f"{_tokenizer_advice(meta, recorded, flag)}")


def _tokenizer_advice(meta: dict, recorded: dict, flag: str) -> str:
    """Why a tool's tokenizer is not the one the checkpoint recorded, and a `flag` value that gives that one. A
    Hugging Face one (trained:N, which --tokenizer cannot load, included) is the tokenizer.json that prepare.py
    wrote beside the shards of the run's --data: in the directory that still records it, or, that data gone,
    wherever it is now. For --data, the run's --data while it still holds shards of that tokenizer."""
    name = recorded["tokenizer"]
    data, sources = _recorded_sources(meta)
    present = [s.dir for s in sources if os.path.isdir(s.dir)]
    if flag != "--tokenizer":
        if present and len(present) == len(sources) and _records(record_dir(sources), recorded):
            return f"(the shards given were prepared with another): pass --data {data}, the data it trained on"
        return (f"(its data was prepared again since, or another tokenizer was given): pass {flag} with shards "
                f"prepared with it ({name})")
    loadable = name in ("gpt2", *tiktoken.list_encoding_names()) or os.path.exists(name)
    if sources and not present:
        if loadable:
            return f"(its --data {data} is not there any more): pass --tokenizer {name}"
        file = os.path.join(sources[0].dir, TOKENIZER_FILE)
        return (f"(its --data {data}, whose data.json named it, is not there any more): pass --tokenizer {file}, "
                f"prepare.py's copy in that directory, from wherever it is now")
    holder = None if loadable else next((d for d in present if _records(d, recorded)), None)
    if holder is not None:
        file = recorded_tokenizer_spec(data_record(holder), holder)
        return (f"(another tokenizer was given): pass --tokenizer {file}, prepare.py's copy beside the shards it "
                f"trained on")
    if name.startswith("trained:") and present:  # a name --tokenizer refuses, and no directory holds it any more
        return (f"(its --data {data} was prepared again since, with another tokenizer): pass --tokenizer with a copy "
                f"of the {TOKENIZER_FILE} that directory held when it trained ({name})")
    return (f"(its data was prepared again since, or another tokenizer was given): pass --tokenizer with the one "
            f"it was trained with ({name})")


def _recorded_sources(meta: dict) -> tuple[str | None, list[Source]]:
    """The --data a checkpoint recorded and its sources ([] for the default corpus, or none recorded)."""
    data = ((meta.get("train_config") or {}).get("data") or {}).get("data")
    try:
        return data, parse_data(data) if data else []
    except UsageError:  # a --data that a run took parses, unless its config was edited by hand
        return data, []


def _records(directory: str, recorded: dict) -> bool:
    """Whether directory's data.json records the tokenizer `recorded` (a data.tokenizer_id)."""
    try:
        record = data_record(directory)
    except DataError:  # an unreadable record holds no tokenizer to point at
        return False
    return record is not None and same_tokenizer(tokenizer_id(record), recorded)


def model_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer the model at path was trained with, as far as something records it: an hf.py directory's
    tokenizer.json (its tokenizer_config.json names the separator), or for a train.py checkpoint or run
    directory the tokenizer of the data it trained on (its recorded --data's data.json; GPT-2's for the
    default corpus). None when nothing does: a directory without tokenizer.json, shards without data.json, a
    data directory that is not there any more."""
    config = trained_config(path)
    if config is None:
        return load_tokenizer(path) if os.path.isfile(os.path.join(path, TOKENIZER_FILE)) else None
    data = (config.get("data") or {}).get("data", "")
    if data is None:  # the default corpus
        return load_tokenizer("gpt2")
    try:
        present = [s for s in parse_data(data) if os.path.isdir(s.dir)] if data else []
    except UsageError:  # a --data that a run took parses, unless its config was edited by hand
        return None
    return data_tokenizer(record_dir(present)) if present else None  # a mixture's sources share one tokenizer
