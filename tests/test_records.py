"""records.py and the readers that check their records by it: each record the project reads back (data.json, a
checkpoint's meta, metrics.jsonl, summary.json, config.toml), mutated field by field (dropped, its value
swapped for one of another type or out of range, a field added), is read and used without a traceback: it
works, or it is refused in one line naming the file and the field."""

import json

import numpy as np
import pytest
import torch

import checkpoint
import config
import data
import records
import report
import shards
import split
from checkpoint import CheckpointError
from cli import DataError, UsageError
from conftest import write_checkpoint
from model import GPT, ModelConfig
from runlog import MetricsError
from shards import file_sha256, write_shard
from trained import read_checkpoint

SWAPS = [None, "x", -1, 1.5, True, [], {}, 10**30]
REFUSALS = (CheckpointError, DataError, MetricsError, UsageError, ValueError)


def mutations(record: dict):
    """(what was done, the mutated record): each field dropped, then swapped for each of SWAPS, and one field
    added."""
    for name in record:
        yield f"{name} dropped", {k: v for k, v in record.items() if k != name}
        for value in SWAPS:
            if value != record[name] or type(value) is not type(record[name]):
                yield f"{name} = {value!r}", {**record, name: value}
    yield "a field added", {**record, "added": 1}


def read_without_traceback(case: str, read) -> str | None:
    """read() -> None when it works, or its one-line refusal; any other exception fails the test, naming case."""
    try:
        read()
    except REFUSALS as e:
        assert "\n" not in str(e), (case, str(e))
        return str(e)
    except Exception as e:  # noqa: BLE001: the point of the test
        pytest.fail(f"{case}: {type(e).__name__}: {e}")
    return None


def test_a_record_is_checked_field_by_field():
    fields = {"n": records.field("count", required=True), "name": records.field("text", "null")}
    assert records.problem({"n": 3, "name": None}, fields) is None
    assert records.problem({"name": "a"}, fields) == "no field 'n'"
    assert records.problem({"n": True}, fields) == "field 'n' must be an integer >= 0, got true"
    assert records.problem({"n": 1, "name": 2}, fields) == "field 'name' must be a string or null, got 2"
    assert records.problem({"n": 1, "other": 2}, fields) == "unknown field 'other' (a record of another tool or version)"
    assert records.problem([1], fields) == "not a JSON object"
    assert records.row_problem({"step": 1, "tokens": 2, "train_loss": float("nan"), "skipped": False,
                                "sample": "text"}) is None
    assert records.row_problem({"step": 1, "tokens": 2, "lr": "0.1"}) == "field 'lr' must be a number or true or false or null, got \"0.1\""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Shards and the data.json prepare.py writes for them (a real preparation's fields)."""
    root = tmp_path_factory.mktemp("prepared")
    tokens = (np.arange(4000) * 7 % 256).astype(np.uint16)
    write_shard(root / "train_000000.bin", tokens[:3000], vocab_size=256)
    write_shard(root / "val_000000.bin", tokens[3000:], vocab_size=256)
    record = {"tokenizer": "gpt2", "tokenizer_sha256": "ab" * 32, "n_vocab": 256, "eot": 255,
              "doc_separator": "<|endoftext|>", "uint32": False, "documents": 3, "tokens": 4000, "val_tokens": 1000,
              "train_tokens": 3000, "train_shards": 1, "val_from": "draws", "val_draws": 64, "val_documents": 1,
              "max_tokens": None, "seconds": 0.5,
              "sha256": {p.name: file_sha256(str(p)) for p in sorted(root.glob("*.bin"))}}
    assert records.problem(record, records.DATA_RECORD) is None
    return root, record


def test_every_mutation_of_data_json_is_read_or_refused_in_one_line(prepared):
    root, record = prepared
    refused = 0
    for case, mutated in mutations(record):
        (root / "data.json").write_text(json.dumps(mutated))

        def use():
            found = shards.data_record(str(root))
            split.describe(found)
            data.vocab_from_data(data.DEFAULT_VOCAB, str(root))
            loader = data.ShardLoader(str(root), batch_size=2, seq_len=16, prefetch=0)
            next(loader)

        why = read_without_traceback(f"data.json: {case}", use)
        if why is not None:
            assert why.startswith(f"{root / 'data.json'}: ") or "shard" in why, (case, why)
            refused += 1
    assert refused >= len(record)  # at least each required field dropped or mistyped, and the added one


def test_every_mutation_of_a_checkpoints_meta_is_read_or_refused_in_one_line(tmp_path):
    model = GPT(ModelConfig(vocab_size=256, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, max_seq_len=16))
    write_checkpoint(tmp_path / "good.pt", model, {"data": {"data": None}})
    meta = {k: v for k, v in torch.load(tmp_path / "good.pt", weights_only=True).items()
            if k not in ("model", "optimizer")}
    assert records.problem(meta, records.CHECKPOINT_META) is None
    path = str(tmp_path / "mutated.pt")
    for case, mutated in mutations(meta):
        checkpoint.save_file({**mutated, "model": model.state_dict(), "optimizer": {}}, path)
        why = read_without_traceback(f"checkpoint meta: {case}", lambda: read_checkpoint(path))
        assert why is None or path in why, (case, why)


def test_every_mutation_of_a_metrics_row_is_read_or_refused_in_one_line(tmp_path):
    row = {"step": 2, "tokens": 512, "time_s": 0.5, "train_loss": 4.2, "lr": 0.006, "grad_norm": 0.4,
           "tokens_per_sec": 1000.0, "mfu": None, "skipped": False, "bad_steps": 0, "val_loss": 4.4, "val_bpb": 1.9,
           "sample": "text", "eval_skipped": "out of memory"}
    assert records.row_problem(row) is None
    first = json.dumps({"step": 1, "tokens": 256, "time_s": 0.2, "train_loss": 5.0, "lr": 0.003}) + "\n"
    path = tmp_path / "metrics.jsonl"
    for case, mutated in mutations(row):
        path.write_text(first + json.dumps(mutated) + "\n")

        def use():
            found = report.read_records(str(tmp_path))
            report.render(str(tmp_path), found, None, None, False)

        why = read_without_traceback(f"metrics row: {case}", use)
        assert why is None or f"{path}:2: " in why, (case, why)


def test_every_mutation_of_summary_json_is_read_or_refused_in_one_line(tmp_path):
    summary = {"facts": {"done": 3, "outcome": "finished", "eval_plan": "every 50 steps"},
               "rows": [["outcome", "finished"]], "machine": [["cpu", "x86"]]}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "tokens": 768}) + "\n")
    for part in ("top", "facts"):
        target = summary if part == "top" else summary["facts"]
        for case, mutated in mutations(target):
            whole = mutated if part == "top" else {**summary, "facts": mutated}
            (tmp_path / "summary.json").write_text(json.dumps(whole))

            def use():
                report.render(str(tmp_path), report.read_records(str(tmp_path)), report.read_summary(str(tmp_path)),
                              None, False)

            why = read_without_traceback(f"summary.json {part}: {case}", use)
            assert why is None or "summary.json" in why, (case, why)


def test_every_mutation_of_config_toml_is_read_or_refused_in_one_line(tmp_path):
    values = {"model": {"n_layer": 2, "n_embd": 64, "attn_gate": True}, "optim": {"lr": 0.006},
              "data": {"batch_size": 4}}
    path = tmp_path / "config.toml"
    for section, table in values.items():
        for case, mutated in mutations(table):
            lines = []
            for name, t in {**values, section: mutated}.items():
                lines.append(f"[{name}]")
                lines += [f"{k} = {toml_value(v)}" for k, v in t.items() if toml_value(v) is not None]
            path.write_text("\n".join(lines) + "\n")
            why = read_without_traceback(f"config.toml [{section}]: {case}",
                                         lambda: config.parse_args(["--config", str(path)]))
            field = case.split()[0]  # a value a flag could give too is refused as the flag's would be: by its name
            assert why is None or str(path) in why or field in why or field.replace("_", "-") in why, (case, why)


def toml_value(v):
    """v in TOML, or None for what TOML cannot write (null)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, dict)):
        return "[]" if isinstance(v, list) else "{}"
    return repr(v)
