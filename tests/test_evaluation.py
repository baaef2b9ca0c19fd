"""evaluation.py: per-token losses, validation bits per byte, the HellaSwag loader and scorer (score.py's figures
from a checkpoint and an export: tests/test_score.py)."""

import json
import math
import os
import re
from contextlib import nullcontext

import numpy as np
import pytest
import tokenizers
import torch
import torch.nn.functional as F

import config
import distributed
import evaluation
import prepare
import train
from cli import DataError, UsageError
from conftest import REPO, TINY_FLAGS, WORD_TEXT, gpt2_model
from evaluation import (Evaluator, Example, bits_per_byte, bpb_sums, choice_batch, ending_scores, load_hellaswag,
                        token_byte_lengths)
from loss import IGNORE_INDEX, linear_cross_entropy
from model import GPT, ModelConfig
from shards import write_shard
from tokenizer import get_tokenizer, load_tokenizer

FIXTURE = os.path.join(REPO, "tests", "fixtures", "hellaswag_mini.jsonl")
EOT, HELLO, WORLD = 50256, 15496, 995  # GPT-2: "<|endoftext|>", "Hello" (5 bytes), " world" (6 bytes)
def eval_config(*flags) -> config.EvalConfig:
    return config.parse_args(list(flags)).eval


# ----------------------------------------------------------------------------- per-token losses


@torch.no_grad()
def test_reduction_none_matches_cross_entropy():
    torch.manual_seed(0)
    x, weight = torch.randn(3, 5, 16), torch.randn(40, 16)
    targets = torch.randint(0, 40, (3, 5))
    targets[1, 2] = targets[2, 4] = IGNORE_INDEX
    reference = F.cross_entropy(F.linear(x, weight).flatten(0, 1), targets.flatten(), reduction="none").view(3, 5)
    for chunk in (4, 1024):  # several chunks, one chunk
        losses = linear_cross_entropy(x, weight, targets, chunk=chunk, reduction="none")
        assert losses.shape == (3, 5) and losses.dtype == torch.float32
        torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-5)
        assert losses[1, 2] == 0 and losses[2, 4] == 0
        assert losses.sum() / 13 == pytest.approx(linear_cross_entropy(x, weight, targets, chunk).item(), rel=1e-6)


def test_reduction_none_through_the_model_and_its_refusals():
    model = gpt2_model()
    idx, targets = torch.randint(0, 50257, (2, 9)), torch.randint(0, 50257, (2, 9))
    with torch.no_grad():
        logits, _ = model(idx)
        _, losses = model(idx, targets, reduction="none")
    reference = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(2, 9)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no backward"):
        model(idx, targets, reduction="none")  # autograd would want a backward here
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(8, 4), torch.zeros(2, dtype=torch.long), reduction="sum")


# ----------------------------------------------------------------------------- bits per byte


def test_token_byte_lengths_leave_out_special_tokens_and_padding():
    lengths = token_byte_lengths(load_tokenizer(), 50304)
    assert lengths.shape == (50304,)
    assert lengths[HELLO] == 5 and lengths[WORLD] == 6 and lengths[ord("a")] == 1
    assert lengths[EOT] == 0 and lengths[50257:].sum() == 0  # no text; the vocabulary's padding


def test_bits_per_byte_by_hand():
    """Targets end-of-text, "Hello", " world" with losses 1, 2, 3 nats: the end-of-text is left out of both
    sums, so bpb = (2 + 3) / (ln 2 * (5 + 6))."""
    table = token_byte_lengths(load_tokenizer(), 50257)
    targets, losses = torch.tensor([[EOT, HELLO, WORLD]]), torch.tensor([[1.0, 2.0, 3.0]])
    nats, n_bytes = bpb_sums(losses, targets, table).tolist()
    assert (nats, n_bytes) == (5.0, 11.0)
    assert bits_per_byte(nats, n_bytes) == pytest.approx(5 / (math.log(2) * 11), rel=1e-12)
    assert bits_per_byte(nats, n_bytes) == pytest.approx(0.6558, abs=1e-4)


def test_val_metrics_against_full_logits(tmp_path):
    """val_loss and val_bpb over a val shard of real GPT-2 text (end-of-text tokens and multi-byte tokens)
    equal plain F.cross_entropy over the full logits, with the bytes decoded by hand."""
    enc = get_tokenizer()
    document = [EOT] + enc.encode_ordinary("The café served crème brûlée — twice.")
    tokens = np.array((document * 20)[:200], dtype=np.uint16)
    write_shard(tmp_path / "train_000000.bin", tokens, vocab_size=50257)
    write_shard(tmp_path / "val_000000.bin", tokens, vocab_size=50257)
    model = gpt2_model()
    evaluator = Evaluator(eval_config("--eval-tokens", "64"), str(tmp_path), distributed.DistInfo(),
                          torch.device("cpu"), 50257, seed=0)
    evaluator.check(micro_batch=2, seq_len=32)
    metrics = evaluator.val_metrics(model, model, nullcontext, micro_batch=2, seq_len=32)

    x, y = next(evaluator._loader(evaluator.sources[0], 2, 32))  # the 2 windows of 32 targets each eval reads
    with torch.no_grad():
        losses = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), reduction="none")
    text_bytes = torch.tensor([0 if t == EOT else len(enc.decode_single_token_bytes(t))
                               for t in y.flatten().tolist()])
    assert (text_bytes == 0).sum() >= 2 and text_bytes.max() >= 3  # both cases are there
    assert metrics["val_loss"] == pytest.approx(losses.mean().item(), rel=1e-5)
    expected = losses[text_bytes > 0].sum().item() / (math.log(2) * text_bytes.sum().item())
    assert metrics["val_bpb"] == pytest.approx(expected, rel=1e-5)


def test_no_val_bpb_beyond_gpt2_vocabulary(tiny_data):
    evaluator = Evaluator(eval_config(), tiny_data, distributed.DistInfo(), torch.device("cpu"), 60000, seed=0)
    evaluator.check_val(4, 32)
    assert evaluator.token_bytes is None
    assert evaluator.no_bpb_reason == ("the model's vocabulary (60,000 ids) is larger than the shards' tokenizer's, "
                                       "gpt2 (50,257 ids; GPT-2's when they record none), so the bytes per token are "
                                       "unknown")


def word_model() -> GPT:
    """A model for the word_tokenizer's 70,001 ids, otherwise tiny."""
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=70_001, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, max_seq_len=16)).eval()


@pytest.fixture(scope="module")
def word_data(word_tokenizer, tmp_path_factory):
    """WORD_TEXT ten times over, prepared with the word_tokenizer: val is the first 70 tokens."""
    root = tmp_path_factory.mktemp("word_data")
    (root / "docs.jsonl").write_text((json.dumps({"text": WORD_TEXT}) + "\n") * 10)
    prepare.prepare(root / "docs.jsonl", root / "data", word_tokenizer, val_tokens=70)
    return str(root / "data")


def test_val_bpb_counts_the_bytes_of_the_tokenizer_that_made_the_shards(word_data, word_tokenizer):
    """The shards' data.json names a WordLevel tokenizer: val_bpb is the targets' summed loss over ln 2 times
    their words' UTF-8 bytes, the separator counting none, by hand."""
    model = word_model()
    evaluator = Evaluator(eval_config("--eval-tokens", "32"), word_data, distributed.DistInfo(), torch.device("cpu"),
                          70_001, seed=0)
    evaluator.check(micro_batch=2, seq_len=16)
    metrics = evaluator.val_metrics(model, model, nullcontext, micro_batch=2, seq_len=16)

    x, y = next(evaluator._loader(evaluator.sources[0], 2, 16))  # the 2 windows of 16 targets each eval reads
    spec = json.load(open(word_tokenizer))
    words = {i: w for w, i in spec["model"]["vocab"].items()} | {t["id"]: t["content"] for t in spec["added_tokens"]}
    text_bytes = torch.tensor([0 if words[t] == "<|endoftext|>" else len(words[t].encode()) for t in y.flatten().tolist()])
    with torch.no_grad():
        losses = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), reduction="none")
    expected = losses[text_bytes > 0].sum().item() / (math.log(2) * text_bytes.sum().item())
    assert metrics["val_bpb"] == pytest.approx(expected, rel=1e-5)
    assert metrics["val_loss"] == pytest.approx(losses.mean().item(), rel=1e-5)


def test_an_unloadable_tokenizer_leaves_val_bpb_out_and_training_goes_on(word_data, monkeypatch, capsys):
    """An offline node without the tokenizer's files (say a tiktoken encoding cached elsewhere) still trains."""
    def unavailable(data_dir):
        raise DataError("could not load tokenizer 'cl100k_base'")

    monkeypatch.setattr(evaluation, "data_tokenizer", unavailable)
    model = word_model()
    evaluator = Evaluator(eval_config("--eval-tokens", "32"), word_data, distributed.DistInfo(), torch.device("cpu"),
                          70_001, seed=0)
    evaluator.check(micro_batch=2, seq_len=16)
    assert "note: no val_bpb: could not load tokenizer 'cl100k_base'" in capsys.readouterr().err
    assert evaluator.no_bpb_reason == "could not load tokenizer 'cl100k_base'"
    metrics = evaluator.val_metrics(model, model, nullcontext, micro_batch=2, seq_len=16)
    assert "val_bpb" not in metrics and metrics["val_loss"] > 0


def test_hellaswag_and_the_prompt_use_the_recorded_tokenizer(word_data, word_tokenizer):
    own = tokenizers.Tokenizer.from_file(word_tokenizer)
    cfg = eval_config("--hellaswag-path", FIXTURE, "--sample-prompt", "the cat", "--sample-tokens", "4")
    evaluator = Evaluator(cfg, word_data, distributed.DistInfo(), torch.device("cpu"), 70_001, seed=0)
    evaluator.load_hellaswag(16, 1)
    (x, y, _), example = evaluator.choices[0], load_hellaswag(FIXTURE, 1)[0]
    tail = own.encode(" " + example.endings[0]).ids
    tokens = (own.encode(example.context).ids + tail)[-17:]  # the last seq_len + 1
    assert x[0, :len(tokens) - 1].tolist() == tokens[:-1] and y[0][y[0] != IGNORE_INDEX].tolist() == tail
    sample = evaluator.sample(word_model())  # encoded and decoded with it: its words, spaced
    assert sample.startswith("the cat ") and all(own.token_to_id(word) is not None for word in sample.split())


# ----------------------------------------------------------------------------- how much of the val split


def test_eval_batches_never_read_a_val_window_twice():
    assert evaluation.eval_batches(16384, 1000, 4, 32, 1) == 128  # the split holds more than is asked for
    assert evaluation.eval_batches(16384, 62, 4, 32, 1) == 15  # 62 windows hold 15 whole batches of 4
    assert evaluation.eval_batches(16384, 62, 4, 32, 3) == 5  # a batch of 4 on each of 3 ranks takes 12 windows
    assert evaluation.eval_batches(10, 62, 4, 32, 1) == 1  # at least one batch
    assert evaluation.eval_batches(16384, 3, 4, 32, 1) == 1  # even when the split holds less than one
    assert evaluation.eval_tokens_note(256, 62, 2000, 4, 32, 1) is None
    assert evaluation.eval_tokens_note(256, 3, 100, 4, 32, 1) == (
        "note: the val split (100 tokens) holds 3 windows of 32, fewer than one batch on every rank; each eval "
        "reads 128 tokens (1 batch of 4 x 32 on each of 1 rank), some twice")
    assert evaluation.eval_tokens_note(256, 1, 33, 4, 32, 1).startswith("note: the val split (33 tokens) holds 1 window "
                                                                      "of 32, fewer")



def test_eval_tokens_below_one_batch_say_they_round_up():
    assert evaluation.eval_tokens_note(1, 62, 2000, 4, 32, 1) == (
        "note: --eval-tokens 1 rounds up to one whole batch: each eval reads 128 tokens (1 batch of 4 x 32 on "
        "each of 1 rank)")
    assert evaluation.eval_tokens_note(300, 62, 2000, 4, 32, 3) == (
        "note: --eval-tokens 300 rounds up to one whole batch: each eval reads 384 tokens (1 batch of 4 x 32 on "
        "each of 3 ranks)")
    assert evaluation.eval_tokens_note(128, 62, 2000, 4, 32, 1) is None  # exactly one batch


@pytest.mark.parametrize("phase", ["val", "hellaswag"])
def test_an_eval_that_fails_leaves_the_model_training(tiny_data, phase):
    """An out-of-memory error mid-eval is skipped and training goes on: in training mode, as it was."""
    evaluator = Evaluator(eval_config("--eval-tokens", "256"), tiny_data, distributed.DistInfo(),
                          torch.device("cpu"), 256, seed=0)
    evaluator.choices = [(torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 3, dtype=torch.long), 0)]
    model = torch.nn.Linear(1, 1)

    def out_of_memory(*args, **kwargs):
        assert not model.training
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    model.forward = out_of_memory
    with pytest.raises(torch.cuda.OutOfMemoryError):
        if phase == "val":
            evaluator.val_metrics(model, model, nullcontext, micro_batch=4, seq_len=32)
        else:
            evaluator.hellaswag(model)
    assert model.training


@pytest.mark.parametrize("world_size", [1, 3])
def test_eval_tokens_beyond_the_val_split_read_it_once_with_one_note(tmp_path, capsys, monkeypatch, world_size):
    """A val split of 2,000 consecutive ids holds 62 windows of 32. --eval-tokens 16384 (512 windows) would read
    it 8 times over; each eval reads 60 of its windows once instead (15 batches of 4, or 5 on each of 3 ranks,
    each rank its own share), and rank 0 alone says so at start-up."""
    write_shard(tmp_path / "train_000000.bin", np.arange(2000), vocab_size=50257)
    write_shard(tmp_path / "val_000000.bin", np.arange(2000), vocab_size=50257)
    # Each rank's own sums: the all-reduce (a mean) is replaced by this rank's share of it.
    monkeypatch.setattr(evaluation.distributed, "mean_across_ranks", lambda value, info: value / info.world_size)
    batches = 15 // world_size
    seen = []

    def forward(x, y, reduction):
        seen.extend(x[:, 0].tolist())
        return None, torch.zeros(y.shape)

    for rank in range(world_size):
        info = distributed.DistInfo(rank=rank, world_size=world_size)
        evaluator = Evaluator(eval_config("--eval-tokens", "16384"), str(tmp_path), info, torch.device("cpu"),
                              50257, seed=0)
        evaluator.check(micro_batch=4, seq_len=32)
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
        assert notes == ([] if rank else [
            "note: --eval-tokens 16,384 is more than the val split holds (2,000 tokens); each eval reads all of it "
            f"that whole batches hold: 1,920 tokens ({batches} batch{'es' if batches > 1 else ''} of 4 x 32 on "
            f"each of {world_size} rank{'s' if world_size > 1 else ''})"])
        before = len(seen)
        evaluator.val_metrics(forward, torch.nn.Linear(1, 1), nullcontext, micro_batch=4, seq_len=32)
        assert len(seen) - before == batches * 4
    assert len(set(seen)) == len(seen) == 60 and set(seen) <= {32 * w for w in range(62)}  # none twice


# ----------------------------------------------------------------------------- HellaSwag: loading


def fixture_rows() -> list[dict]:
    with open(FIXTURE) as f:
        return [json.loads(line) for line in f]


def test_fixture_is_in_hellaswag_format():
    rows = fixture_rows()
    assert len(rows) == 8
    for row in rows:
        assert {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split", "split_type",
                "label"} <= set(row)
        assert row["ctx"] == f"{row['ctx_a']} {row['ctx_b']}" and len(row["endings"]) == 4


def test_load_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from_jsonl = load_hellaswag(FIXTURE)
    assert len(from_jsonl) == 8 and [e.label for e in from_jsonl] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert from_jsonl[0] == Example(fixture_rows()[0]["ctx"], tuple(fixture_rows()[0]["endings"]), 0)
    assert load_hellaswag(FIXTURE, 3) == from_jsonl[:3]
    rows = [{**row, "label": str(row["label"])} for row in fixture_rows()]  # the hub's labels are strings
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "hs.parquet")
    assert load_hellaswag(str(tmp_path / "hs.parquet")) == from_jsonl
    assert load_hellaswag(str(tmp_path / "hs.parquet"), 5) == from_jsonl[:5]


@pytest.mark.parametrize("change, message", [
    (lambda row: row.pop("ctx"), r":2: 'ctx' must be a string"),
    (lambda row: row.update(endings=row["endings"][:3]), r":2: 'endings' must be a list of 4 strings"),
    (lambda row: row.update(endings=[1, 2, 3, 4]), r"'endings' must be a list of 4 strings"),
    (lambda row: row.update(label=4), r"'label' must be 0..3"),
    (lambda row: row.update(label="b"), r"'label' must be 0..3"),
    (lambda row: row.update(label=""), r"'label' must be 0..3"),  # as in HellaSwag's unlabelled test split
    (lambda row: row.update(label=True), r"'label' must be 0..3"),
])
def test_malformed_rows_are_refused_in_one_line(tmp_path, change, message):
    rows = fixture_rows()
    change(rows[1])
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UsageError, match=message) as e:
        load_hellaswag(str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_unreadable_sources_are_refused_in_one_line(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"ctx": "a"\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "rows.csv").write_text("ctx,endings,label\n")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    cases = {"broken.jsonl": "broken.jsonl:1: invalid JSON", "missing.jsonl": "no such file",
             "empty.jsonl": "no examples", "rows.csv": "expected a .jsonl or .parquet file",
             "broken.parquet": "not a readable parquet file"}
    for name, message in cases.items():
        with pytest.raises(UsageError, match=re.escape(message)) as e:
            load_hellaswag(str(tmp_path / name))
        assert "\n" not in str(e.value)


def test_training_refuses_bad_hellaswag_flags_at_startup(tmp_path, tiny_data, capsys):
    base = ["--data", tiny_data, *TINY_FLAGS, "--device", "cpu"]
    cases = [(["--eval-hellaswag", "4", "--hellaswag-path", str(tmp_path / "nope.jsonl")], "no such file"),
             (["--eval-hellaswag", "4", "--hellaswag-path", FIXTURE], "beyond --vocab-size 256"),
             (["--eval-hellaswag", "-1"], "--eval-hellaswag must be >= 0"),
             (["--eval-hellaswag", "4", "--eval-interval", "0"], "needs --eval-interval > 0")]
    for i, (flags, message) in enumerate(cases):
        with pytest.raises(SystemExit) as e:
            train.main(base + ["--out-dir", str(tmp_path / str(i))] + flags)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err


# ----------------------------------------------------------------------------- HellaSwag: scoring


def test_choice_batch_layout_and_truncation():
    enc = get_tokenizer()
    example = Example("A man pours flour. He", ("kneads", "sings a long song"), 0)
    context = enc.encode_ordinary(example.context)
    x, y = choice_batch(load_tokenizer(), example, max_len=32)
    for row, ending in enumerate(example.endings):
        tokens = context + enc.encode_ordinary(" " + ending)
        n = len(tokens) - 1
        assert x[row, :n].tolist() == tokens[:-1]
        assert y[row, :n].tolist() == [IGNORE_INDEX] * (len(context) - 1) + tokens[len(context):]
        assert (y[row, n:] == IGNORE_INDEX).all()  # right padding counts for nothing
    short_x, short_y = choice_batch(load_tokenizer(), example, max_len=4)  # the context's last tokens are kept
    tail = enc.encode_ordinary(" sings a long song")
    assert short_x[1].tolist() == (context + tail)[-5:-1]
    assert short_y[1][short_y[1] != IGNORE_INDEX].tolist() == tail
    empty_x, _ = choice_batch(load_tokenizer(), Example("", ("a", "b"), 0), max_len=32)
    assert empty_x[0, 0] == EOT  # an empty context conditions on end-of-text


def test_ending_scores_normalise_by_length():
    """Ending 0 has 2 tokens of loss 1 (mean 1, sum 2); ending 1 has 4 tokens of 0.9 (mean 0.9, sum 3.6):
    the mean picks ending 1, the sum ending 0."""
    losses = torch.tensor([[5.0, 1.0, 1.0, 0.0, 0.0], [5.0, 0.9, 0.9, 0.9, 0.9]])
    targets = torch.tensor([[IGNORE_INDEX, 7, 7, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX, 7, 7, 7, 7]])
    mean, total = ending_scores(losses, targets)
    torch.testing.assert_close(mean, torch.tensor([1.0, 0.9]))
    torch.testing.assert_close(total, torch.tensor([2.0, 3.6]))
    assert mean.argmin() == 1 and total.argmin() == 0


def hand_scores(model, enc, example) -> tuple[list[float], list[float]]:
    """Each ending's mean and summed loss from the full logits of context + " " + ending, one at a time."""
    context = enc.encode_ordinary(example.context)
    means, sums = [], []
    for ending in example.endings:
        tail = enc.encode_ordinary(" " + ending)
        idx = torch.tensor([context + tail])
        with torch.no_grad():
            logits = model(idx[:, :-1])[0][0]
        losses = F.cross_entropy(logits[len(context) - 1:], idx[0, len(context):], reduction="none")
        means.append(losses.mean().item())
        sums.append(losses.sum().item())
    return means, sums


def test_scorer_reproduces_the_hand_computed_choices():
    model, enc = gpt2_model(), get_tokenizer()
    evaluator = Evaluator(eval_config("--hellaswag-path", FIXTURE), None, distributed.DistInfo(),
                          torch.device("cpu"), 50257, seed=0)
    evaluator.load_hellaswag(32, None)
    right = right_sum = 0
    for (x, y, label), example in zip(evaluator.choices, load_hellaswag(FIXTURE)):
        with torch.no_grad():
            mean, total = ending_scores(model(x, y, reduction="none")[1], y)
        means, sums = hand_scores(model, enc, example)
        torch.testing.assert_close(mean, torch.tensor(means), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(total, torch.tensor(sums), rtol=1e-5, atol=1e-5)
        right += int(np.argmin(means) == label)
        right_sum += int(np.argmin(sums) == label)
    assert evaluator.hellaswag(model) == {"hellaswag_acc": right / 8, "hellaswag_acc_sum": right_sum / 8}
    assert not model.training  # the model's mode is put back


def test_ranks_split_the_examples(monkeypatch):
    """Three ranks take examples 0,3,6 / 1,4,7 / 2,5 and run the same number of forwards (the third repeats
    one without counting it); their counts add up to one process's."""
    model = gpt2_model()
    cfg = eval_config("--hellaswag-path", FIXTURE)
    whole = Evaluator(cfg, None, distributed.DistInfo(), torch.device("cpu"), 50257, seed=0)
    whole.load_hellaswag(32, None)
    expected = whole.hellaswag(model)
    # Each rank's own share: the all-reduce (a mean) is replaced by this rank's count over the world size,
    # and rank 0's broadcast of the rows by the rows.
    monkeypatch.setattr(evaluation.distributed, "mean_across_ranks", lambda value, info: value / info.world_size)
    monkeypatch.setattr(evaluation.distributed, "broadcast_object", lambda obj, info: (load_hellaswag(FIXTURE), None))
    forwards, total = [], {"hellaswag_acc": 0.0, "hellaswag_acc_sum": 0.0}
    for rank in range(3):
        info = distributed.DistInfo(rank=rank, world_size=3)
        evaluator = Evaluator(cfg, None, info, torch.device("cpu"), 50257, seed=0)
        evaluator.load_hellaswag(32, None)
        calls = []
        handle = model.register_forward_hook(lambda *args: calls.append(1))
        for key, value in evaluator.hellaswag(model).items():
            total[key] += value
        handle.remove()
        forwards.append(len(calls))
    assert forwards == [3, 3, 3]
    assert total == pytest.approx(expected)


def test_every_eval_and_every_seed_reads_the_same_windows_spread_over_the_val_split(tmp_path):
    tokens = np.arange(64 * 33 + 1, dtype=np.uint16)  # 64 windows of 33 tokens, each token its own position
    write_shard(tmp_path / "train_000000.bin", tokens, vocab_size=50257)
    write_shard(tmp_path / "val_000000.bin", tokens, vocab_size=50257)

    def first_positions(seed):
        evaluator = Evaluator(eval_config("--eval-tokens", "256"), str(tmp_path), distributed.DistInfo(),
                              torch.device("cpu"), 50257, seed=seed)
        x, _ = next(evaluator._loader(evaluator.sources[0], 8, 32))
        return sorted(x[:, 0].tolist())

    read = first_positions(0)
    assert read == first_positions(1234)  # not the run's seed: runs compare on the same tokens
    assert read != [32 * w for w in range(8)]  # not the split's first windows
    assert max(read) >= 32 * 32  # from its second half too
