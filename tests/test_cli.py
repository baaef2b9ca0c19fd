"""cli.py: counts in words, and every program's --help, which states each option's default."""

import argparse
import importlib
import os
import sys

import pytest

from cli import plural

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
# The programs whose main() parses its command line first; train.py's flags come from config.py's dataclasses.
PROGRAMS = ("prepare", "sample", "score", "hf", "checkpoint", "act_ckpt", "anchor", "data_prep", "default_run",
            "docs_corpus", "ladder", "loss_compile", "loss_memory", "muon_step", "optimizers", "plan_accuracy", "plot",
            "profile_step", "recipe", "recipe_verdict", "tail_ema", "throughput", "tokenizer_speed")


def test_plural_counts_one_in_the_singular_with_thousands_separators():
    assert plural(1, "shard") == "1 shard" and plural(0, "shard") == "0 shards" and plural(2, "window") == "2 windows"
    assert plural(12_345, "token") == "12,345 tokens"
    assert plural(1, "batch", "batches") == "1 batch" and plural(3, "batch", "batches") == "3 batches"


def parser_of(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser that `NAME.py --help` prints, caught as it prints."""
    module = importlib.import_module(name)
    printed = []
    monkeypatch.setattr(argparse.ArgumentParser, "print_help", lambda parser, file=None: printed.append(parser))
    with pytest.raises(SystemExit):
        module.main(["--help"])
    return printed[0]


def help_line(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """An option's entry in --help, on one line."""
    formatter = parser.formatter_class(parser.prog)
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_option_with_a_default_states_it_in_help(name, monkeypatch):
    """Every option that takes a value and has a default (not None or empty) says what it is."""
    parser = parser_of(name, monkeypatch)
    with_default = [a for a in parser._actions  # argparse has no public list of a parser's actions
                    if a.option_strings and a.nargs != 0 and a.default not in (None, "", [], argparse.SUPPRESS)]
    hidden = [a.option_strings[0] for a in with_default if "(default: " not in help_line(parser, a)]
    assert not hidden, f"{name}.py --help hides the default of {', '.join(hidden)}"


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_program_parses_with_a_parser_that_errs_in_one_line(name, monkeypatch):
    """Not argparse's own error(), which prints the usage lines: cli's parsers, or one that raises the program's
    own error for its main to print (recipe.py, optimizers.py). A program that hands unknown flags on to
    train.py (throughput.py, ladder.py, ...) shows its own parser's errors only for its own flags."""
    assert type(parser_of(name, monkeypatch)).error is not argparse.ArgumentParser.error


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_flag_no_program_has_is_one_line_and_exit_2(name, capsys):
    """Every program, the benchmarks too: `error: ...` on one line, no usage lines, no traceback, exit status 2
    (the line names the flag, or what the recipe benchmarks check first, their corpus; with a corpus there, they
    refuse the flag as train.py would, before any run)."""
    module = importlib.import_module(name)
    try:
        code = module.main(["--no-such-flag"])
    except SystemExit as e:
        code = e.code
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "--no-such-flag" in lines[0] or name in ("recipe", "tail_ema"), lines


def test_sample_help_shows_its_sampling_defaults(capsys):
    import sample

    with pytest.raises(SystemExit):
        sample.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-new-tokens N tokens to generate per sample (default: 200)" in text
    assert "0 is greedy (default: 0.8)" in text and "(0: off) (default: 200)" in text


@pytest.mark.parametrize("argv, message", [
    (["--lrr", "0.1"], "unrecognized arguments: --lrr 0.1; did you mean --lr?"),
    (["--n-layers", "2", "--seq-lenght", "64"], "unrecognized arguments: --n-layers 2 --seq-lenght 64; did you mean "
                                                 "--n-layer for --n-layers?; did you mean --seq-len for --seq-lenght?"),
    (["--evl-interval=3"], "unrecognized arguments: --evl-interval=3; did you mean --eval-interval?"),
    (["--zzz"], "unrecognized arguments: --zzz"),
    (["--", "--lr", "1"], "unrecognized arguments: -- --lr 1"),  # after "--" a flag is a positional, not a typo
    (["--max-step", "3"], "unrecognized arguments: --max-step 3; did you mean --max-steps?"),  # a prefix is no flag
    (["--ckpt", "out/best.pt"], "unrecognized arguments: --ckpt out/best.pt; --ckpt is sample.py's, score.py's and "
                                "hf.py's; train.py continues a run with --resume (its --out-dir's newest checkpoint) "
                                "or starts from a Hugging Face model with --from-hf"),
])
def test_a_mistyped_flag_gets_the_closest_one(argv, message):
    """As a TOML key does (config.read_config_file): train.py's flags, and every parser built on cli's. A prefix
    of a flag is refused, not taken for it: `--ckpt` (sample.py's) would set --ckpt-interval."""
    import config
    from cli import UsageError

    with pytest.raises(UsageError) as e:
        config.build_parser().parse_args(argv)
    assert str(e.value) == message


def test_a_mistyped_flag_is_named_before_the_required_one_it_left_missing():
    """argparse checks the required flags first: `--ot DIR` would say only that --out is missing."""
    from cli import ArgumentParser, UsageError

    parser = ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--out", required=True)
    with pytest.raises(UsageError, match=r"^unrecognized arguments: --ot; did you mean --out\?$"):
        parser.parse_args(["--input", "x", "--ot", "d"])
    with pytest.raises(UsageError, match="^the following arguments are required: --out$"):
        parser.parse_args(["--input", "x", "--", "--not-a-flag"])  # after "--", a positional's value
    one_of = ArgumentParser()
    group = one_of.add_mutually_exclusive_group(required=True)
    group.add_argument("--ckpt")
    group.add_argument("--hf")
    with pytest.raises(UsageError, match=r"^unrecognized arguments: --ckp; did you mean --ckpt\?$"):
        one_of.parse_args(["--ckp", "x"])


def test_a_benchmarks_counts_and_out_file_are_checked_before_it_measures(tmp_path):
    import argparse

    from cli import count, out_problem

    assert count("3") == 3
    for text, said in ("0", "must be >= 1, got 0"), ("-2", "must be >= 1, got -2"), ("x", "a whole number"):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            count(text)
    assert out_problem(None) is None and out_problem(str(tmp_path / "t.md")) is None
    missing = tmp_path / "missing"
    assert out_problem(str(missing / "t.md")) == f"--out {missing}/t.md: no directory {missing}"
    assert out_problem(str(missing / "deeper" / "t.md"), makes_folder=True) is None  # a benchmark that makes it
    for makes_folder in False, True:
        for folder in str(tmp_path), f"{missing}/":  # there, or named as one
            assert out_problem(folder, makes_folder) == f"--out {folder}: a directory, where a file is to be written"
    (tmp_path / "a_file").write_text("")
    assert out_problem(str(tmp_path / "a_file" / "sub" / "t.md"), makes_folder=True) == (
        f"--out {tmp_path}/a_file/sub/t.md: {tmp_path}/a_file is a file, where a directory is to be made")


def test_a_benchmark_that_cannot_write_its_results_ends_in_one_line(capsys):
    import ast

    from cli import WriteError, run_writing_results

    def measured_then_full_disk():
        print("| table |")
        raise WriteError("cannot write file out.md: No space left on device (0 MiB free on its filesystem)")

    with pytest.raises(SystemExit) as e:
        run_writing_results(measured_then_full_disk)
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == "| table |\n"
    assert out.err == "error: cannot write file out.md: No space left on device (0 MiB free on its filesystem)\n"
    for returned, status in (None, None), (2, 2):  # main's own status passes through (None: 0)
        with pytest.raises(SystemExit) as e:
            run_writing_results(lambda: returned)
        assert e.value.code == status
    # Every benchmark that writes its results through atomic is started through it, but those that word the error
    # their own way (recipe.py: its runs are cached).
    for name in PROGRAMS:
        path = os.path.join(REPO, "bench", f"{name}.py")
        source = open(path).read() if os.path.exists(path) else ""
        if "from atomic import" not in source or "WriteError" in source:
            continue
        last = ast.parse(open(path).read()).body[-1]
        assert isinstance(last, ast.If) and ast.unparse(last.body[0]) == "run_writing_results(main)", name
