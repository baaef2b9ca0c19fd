import json
import os
import shlex

import numpy as np
import pytest
import torch

import prepare
import score
import train
from cli import DataError, UsageError
from conftest import TINY_FLAGS, WORD_TEXT, spawn_on_gloo
from data import ShardLoader
from mixture import (MIX_BLOCK, MixtureLoader, Source, absolute_data, check_sources, open_loader, parse_data,
                     record_dir, row_sources, same_tokenizer)
from shards import write_data_record, write_shard

T = 8
WEB, CODE = 0, 3000  # each source's first token: a row's first token says which source and window it is
VOCAB = 4096  # above every token of both sources, which are all distinct


def write_source(root, shard_lengths, first_token, val_tokens=400):
    """Train shards whose tokens count up from first_token across the source, and a val shard after them."""
    os.makedirs(root, exist_ok=True)
    token = first_token
    for i, n in enumerate(shard_lengths):
        write_shard(os.path.join(root, f"train_{i:06d}.bin"), np.arange(token, token + n), VOCAB)
        token += n
    write_shard(os.path.join(root, "val_000000.bin"), np.arange(token, token + val_tokens), VOCAB)
    return str(root)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    web = write_source(root / "web", [801, 641, 961], WEB)  # 100 + 80 + 120 windows of 8
    code = write_source(root / "code", [41, 33], CODE)  # 5 + 4 windows: it runs out often
    return parse_data(f"web={web}:0.7,code={code}:0.3")


def mixture(sources, **kwargs):
    return MixtureLoader(sources, **{"batch_size": 4, "seq_len": T, "seed": 5, "prefetch": 0, **kwargs})


def alone(source, **kwargs):
    return ShardLoader(source.dir, **{"batch_size": 1, "seq_len": T, "seed": 5, "prefetch": 0, **kwargs})


def rows(loader, steps):
    return np.concatenate([next(loader)[0].numpy() for _ in range(steps)])


def source_of(row):
    """The index of a row's source among the sources, which parse_data sorts by name: code, then web."""
    return 0 if row[0] >= CODE else 1


# ----------------------------------------------------------------------------- --data


def test_data_is_a_directory_or_named_weighted_sources(tmp_path):
    assert parse_data("data/web") == [Source("", "data/web", 1.0)]
    assert parse_data("data/lr=1/x") == [Source("", "data/lr=1/x", 1.0)]  # no NAME before the "="
    mix = [Source("code", "/abs/c:de", 0.25), Source("web", "data/web", 0.75)]  # sorted by name
    assert parse_data("web=data/web:3,code=/abs/c:de:1") == mix == parse_data("code=/abs/c:de:1,web=data/web:3")
    assert [s.weight for s in parse_data("a=x:1e308,b=y:1e308")] == [0.5, 0.5]  # no overflow to inf
    odd = tmp_path / "a=b:1"  # a directory that exists is one source whatever its name holds
    odd.mkdir()
    assert parse_data(str(odd)) == [Source("", str(odd), 1.0)]


def test_a_run_records_its_data_with_absolute_directories_names_and_weights_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_data("data/web") == f"{tmp_path}/data/web" and absolute_data("/abs/x/") == "/abs/x"
    assert absolute_data("web=data/web:3,code=/abs/c:de:1e-1") == f"web={tmp_path}/data/web:3,code=/abs/c:de:1e-1"
    (tmp_path / "a=b:1").mkdir()  # a directory whose name reads as a mixture is one
    assert absolute_data("a=b:1") == f"{tmp_path}/a=b:1" and absolute_data(None) is None
    mix = "web=data/web:3,code=c:1"
    assert [s.weight for s in parse_data(absolute_data(mix))] == [s.weight for s in parse_data(mix)]


@pytest.mark.parametrize("spec, words", [
    ("web=d:0.7,code=e", "'code=e' is not NAME=DIR:WEIGHT"),
    ("web=d:0.7,=e:1", "'=e:1' is not NAME=DIR:WEIGHT"),
    ("web=d:1,we b=e:1", "'we b=e:1' is not NAME=DIR:WEIGHT"),
    ("web=d:0", "the weight of source web must be a positive number, got '0'"),
    ("web=d:-1", "must be a positive number, got '-1'"),
    ("web=d:nan", "got 'nan'"),
    ("web=d:inf", "got 'inf'"),
    ("web=d:0.7x", "got '0.7x'"),
    ("web=d:1,web=e:1", "source web is named twice"),
    ("a=d:1e-320,b=e:1e300", "the weight of source a is too small against the others to draw a row"),
    ("a=d:1,z=e:1e-20", "the weight of source z is too small against the others to draw a row"),  # 1 + 1e-20 == 1
])
def test_a_mixture_that_does_not_parse_is_one_line(spec, words):
    with pytest.raises(UsageError, match=words):
        parse_data(spec)


def test_a_text_file_in_a_mixture_is_told_the_commands_that_keep_the_mixture(tmp_path, monkeypatch, capsys):
    """A text file given as a mixture's source: prepare it with the other sources' tokenizer (a trained one by
    its tokenizer.json), then the same mixture with the prepared directory in its place; both, run as given,
    give sources that check_sources takes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs.jsonl").write_text((json.dumps({"text": WORD_TEXT}) + "\n") * 50)
    prepare.prepare(tmp_path / "docs.jsonl", "web", val_tokens=100, train_tokenizer=300)
    (tmp_path / "corpus.txt").write_text(WORD_TEXT)
    with pytest.raises(DataError) as e:
        check_sources(parse_data("web=web:2,text=corpus.txt:1"))
    first, _, then = str(e.value).partition(": run python prepare.py ")[2].partition(", then --data ")
    assert first == "--input corpus.txt --out data/corpus --tokenizer web/tokenizer.json", str(e.value)
    assert then == "text=data/corpus:0.5,web=web:1"
    assert prepare.main([*shlex.split(first), "--val-tokens", "3"]) == 0, capsys.readouterr().err
    check_sources(parse_data(then))


def record(tokenizer="gpt2", sha="aa", n_vocab=50257, eot=50256):
    return {"tokenizer": tokenizer, "tokenizer_sha256": sha, "n_vocab": n_vocab, "eot": eot}


def test_sources_must_exist_and_share_one_tokenizer(tmp_path):
    a, b, c = (write_source(tmp_path / name, [81], 0) for name in "abc")
    with pytest.raises(DataError, match=r"--data: source b \(.*/nope\): no such directory"):
        check_sources(parse_data(f"a={a}:1,b={tmp_path / 'nope'}:1"))
    (tmp_path / "corpus.txt").write_text("text, not shards")
    with pytest.raises(DataError) as e:  # text given where prepared shards belong: the command that prepares it
        check_sources(parse_data(str(tmp_path / "corpus.txt")))
    assert str(e.value) == (f"--data: {tmp_path / 'corpus.txt'} is a file, not a directory of prepared shards: run "
                            f"python prepare.py --input {tmp_path / 'corpus.txt'} --out data/corpus, then --data "
                            "data/corpus")
    with pytest.raises(DataError, match=r"source a \(.*\) and source b \(.*\) are one directory: they would read"):
        check_sources(parse_data(f"a={a}:1,b={a}/.:1"))
    assert record_dir(parse_data(f"a={a}:1,b={b}:1")) == a  # no data.json yet: the first source's
    write_data_record(b, record())
    assert record_dir(parse_data(f"a={a}:1,b={b}:1")) == b  # the first source that records the tokenizer
    write_data_record(a, record())
    check_sources(parse_data(f"a={a}:1,b={b}:1,c={c}:1"))  # c records nothing (llm.c shards): not compared
    old = {"tokenizer": "gpt2", "n_vocab": 50257}  # made before data.json held a sha256 and a separator
    assert same_tokenizer(old, record()) and not same_tokenizer(old, record(eot=0))
    write_data_record(b, record("tok.json", sha="bb", n_vocab=70_000, eot=3))
    with pytest.raises(DataError, match=r"source a \(.*\) and source b \(.*\) were prepared with different "
                                        r"tokenizers \(gpt2, separator 50256; tok.json, separator 3\)"):
        check_sources(parse_data(f"a={a}:1,b={b}:1"))
    write_data_record(b, record(eot=50255))  # the same tokenizer, another document separator
    with pytest.raises(DataError, match="different tokenizers"):
        check_sources(parse_data(f"a={a}:1,b={b}:1"))


# ----------------------------------------------------------------------------- the draw


def test_a_rows_source_depends_on_the_seed_and_the_row_alone():
    weights = (0.5, 0.3, 0.2)
    whole = row_sources(weights, 7, 0, 3 * MIX_BLOCK)
    for start, count in ((0, 10), (MIX_BLOCK - 3, 9), (5000, 1), (2 * MIX_BLOCK, MIX_BLOCK)):
        assert (row_sources(weights, 7, start, count) == whole[start:start + count]).all()
    assert (row_sources(weights, 8, 0, 100) != whole[:100]).any()
    assert len(row_sources(weights, 7, 123, 0)) == 0


def test_proportions_are_the_weights_within_binomial_noise():
    weights, n = np.array([0.6, 0.3, 0.1]), 200_000
    counts = np.bincount(row_sources(weights, 0, 0, n), minlength=3)
    sigma = np.sqrt(n * weights * (1 - weights))
    assert (np.abs(counts - n * weights) < 4 * sigma).all(), counts


def test_each_batch_draws_its_rows_from_the_sources_in_proportion(sources):
    drawn = [source_of(r) for r in rows(mixture(sources, batch_size=16), 150)]  # 2,400 rows
    n, p = len(drawn), 0.7  # web's share
    assert abs(sum(drawn) - n * p) < 4 * np.sqrt(n * p * (1 - p))


# ----------------------------------------------------------------------------- each source's own stream


def test_each_source_reads_its_rows_in_the_order_a_run_on_it_alone_would(sources):
    mixed = rows(mixture(sources), 60)  # 240 rows: code's 9 windows run out many times, web's 300 do not
    for index, source in enumerate(sources):
        own = np.array([r for r in mixed if source_of(r) == index])
        assert (own == rows(alone(source), len(own))).all()
    web = mixed[[source_of(r) == 1 for r in mixed]]
    assert len(web) == len({int(r[0]) for r in web})  # code's many epochs did not repeat a web row


def test_a_source_that_runs_out_starts_its_next_epoch_alone(sources):
    loader = mixture(sources)
    code = []
    while len(code) < 18:  # two epochs of code's 9 windows
        code += [int(r[0]) for r in next(loader)[0].numpy() if source_of(r) == 0]
    starts = {CODE + w * T for w in range(5)} | {CODE + 41 + w * T for w in range(4)}
    assert set(code[:9]) == starts and set(code[9:18]) == starts  # each window once an epoch
    assert code[:9] != code[9:18]  # in a new permutation
    state = loader.state_dict()["mixture"]
    epochs = loader.record_fields()  # read so far, as the metrics record them
    assert state["code"]["next_window"] >= 0 and epochs["epoch/code"] >= 18 / 9 - 1e-9
    assert 0 < epochs["epoch/web"] < 0.5


@pytest.mark.parametrize("batch_size, world_size", [(4, 1), (2, 2), (1, 4)])
def test_resume_is_exact_at_any_micro_batch_and_world_size(sources, batch_size, world_size):
    straight = mixture(sources)
    expected = rows(straight, 30)[80:]  # 120 rows; the resume comes after 80, code mid-epoch
    first = mixture(sources)
    rows(first, 20)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint's meta holds it
    assert 0 < state["mixture"]["code"]["next_window"] % 9 and state["rows"] == 80
    ranks = [mixture(sources, batch_size=batch_size, rank=r, world_size=world_size) for r in range(world_size)]
    for loader in ranks:
        loader.load_state_dict(state)
    steps = 40 // (batch_size * world_size)
    resumed = np.concatenate([np.concatenate([next(loader)[0].numpy() for loader in ranks]) for _ in range(steps)])
    assert (resumed == expected).all()


def test_a_loader_state_is_refused_by_a_loader_of_other_sources(sources):
    mixed, single = mixture(sources), alone(sources[0])
    with pytest.raises(DataError, match="is of a mixture of sources \\(code, web\\); this run reads one directory"):
        single.load_state_dict(mixed.state_dict())
    with pytest.raises(DataError, match="is of one --data directory; this run reads a mixture of code, web"):
        mixed.load_state_dict(single.state_dict())
    renamed = mixture([sources[0]._replace(name="py"), sources[1]])  # --allow-data-change's: py starts anew
    renamed.load_state_dict({**mixed.state_dict(), "rows": 40})
    assert renamed._next.rows == 40 and renamed._next.read[0] == 0 and renamed._next.at[0] == (0, 0, 0)
    with pytest.raises(DataError, match="loader state of source code was saved with --packing windows"):
        mixture(sources, packing="bos").load_state_dict(mixed.state_dict())
    reweighted = [s._replace(weight=w) for s, w in zip(sources, (0.5, 0.5))]  # the draw goes on with new weights
    mixture(reweighted).load_state_dict(mixed.state_dict())
    rows(mixed, 5)
    state = mixed.state_dict()
    state["mixture"]["web"]["num_windows"] += 1  # web prepared again since, into other shards
    with pytest.raises(DataError, match="loader state of source web does not fit this data: saved num_windows=301"):
        mixture(sources).load_state_dict(state)
    resumed = mixture(sources)
    assert resumed.load_state_dict(state, other_data=True) == ["web"]  # --allow-data-change: web starts anew
    assert resumed._next.rows == 20 and resumed._next.read[1] == 0 and resumed._next.at[1] == (0, 0, 0)
    assert resumed._next.at[0] == mixed._next.at[0] != (0, 0, 0)  # code goes on where it was


def _disjoint_ranks(rank, world_size, sources):
    loader = MixtureLoader(sources, batch_size=3, seq_len=T, rank=rank, world_size=world_size, seed=5)
    mine = [int(r[0]) for r in rows(loader, 10)]
    loader.close()
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, mine)
    if rank == 0:
        single = [int(r[0]) for r in rows(mixture(sources, batch_size=3 * world_size), 10)]
        by_step = [sum((g[3 * s:3 * s + 3] for g in gathered), []) for s in range(10)]
        assert sum(by_step, []) == single  # the ranks' rows, step by step, are one process's
        assert not set(gathered[0]) & set(gathered[1])  # web rows, and code's within an epoch, never twice


def test_two_gloo_ranks_take_disjoint_rows_of_one_stream(sources, tmp_path):
    big = [s._replace(weight=w) for s, w in zip(sources, (0.03, 0.97))]  # code's 9 windows last both ranks
    spawn_on_gloo(_disjoint_ranks, 2, tmp_path, big)


def write_documents(root, lengths, first_token, bos=VOCAB - 1):
    """Documents of these lengths (each counting its leading bos) whose other tokens count up from first_token,
    cut into train shards of 60 tokens, with a data.json naming bos as the separator."""
    os.makedirs(root)
    tokens = first_token + np.arange(sum(lengths))
    tokens[np.cumsum([0, *lengths[:-1]])] = bos
    for i, first in enumerate(range(0, len(tokens), 60)):
        write_shard(os.path.join(root, f"train_{i:06d}.bin"), tokens[first:first + 60], VOCAB)
    write_data_record(str(root), record("test", n_vocab=VOCAB, eot=bos))
    return str(root)


def test_under_packing_bos_each_sources_rows_start_at_its_documents(tmp_path):
    web = write_documents(tmp_path / "web", [5, 12, 3, 9, 20] * 8, WEB)
    code = write_documents(tmp_path / "code", [7, 2, 14] * 6, CODE)
    sources = parse_data(f"web={web}:1,code={code}:1")
    loader = mixture(sources, packing="bos", batch_size=8)
    batch = rows(loader, 10)
    assert (batch[:, 0] == VOCAB - 1).all()
    assert set(loader.record_fields()) == {"epoch/web", "epoch/code", "data_cropped_frac/web",
                                           "data_cropped_frac/code"}
    is_code = [(row[row != VOCAB - 1] >= CODE).all() for row in batch]
    for index, source in enumerate(sources):  # each source's rows, in the order its own loader gives them
        own = batch[[flag == (source.name == "code") for flag in is_code]]
        assert 0 < len(own) and (own == rows(alone(source, packing="bos"), len(own))).all()


def test_the_plain_directory_gets_the_plain_loader(sources, tiny_data):
    assert type(open_loader(parse_data(tiny_data), batch_size=1, seq_len=T, prefetch=0)) is ShardLoader
    assert type(open_loader(sources, batch_size=1, seq_len=T, prefetch=0)) is MixtureLoader


# ----------------------------------------------------------------------------- in a run


def run(tmp_path, data, *extra):
    return train.main(["--data", data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--vocab-size", str(VOCAB),
                       "--warmup", "1", "--eval-tokens", "256", "--device", "cpu", "--dtype", "fp32",
                       "--compile", "off", *extra])


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_mixture_run_reports_each_source_and_resumes_bit_identically(sources, tmp_path, capsys):
    code, web = sources
    spec = f"web={web.dir}:0.7,code={code.dir}:0.3"
    flags = ["--max-steps", "4", "--eval-interval", "2", "--ckpt-interval", "2", "--keep-ckpts", "3",
             "--seq-len", str(T)]
    run(tmp_path / "full", spec, *flags)
    out, err = capsys.readouterr()
    assert f"data             mixture code={code.dir} (30.0%), web={web.dir} (70.0%)" in out
    assert "tokens of source web's 2,400-token train split" in out and "source code's 72-token" in out
    assert "warning: the run will read" not in err  # code: 38 of its 72 tokens
    summary = out[out.index("run summary"):]
    assert "epochs            of each source's train split, read: code " in summary
    full = metrics(tmp_path / "full")
    evaluated = full[1]
    assert evaluated["val_loss"] == pytest.approx(0.7 * evaluated["val_loss/web"] + 0.3 * evaluated["val_loss/code"])
    assert evaluated["epoch/code"] > 0 and evaluated["epoch"] is None

    assert score.main(["--ckpt", str(tmp_path / "full"), "--task", "bpb", "--n", "64", "--batch-size", "2",
                       "--device", "cpu", "--dtype", "fp32"]) == 0  # the checkpoint's own mixture, by default
    lines = capsys.readouterr().out.splitlines()
    assert f"val tokens of {spec} " in lines[0] and lines[1].startswith("val_loss ")
    assert [line.split()[0] for line in lines[-4:]] == ["val_loss/code", "val_bpb/code", "val_loss/web", "val_bpb/web"]
    with pytest.raises(UsageError, match=f"whose source code \\({code.dir}-gone\\) is not there"):
        score.val_data(None, {"train_config": {"data": {"data": spec.replace(code.dir, code.dir + "-gone")}}}, "c.pt")

    os.makedirs(tmp_path / "resumed")
    for name in os.listdir(tmp_path / "full"):
        if name.startswith("ckpt_00000002"):
            os.link(tmp_path / "full" / name, tmp_path / "resumed" / name)
    run(tmp_path / "resumed", spec, *flags, "--resume")
    resumed = metrics(tmp_path / "resumed")
    for a, b in zip(full[2:], resumed[-2:]):
        assert (a["train_loss"], a["epoch/web"], a["epoch/code"]) == (b["train_loss"], b["epoch/web"], b["epoch/code"])
        assert a.get("val_loss/code") == b.get("val_loss/code")


def test_the_advice_of_a_resume_on_other_sources_works_when_followed(sources, tmp_path, capsys):
    """Each refusal's advice, followed, resumes: a source added or removed needs --allow-data-change (the new
    source starts at its beginning); one directory against a mixture needs the checkpoint's own --data."""
    code, web = sources
    extra = write_source(tmp_path / "extra", [401], CODE)
    mix, more = f"web={web.dir}:0.7,code={code.dir}:0.3", f"web={web.dir}:0.6,code={code.dir}:0.2,extra={extra}:0.2"
    flags = ["--max-steps", "2", "--eval-interval", "0", "--ckpt-interval", "2", "--seq-len", str(T),
             "--allow-lr-rewarm"]  # each resume lengthens a run that had begun its decay
    run(tmp_path / "mix", mix, *flags)
    capsys.readouterr()

    def refused(out, data, *extra_flags):
        with pytest.raises(SystemExit) as exit_:
            run(out, data, *flags, *extra_flags)
        err = capsys.readouterr().err.strip().splitlines()  # notes of the settings changed, then the refusal
        assert exit_.value.code == 2 and err[-1].startswith("error: ") and "Traceback" not in "".join(err), err
        return err[-1]

    for data, steps in [(more, "4"), (f"web={web.dir}:1,extra={extra}:1", "6")]:  # a source added, then removed
        assert refused(tmp_path / "mix", data, "--max-steps", steps, "--resume").endswith(
            "pass --allow-data-change to resume on them anyway")
        run(tmp_path / "mix", data, *flags, "--max-steps", steps, "--resume", "--allow-data-change")
    records = metrics(tmp_path / "mix")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert "epoch/extra" not in records[1] and records[3]["epoch/extra"] > 0 and "epoch/code" not in records[5]

    run(tmp_path / "one", web.dir, *flags)
    capsys.readouterr()
    advice = refused(tmp_path / "one", mix, "--max-steps", "3", "--resume", "--allow-data-change")
    assert advice == (f"error: --resume: the checkpoint trained on one directory and this run's --data is a mixture "
                      f"of sources; resume with the checkpoint's --data ({web.dir}), or start a new run from its "
                      f"weights (hf.py, then --from-hf)")
    run(tmp_path / "one", web.dir, *flags, "--max-steps", "3", "--resume")
    assert metrics(tmp_path / "one")[-1]["step"] == 3


def test_bad_mixtures_are_one_line_at_start_up(tmp_path, capsys):
    web, code = write_source(tmp_path / "web", [801], WEB), write_source(tmp_path / "code", [81], CODE)
    no_val = write_source(tmp_path / "noval", [81], CODE)
    os.remove(os.path.join(no_val, "val_000000.bin"))
    ours, theirs = write_source(tmp_path / "ours", [81], CODE), write_source(tmp_path / "theirs", [81], CODE)
    write_data_record(ours, record(n_vocab=VOCAB, eot=0))
    write_data_record(theirs, record("tok.json", sha="bb", n_vocab=VOCAB, eot=0))
    cases = [(f"web={web}:0.7,code={code}:x", "--data: the weight of source code must be a positive number"),
             (f"web={web}:1,code={tmp_path}/gone:1", f"--data: source code ({tmp_path}/gone): no such directory"),
             (f"web={web}:0.7,code={no_val}:0.3", f"--data: source code ({no_val}) has no usable val split (no val "
                                                  "shards (val_*.bin)"),
             (f"ours={ours}:1,theirs={theirs}:1", "were prepared with different tokenizers")]
    errors = []
    for i, (spec, words) in enumerate(cases):
        with pytest.raises(SystemExit) as exit_:
            run(tmp_path / f"out{i}", spec, "--max-steps", "1", "--seq-len", str(T))
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and words in err[0], err
        errors.append(err[0])
    assert ("so val_loss, the weighted mean of the sources' val losses, would leave out its 30.0%: prepare it with a "
            "val split (prepare.py --val-tokens N), or train without evaluation (train.py --eval-interval 0)"
            ) in errors[2]


def test_a_mixtures_val_figures_are_the_training_distributions(sources, monkeypatch):
    from config import EvalConfig
    from distributed import DistInfo
    from evaluation import Evaluator

    evaluator = Evaluator(EvalConfig(), f"code={sources[0].dir}:0.2,web={sources[1].dir}:0.8", DistInfo(),
                          torch.device("cpu"), VOCAB, 0)
    evaluator.token_bytes = torch.ones(VOCAB)  # bytes are known
    sums = {"code": [300.0, 100.0, 250.0, 250.0], "web": [400.0, 200.0, 360.0, 900.0]}  # nats, tokens, text's
    monkeypatch.setattr(evaluator, "source_sums", lambda source, *args: sums[source.name])
    metrics = evaluator.val_metrics(None, None, None, 2, T)
    assert metrics["val_loss"] == pytest.approx(0.2 * 3.0 + 0.8 * 2.0)
    # Per token drawn: 0.2 x 2.5 + 0.8 x 1.8 text nats over 0.2 x 2.5 + 0.8 x 4.5 bytes, in bits.
    assert metrics["val_bpb"] == pytest.approx((0.2 * 2.5 + 0.8 * 1.8) / (0.2 * 2.5 + 0.8 * 4.5) / np.log(2))
    assert metrics["val_bpb/web"] == pytest.approx(360 / 900 / np.log(2)) and metrics["val_loss/code"] == 3.0


def test_what_a_step_record_says_of_the_data_does_not_depend_on_the_prefetch(tmp_path):
    web = write_documents(tmp_path / "web", [5, 12, 3, 9, 20] * 8, WEB)
    code = write_documents(tmp_path / "code", [7, 2, 14] * 6, CODE)
    sources = parse_data(f"web={web}:1,code={code}:1")
    ahead, inline = (mixture(sources, packing="bos", batch_size=2, prefetch=p) for p in (3, 0))
    for _ in range(40):
        next(ahead), next(inline)
        assert ahead.record_fields() == inline.record_fields()
    ahead.close()


def test_a_resume_compares_shards_by_name_not_by_their_order():
    from data import data_change

    saved = [["code/train_000000.bin", 10, "aa"], ["web/train_000000.bin", 20, "bb"]]
    assert data_change(saved, saved[::-1]) is None
    assert data_change(saved, [saved[0], ["web/train_000000.bin", 20, "cc"]]) == \
        "shard contents differ (web/train_000000.bin)"
