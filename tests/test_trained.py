"""trained.py: a checkpoint's weights read back without TE's extra state, from a file or a sharded
directory; and the tools refusing a tokenizer other than the one the checkpoint recorded."""

import dataclasses
import json

import pytest
import torch

import checkpoint
import hf
import prepare
from conftest import HELLASWAG_FIXTURE, WORD_TEXT, write_checkpoint, write_word_tokenizer
from data import tokenizer_id
from model import GPT, ModelConfig
from test_hf import tiny_model
from tokenizer import load_tokenizer
from trained import read_checkpoint, trained_meta


def test_read_checkpoint_drops_extra_state(tmp_path):
    model = tiny_model(True)
    write_checkpoint(tmp_path / "ckpt.pt", model)
    config, state = read_checkpoint(str(tmp_path / "ckpt.pt"))
    assert config == model.config
    assert list(state) == list(model.state_dict())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as intended here
def test_read_checkpoint_from_a_sharded_directory(tmp_path):
    model = tiny_model(True)
    write_checkpoint(tmp_path / "ckpt.pt", model)
    checkpoint.file_to_dcp(str(tmp_path / "ckpt.pt"), str(tmp_path / "ckpt_dcp"))
    config, state = read_checkpoint(str(tmp_path / "ckpt_dcp"))
    original = model.state_dict()
    assert config == model.config and list(state) == list(original)
    assert all(torch.equal(state[k], original[k]) for k in original)


def test_tools_refuse_a_tokenizer_other_than_the_one_the_checkpoint_recorded(tmp_path, capsys, train_in_process):
    """A run on shards of one tokenizer; its --data prepared again (--overwrite) with another of the same size.
    The checkpoint recorded the first: sample.py, hf.py and score.py each refuse the data's new tokenizer in one
    line naming both; following the advice (--tokenizer with the first) samples, exports and scores."""
    import sample
    import score

    words = WORD_TEXT.split()
    first = write_word_tokenizer(tmp_path / "first.json", words, size=300)
    other = write_word_tokenizer(tmp_path / "other.json", words[::-1], size=300)  # same size, other ids
    (tmp_path / "docs.jsonl").write_text((json.dumps({"text": WORD_TEXT}) + "\n") * 200)
    data, out = tmp_path / "data", tmp_path / "out"
    prepare.prepare(tmp_path / "docs.jsonl", data, first, val_tokens=300)
    run = train_in_process("--data", data, "--out-dir", out, "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                           "--n-kv-head", "1", "--seq-len", "32", "--batch-size", "2", "--max-steps", "2",
                           "--eval-interval", "0", "--device", "cpu", "--dtype", "fp32")
    assert run.returncode == 0, run.stderr[-2000:]
    meta = trained_meta(str(out))
    assert meta["tokenizer"] == tokenizer_id(load_tokenizer(first).record())
    prepare.prepare(tmp_path / "docs.jsonl", data, other, val_tokens=300, overwrite=True)
    capsys.readouterr()

    tail = "(its data was prepared again since, or another tokenizer was given): pass {} ({})"
    commands = {"sample": (sample.main, ["--ckpt", str(out), "--prompt", "the cat", "--max-new-tokens", "3",
                                         "--greedy", "--device", "cpu"], "--tokenizer"),
                "export": (hf.main, ["--ckpt", str(out), "--out", str(tmp_path / "hf")], "--tokenizer"),
                "hellaswag": (score.main, ["--ckpt", str(out), "--task", "hellaswag", "--hellaswag-path",
                                           HELLASWAG_FIXTURE, "--n", "1", "--device", "cpu"], "--tokenizer")}
    for name, (main, argv, flag) in commands.items():
        assert main(argv) == 2, name
        err = [line for line in capsys.readouterr().err.splitlines() if "Traceback" in line or "error" in line]
        assert len(err) == 1 and err[0].startswith(f"error: {out} was trained with the tokenizer {first} "), err
        assert f", not the tokenizer {other} (sha256 " in err[0]
        assert err[0].endswith(tail.format(f"{flag} with the one it was trained with", first)), err[0]
        assert main([*argv, "--tokenizer", first]) == 0, (name, capsys.readouterr().err)
        capsys.readouterr()
    assert score.main(["--ckpt", str(out), "--task", "bpb", "--device", "cpu", "--n", "64"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "Traceback" in line or "error" in line]
    assert len(err) == 1 and err[0].endswith(tail.format("--data with shards prepared with it", first)), err


def test_a_checkpoint_that_records_no_tokenizer_is_taken_with_a_note(tmp_path, capsys):
    """Written before checkpoints recorded their tokenizer: a warning, not a refusal."""
    import sample

    model = tiny_model(False)
    checkpoint.save_file({"version": checkpoint.CHECKPOINT_VERSION, "step": 1, "model": model.state_dict(),
                          "optimizer": {}, "loader": {}, "rng": {}, "model_config": dataclasses.asdict(model.config),
                          "train_config": {}}, str(tmp_path / "old.pt"))
    assert sample.main(["--ckpt", str(tmp_path / "old.pt"), "--prompt", "a", "--max-new-tokens", "2", "--greedy",
                        "--device", "cpu"]) == 0
    assert capsys.readouterr().err == (f"note: {tmp_path / 'old.pt'} does not record the tokenizer it was trained "
                                       "with (it was written before checkpoints did): gpt2 is taken unchecked\n")


def test_a_run_whose_trained_tokenizers_data_is_gone_is_told_where_its_tokenizer_is(tmp_path, capsys):
    """Data prepared with --train-tokenizer (recorded as trained:N, a name --tokenizer cannot load), then moved
    away: no data.json says which tokenizer to take, so GPT-2's, which the checkpoint did not record, is refused
    in one line that names the missing --data and the tokenizer.json in it. Followed where the data is now, the
    advice samples, exports and scores; trained:N itself is refused with the same advice."""
    import sample
    import score

    (tmp_path / "docs.jsonl").write_text((json.dumps({"text": WORD_TEXT}) + "\n") * 50)
    data, moved = tmp_path / "data", tmp_path / "moved"
    record = prepare.prepare(tmp_path / "docs.jsonl", data, val_tokens=100, train_tokenizer=300)
    model = GPT(ModelConfig(vocab_size=record["n_vocab"], n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                            max_seq_len=32))
    ckpt = str(tmp_path / "ckpt.pt")
    write_checkpoint(ckpt, model, {"data": {"data": str(data)}}, tokenizer_id(record))
    data.rename(moved)
    capsys.readouterr()

    commands = {"sample": (sample.main, ["--ckpt", ckpt, "--prompt", "the cat", "--max-new-tokens", "3", "--greedy",
                                         "--device", "cpu"]),
                "export": (hf.main, ["--ckpt", ckpt, "--out", str(tmp_path / "hf")]),
                "hellaswag": (score.main, ["--ckpt", ckpt, "--task", "hellaswag", "--hellaswag-path",
                                           HELLASWAG_FIXTURE, "--n", "1", "--device", "cpu"])}
    for name, (main, argv) in commands.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {ckpt} was trained with the tokenizer trained:300 ")
        assert f"(its --data {data}, whose data.json named it, is not there any more): " in err[0], err[0]
        advice = err[0].partition("pass --tokenizer ")[2].split(",")[0]
        assert advice == str(data / "tokenizer.json")
        assert main([*argv, "--tokenizer", record["tokenizer"]]) == 2
        err = capsys.readouterr().err
        assert err.endswith("pass --tokenizer DIR/tokenizer.json\n") and err.count("\n") == 1, err
        assert main([*argv, "--tokenizer", advice.replace(str(data), str(moved))]) == 0, capsys.readouterr().err


def test_a_run_whose_trained_tokenizers_data_is_there_is_told_its_tokenizer_json_and_data(tmp_path, capsys):
    """Data prepared with --train-tokenizer (trained:N, a name --tokenizer refuses), still where the run read it:
    another --tokenizer is refused with the tokenizer.json in that directory, other shards to score with that
    directory as --data; each followed as it is given samples, exports and scores."""
    import sample
    import score

    (tmp_path / "docs.jsonl").write_text((json.dumps({"text": WORD_TEXT}) + "\n") * 50)
    data, other = tmp_path / "data", tmp_path / "other"
    record = prepare.prepare(tmp_path / "docs.jsonl", data, val_tokens=100, train_tokenizer=300)
    prepare.prepare(tmp_path / "docs.jsonl", other, val_tokens=100, train_tokenizer=290)
    model = GPT(ModelConfig(vocab_size=record["n_vocab"], n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                            max_seq_len=32))
    ckpt = str(tmp_path / "ckpt.pt")
    write_checkpoint(ckpt, model, {"data": {"data": str(data)}}, tokenizer_id(record))
    capsys.readouterr()

    commands = {"sample": (sample.main, ["--ckpt", ckpt, "--prompt", "the cat", "--max-new-tokens", "3", "--greedy",
                                         "--device", "cpu", "--tokenizer", "gpt2"]),
                "export": (hf.main, ["--ckpt", ckpt, "--out", str(tmp_path / "hf"), "--tokenizer", "gpt2"]),
                "hellaswag": (score.main, ["--ckpt", ckpt, "--task", "hellaswag", "--hellaswag-path",
                                           HELLASWAG_FIXTURE, "--n", "1", "--device", "cpu", "--tokenizer", "gpt2"]),
                "bpb": (score.main, ["--ckpt", ckpt, "--task", "bpb", "--n", "64", "--batch-size", "1", "--device",
                                     "cpu", "--data", str(other)])}
    for name, (main, argv) in commands.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {ckpt} was trained with the tokenizer trained:300 "), err
        flag = argv[-2]
        value = err[0].partition(f"pass {flag} ")[2].split(",")[0]
        assert value == str(data / "tokenizer.json" if flag == "--tokenizer" else data), err[0]
        assert main([*argv[:-1], value]) == 0, (name, capsys.readouterr().err)
        capsys.readouterr()
    prepare.prepare(tmp_path / "docs.jsonl", data, val_tokens=100, train_tokenizer=290, overwrite=True)
    assert sample.main(commands["sample"][1][:-2]) == 2  # no copy of trained:300 is left to point at
    assert capsys.readouterr().err.endswith(f"(its --data {data} was prepared again since, with another tokenizer): "
                                            "pass --tokenizer with a copy of the tokenizer.json that directory held "
                                            "when it trained (trained:300)\n")
