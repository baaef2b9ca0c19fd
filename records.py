"""The fields of each record read back (data.json, a checkpoint's meta, metrics.jsonl) and their one check.

data.json (prepare.py, read by data.py), a checkpoint's meta (checkpoint.py) and metrics.jsonl's rows
(runlog.py) are read by code that trusts their shapes: a field of the wrong type would surface as a traceback
far from the file. Each reader checks its record against its fields here first, so that a missing, extra or
ill-typed field is one line naming the file and the field. config.toml's keys are checked by config.py, from
the dataclasses that define them.
"""

import json
import math

# What a field may hold, by name; a field lists the kinds it accepts.
KINDS = {
    "count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "positive": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "finite": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "text": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "names to text": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    "null": lambda v: v is None,
}
WORDS = {"count": "an integer >= 0", "positive": "an integer > 0", "number": "a number", "finite": "a finite number",
         "text": "a string", "bool": "true or false", "object": "an object", "list": "a list",
         "names to text": "an object of strings", "null": "null"}


def field(*kinds: str, required: bool = False) -> tuple[tuple[str, ...], bool]:
    return kinds, required


# data.json, as prepare.py writes it; preparations before a field existed lack it.
DATA_RECORD = {
    "tokenizer": field("text", required=True), "n_vocab": field("positive", required=True),
    "tokenizer_sha256": field("text"), "tokenizer_file": field("text"), "eot": field("count", "null"),
    "doc_separator": field("text", "null"), "uint32": field("bool"), "documents": field("count"),
    "tokens": field("count"), "val_tokens": field("count"), "train_tokens": field("count"),
    "train_shards": field("count"), "val_from": field("text"), "val_draws": field("count"),
    "val_documents": field("count"), "max_tokens": field("count", "null"), "seconds": field("finite"),
    "text_documents": field("text"), "piece_tokens": field("positive", "null"), "sha256": field("names to text"),
}
# A checkpoint's meta, as checkpoint.Checkpointer.save writes it; checkpoints before a field existed lack it.
CHECKPOINT_META = {
    "version": field("count", required=True), "step": field("count", required=True), "tokens": field("count"),
    "batch_tokens": field("count", "null"), "world_size": field("positive"), "loader": field("object"),
    "data": field("list", "null"), "tokenizer": field("object", "null"), "rng": field("object"),
    "model_config": field("object"), "train_config": field("object"),
    "lr_multiplier": field("finite", "null"), "record": field("object", "null"), "lr_scale": field("finite"),
    "health": field("object"), "early_stop": field("object"),
    "rollbacks": field("count"),  # the guard's, in checkpoints of an earlier version: no longer read
    # a single-file checkpoint holds its tensors beside the meta
    "model": field("object"), "optimizer": field("object"),
}
# metrics.jsonl's rows: step and tokens counted; these text fields; every other one a number, true or false, or null.
METRICS_ROW_TEXT = ("sample", "eval_skipped")


def short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def problem(record, fields: dict, extra: bool = False) -> str | None:
    """What is wrong with record against fields (name -> (kinds, required)), in a few words naming the field;
    None when nothing is. extra: fields of other names are allowed."""
    if not isinstance(record, dict):
        return "not a JSON object"
    for name, (kinds, required) in fields.items():
        if name not in record:
            if required:
                return f"no field {name!r}"
        elif not any(KINDS[kind](record[name]) for kind in kinds):
            return f"field {name!r} must be {' or '.join(WORDS[kind] for kind in kinds)}, got {short(record[name])}"
    if not extra and (unknown := sorted(set(record) - set(fields))):
        return f"unknown field {unknown[0]!r} (a record of another tool or version)"
    return None


def row_problem(row: dict, required: tuple[str, ...] = ("step", "tokens")) -> str | None:
    """A metrics.jsonl row's problem: step and tokens counts (those of `required` present), the text fields
    text, every other value a number (NaN and infinities included: a non-finite step logs its loss), true or
    false (`skipped`), or null."""
    fields = {name: field("number", "bool", "null") for name in row}
    fields |= {name: field("count", required=name in required) for name in ("step", "tokens", *required)}
    fields |= {name: field("text") for name in METRICS_ROW_TEXT}
    return problem(row, fields)
