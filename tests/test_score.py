"""score.py: the same figures from training, from a checkpoint and from an export; its refusals in one line."""

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import tokenizers
import torch

import checkpoint
import evaluation
import hf
import prepare
import score
import train
from cli import DataError, UsageError
from conftest import REPO, TINY_FLAGS, WORD_TEXT, gpt2_model, write_checkpoint, write_tiny_shards
from data import tokenizer_id
from evaluation import load_hellaswag
from loss import IGNORE_INDEX
from model import GPT, QWEN3_VALUES, ModelConfig

FIXTURE = os.path.join(REPO, "tests", "fixtures", "hellaswag_mini.jsonl")


def run_score(capsys, *args) -> str:
    assert score.main(list(args)) == 0
    return capsys.readouterr().out


def test_training_checkpoint_and_export_agree(tmp_path, tiny_data, capsys):
    """A tiny GPT-2-vocabulary run logs val_bpb and hellaswag_acc; score.py gives the same figures from its
    checkpoint and from its Hugging Face export, both at --dtype auto (bf16 autocast on a CPU with native bf16)."""
    out = tmp_path / "out"
    flags = list(TINY_FLAGS)
    flags[flags.index("--vocab-size") + 1] = "50257"
    # The default model (attention gates): its export is Qwen3-Next's layout.
    train.main(["--data", tiny_data, "--out-dir", str(out), *flags, "--max-steps", "3", "--warmup", "1",
                "--eval-interval", "3", "--eval-tokens", "256", "--eval-hellaswag", "8",
                "--hellaswag-path", FIXTURE, "--device", "cpu"])
    err = capsys.readouterr().err
    with open(out / "metrics.jsonl") as f:
        record = [json.loads(line) for line in f][-1]
    assert re.search(r"step 3: train loss [\d.]+, val loss [\d.]+, val bpb [\d.]+, hellaswag [\d.]+ \(sum", err)
    # The tiny shards' ids 0..255 are GPT-2's single-byte tokens: bits per byte is the loss in bits.
    assert record["val_bpb"] == pytest.approx(record["val_loss"] / math.log(2), rel=1e-6)
    n = 8
    ckpt = str(out / "ckpt_00000003.pt")
    assert hf.main(["--ckpt", ckpt, "--out", str(tmp_path / "hf")]) == 0
    for model_path in (ckpt, str(tmp_path / "hf")):
        text = run_score(capsys, "--ckpt", model_path, "--task", "hellaswag", "--hellaswag-path", FIXTURE,
                        "--device", "cpu")
        right = int(re.search(r"hellaswag_acc +[\d.]+ \((\d+)/8", text).group(1))
        right_sum = int(re.search(r"hellaswag_acc_sum +[\d.]+ \((\d+)/8", text).group(1))
        assert (right / n, right_sum / n) == (record["hellaswag_acc"], record["hellaswag_acc_sum"])
    # Training's micro-batch (4) and eval tokens (256): the same val windows.
    text = run_score(capsys, "--ckpt", str(tmp_path / "hf"), "--task", "bpb", "--data", tiny_data, "--n", "256",
                    "--batch-size", "4", "--device", "cpu")
    assert float(re.search(r"val_loss +([\d.]+)", text).group(1)) == pytest.approx(record["val_loss"], abs=1e-4)
    assert float(re.search(r"val_bpb +([\d.]+)", text).group(1)) == pytest.approx(record["val_bpb"], abs=1e-4)


def test_score_refuses_bad_input_in_one_line(tmp_path, tiny_data, capsys):
    model_dir = tmp_path / "hf"
    model = gpt2_model(**QWEN3_VALUES)  # the architecture an export writes
    hf.export_hf(model.config, model.state_dict(), str(model_dir))
    cases = [(["--ckpt", str(tmp_path / "missing.pt"), "--task", "hellaswag"], "no such file or directory"),
             (["--ckpt", str(model_dir), "--task", "mmlu"], "invalid choice: 'mmlu'"),
             (["--ckpt", str(model_dir), "--task", "hellaswag", "--n", "0"], "--n must be >= 1"),
             (["--ckpt", str(model_dir), "--task", "hellaswag", "--hellaswag-path", "x.jsonl"], "no such file"),
             (["--ckpt", str(model_dir), "--task", "bpb", "--data", str(tmp_path)], "val"),
             (["--task", "bpb"], "--ckpt")]
    for args, message in cases:
        assert score.main(args) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_score_offline_hub_is_one_line(tmp_path):
    model = gpt2_model(**QWEN3_VALUES)  # the architecture an export writes
    hf.export_hf(model.config, model.state_dict(), str(tmp_path / "hf"))
    result = subprocess.run([sys.executable, "score.py", "--ckpt", str(tmp_path / "hf"), "--task", "hellaswag"],
                            cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("error: could not load HellaSwag 'Rowan/hellaswag'"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "--hellaswag-path" in result.stderr


def test_val_data_is_the_data_the_checkpoint_trained_on_unless_told(tmp_path, monkeypatch):
    monkeypatch.setattr(score, "default_corpus_dir", lambda: str(tmp_path / "corpus"))
    mine, corpus, gone = (str(tmp_path / name) for name in ("mine", "corpus", "gone"))
    os.mkdir(mine)
    os.mkdir(corpus)

    def trained_on(data):  # a checkpoint's meta without the shards' fingerprint: told by path
        return {"train_config": {"data": {"data": data, "batch_size": 16}}}

    assert score.val_data(None, trained_on(mine), "c.pt") == (mine, None)
    assert score.val_data(None, trained_on(None), "c.pt") == (None, None)  # the default corpus, as train.py
    assert score.val_data(mine + "/.", trained_on(mine), "c.pt") == (mine + "/.", None)  # the same directory
    assert score.val_data(corpus, trained_on(None), "c.pt") == (corpus, None)
    assert score.val_data(corpus, trained_on(mine), "c.pt") == (corpus, (
        f"note: --data {corpus} is not the data the checkpoint trained on ({mine}): these figures do not compare "
        "with the run's"))
    assert "(the default corpus)" in score.val_data(mine, trained_on(None), "c.pt")[1]
    with pytest.raises(UsageError, match=re.escape(f"--ckpt c.pt trained on --data {gone}, which is not there; "
                                                   "give --data DIR")):
        score.val_data(None, trained_on(gone), "c.pt")
    assert score.val_data(mine, trained_on(gone), "c.pt")[0] == mine
    for recorded in (None, {}):  # an hf.py directory; a checkpoint that recorded no config
        assert score.val_data(None, recorded, "hf") == (
            None, "note: hf records no training data, so this is the default corpus; give --data for the data it "
                  "trained on")
        assert score.val_data(mine, recorded, "hf") == (mine, None)


def test_val_data_tells_the_checkpoints_shards_by_content_not_by_path(tmp_path):
    """A copy of the shards elsewhere is the data the checkpoint trained on; its own directory prepared again
    with other tokens is not."""
    from mixture import data_fingerprint

    (tmp_path / "mine").mkdir()
    mine = write_tiny_shards(tmp_path / "mine")
    copy = shutil.copytree(mine, tmp_path / "copy")
    meta = {"train_config": {"data": {"data": mine}}, "data": data_fingerprint(mine)}
    assert score.val_data(str(copy), meta, "c.pt") == (str(copy), None)
    assert score.val_data(None, meta, "c.pt") == (mine, None)
    write_tiny_shards(mine, seed=1)  # prepared again in place: other tokens
    assert score.val_data(None, meta, "c.pt") == (mine, (
        f"note: --data {mine} is not the data the checkpoint trained on (prepared again since): these figures do "
        "not compare with the run's"))
    assert score.val_data(str(copy), meta, "c.pt") == (str(copy), None)


def test_score_bpb_reads_the_checkpoints_data_and_refuses_another_tokenizers(tmp_path, tiny_data, capsys):
    """score.py on a checkpoint with no --data scores the shards it recorded; other shards get a note; shards of
    another tokenizer, or recorded shards that are gone, are one line."""
    trained, other = tmp_path / "trained", tmp_path / "other"
    shutil.copytree(tiny_data, trained)
    other.mkdir()
    write_tiny_shards(other, seed=1)
    model, ckpt = gpt2_model(), str(tmp_path / "ckpt.pt")
    checkpoint.save_file({"version": checkpoint.CHECKPOINT_VERSION, "step": 1, "model": model.state_dict(),
                          "model_config": dataclasses.asdict(model.config),
                          "train_config": {"data": {"data": str(trained)}}, "tokenizer": None}, ckpt)
    args = ["--ckpt", ckpt, "--task", "bpb", "--n", "256", "--batch-size", "4", "--device", "cpu"]
    own = run_score(capsys, *args).splitlines()
    assert f"val tokens of {trained} " in own[0] and own[1].startswith("val_loss")
    text = run_score(capsys, *args, "--data", str(other)).splitlines()
    assert f"val tokens of {other} " in text[0] and text[1].startswith(f"note: --data {other} is not the data")
    assert text[2] != own[1]  # other tokens, another loss
    (other / "data.json").write_text(json.dumps({"tokenizer": "cl100k_base", "n_vocab": 100277}))
    shutil.rmtree(trained)
    for extra, words in [(["--data", str(other)], "made with the cl100k_base tokenizer"), ([], "which is not there")]:
        assert score.main(args + extra) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err


def test_score_bpb_says_how_many_tokens_it_scored(tmp_path, tiny_data, capsys):
    """bpb reads whole batches (2 x 32 here), as a run's eval does: --n 10 and --n 100 score the same 64 tokens,
    and the report says 64, with the note a run gives when it rounds up; --n 128 scores two batches."""
    model, ckpt = gpt2_model(), str(tmp_path / "ckpt.pt")
    checkpoint.save_file({"version": checkpoint.CHECKPOINT_VERSION, "step": 1, "model": model.state_dict(),
                          "model_config": dataclasses.asdict(model.config), "train_config": {},
                          "tokenizer": None}, ckpt)
    fp32 = ("--device", "cpu", "--dtype", "fp32")
    reports = {n: run_score(capsys, "--ckpt", ckpt, "--task", "bpb", "--data", tiny_data, "--n", str(n),
                            "--batch-size", "2", *fp32).splitlines() for n in (10, 100, 128)}
    for n, tokens in [(10, 64), (100, 64), (128, 128)]:
        assert reports[n][0] == (f"bpb: {tokens} val tokens of {tiny_data} (whole batches of 2 x 32, the windows a "
                                 f"training run's eval reads), model {ckpt}, fp32")
    assert reports[10][1] == ("note: --n 10 rounds up to one whole batch: each eval reads 64 tokens (1 batch of "
                              "2 x 32 on each of 1 rank)")
    assert reports[10][2:] == reports[100][1:] != reports[128][1:]


def test_a_batch_larger_than_the_val_split_and_a_full_stdout_are_one_line(tmp_path, tiny_data, capsys, monkeypatch):
    model, ckpt = gpt2_model(), str(tmp_path / "ckpt.pt")
    checkpoint.save_file({"version": checkpoint.CHECKPOINT_VERSION, "step": 1, "model": model.state_dict(),
                          "model_config": dataclasses.asdict(model.config), "train_config": {},
                          "tokenizer": None}, ckpt)
    args = ["--ckpt", ckpt, "--task", "bpb", "--data", tiny_data, "--n", "64", "--device", "cpu"]
    windows = (2_000 - 1) // 32  # the tiny val shard's 2,000 tokens
    assert score.main([*args, "--batch-size", "100000"]) == 2  # refused before it allocates 100,000 windows
    assert capsys.readouterr().err == (f"error: --batch-size 100,000 is more than the val split holds ({windows} "
                                       f"windows of 32): give at most {windows}\n")
    if os.path.exists("/dev/full"):  # `score.py ... > file` on a full disk
        stdout = open("/dev/full", "w")
        monkeypatch.setattr(sys, "stdout", stdout)
        assert score.main([*args, "--batch-size", "2"]) == 2
        assert capsys.readouterr().err.endswith("\nerror: cannot write to standard output: No space left on device\n")
        stdout.close()


def test_score_runs_the_residual_stream_as_training_does(tmp_path, tiny_data, capsys):
    """--activation-dtype as train.py's: bf16 says so on the first line and scores close to the fp32 stream;
    auto keeps a CPU's stream fp32; bf16 without bf16 autocast is one line."""
    model, ckpt = gpt2_model(), str(tmp_path / "ckpt.pt")
    checkpoint.save_file({"version": checkpoint.CHECKPOINT_VERSION, "step": 1, "model": model.state_dict(),
                          "model_config": dataclasses.asdict(model.config), "train_config": {},
                          "tokenizer": None}, ckpt)
    args = ["--ckpt", ckpt, "--task", "bpb", "--data", tiny_data, "--n", "64", "--batch-size", "2", "--device", "cpu"]
    losses = {}
    for stream in ("auto", "bf16"):
        first, *rest = run_score(capsys, *args, "--dtype", "bf16", "--activation-dtype", stream).splitlines()
        assert first.endswith("bf16 autocast" + (", bf16 activations" if stream == "bf16" else ""))
        losses[stream] = float(re.search(r"val_loss +([\d.]+)", "\n".join(rest)).group(1))
    assert losses["bf16"] == pytest.approx(losses["auto"], abs=0.05)
    assert score.main([*args, "--dtype", "fp32", "--activation-dtype", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "--activation-dtype bf16 runs between bf16 autocast's GEMMs" in err and len(err.strip().splitlines()) == 1


def test_score_says_why_there_is_no_val_bpb(tmp_path, tiny_data, capsys, monkeypatch):
    """The shards' tokenizer cannot be loaded: the val_bpb line gives that reason, as the note before it does."""
    def unavailable(data_dir):
        raise DataError("could not load tokenizer 'cl100k_base'")

    monkeypatch.setattr(evaluation, "data_tokenizer", unavailable)
    model, ckpt = gpt2_model(), str(tmp_path / "ckpt.pt")
    checkpoint.save_file({"version": checkpoint.CHECKPOINT_VERSION, "step": 1, "model": model.state_dict(),
                          "model_config": dataclasses.asdict(model.config), "train_config": {},
                          "tokenizer": None}, ckpt)
    text = run_score(capsys, "--ckpt", ckpt, "--task", "bpb", "--data", tiny_data, "--n", "64", "--batch-size", "2",
                     "--device", "cpu")
    assert "val_bpb   n/a (could not load tokenizer 'cl100k_base')" in text.splitlines()

def test_hellaswag_is_encoded_with_the_tokenizer_the_model_trained_with(word_tokenizer, tmp_path):
    """The checkpoint's recorded --data was made with a 70,001-id tokenizer.json: HellaSwag's endings are its
    ids, not GPT-2's."""
    (tmp_path / "docs.jsonl").write_text('{"text": "the cat sat"}\n' * 4)
    prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "data", word_tokenizer, val_tokens=4)
    model = GPT(ModelConfig(vocab_size=70_001, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, max_seq_len=32))
    checkpoint.save_file({"version": checkpoint.CHECKPOINT_VERSION, "step": 1, "model": model.state_dict(),
                          "optimizer": {}, "loader": {}, "rng": {}, "model_config": dataclasses.asdict(model.config),
                          "train_config": {"data": {"data": str(tmp_path / "data")}}}, str(tmp_path / "ckpt.pt"))
    a = score.build_parser().parse_args(["--ckpt", str(tmp_path / "ckpt.pt"), "--task", "hellaswag",
                                         "--hellaswag-path", FIXTURE, "--n", "1"])
    x, y, _ = score.prepare(a, model, torch.device("cpu")).choices[0]
    ending = load_hellaswag(FIXTURE, 1)[0].endings[0]
    own = tokenizers.Tokenizer.from_file(word_tokenizer)
    assert y[0][y[0] != IGNORE_INDEX].tolist() == own.encode(" " + ending).ids


def test_a_missing_task_is_one_line_that_names_the_choices(capsys):
    assert score.main(["--ckpt", "anything.pt"]) == 2
    assert capsys.readouterr().err == f"error: --task is required: choose one of {', '.join(score.TASKS)}\n"


def test_score_bpb_of_an_export_of_another_vocabulary_with_no_data_says_what_data_to_give(tmp_path, capsys,
                                                                                          monkeypatch):
    """An hf.py directory records no training data: with no --data, bpb would score the default corpus, whose
    GPT-2 ids do not fit a trained tokenizer's model. One line, before building that corpus, with the prepare.py
    command that tokenizes with the export's tokenizer; followed, it scores."""
    (tmp_path / "docs.jsonl").write_text((json.dumps({"text": WORD_TEXT}) + "\n") * 50)
    record = prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "data", val_tokens=100, train_tokenizer=300)
    model = GPT(ModelConfig(vocab_size=record["n_vocab"], n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                            max_seq_len=32))
    ckpt, export = str(tmp_path / "ckpt.pt"), str(tmp_path / "hf")
    write_checkpoint(ckpt, model, {"data": {"data": str(tmp_path / "data")}}, tokenizer_id(record))
    assert hf.main(["--ckpt", ckpt, "--out", export]) == 0
    capsys.readouterr()
    monkeypatch.setattr(score, "default_corpus", lambda: pytest.fail("the default corpus was built"))
    args = ["--ckpt", export, "--task", "bpb", "--n", "32", "--batch-size", "1", "--device", "cpu"]
    assert score.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --task bpb: {export} records no training data and no "
                                                   "--data was given, so it would score the default corpus, "), err
    command = err.partition("(python prepare.py ")[2].partition(", then --data DIR)")[0]
    assert command == f"--input TEXT --out DIR --tokenizer {export}", err
    (tmp_path / "text.txt").write_text(WORD_TEXT + "\n\n" + WORD_TEXT)
    given = command.replace("TEXT", str(tmp_path / "text.txt")).replace("DIR", str(tmp_path / "mine")).split()
    assert prepare.main([*given, "--val-tokens", "40"]) == 0
    assert score.main([*args, "--data", str(tmp_path / "mine")]) == 0, capsys.readouterr().err
