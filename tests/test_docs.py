"""The documentation: docs/flags.md is what the parsers give, the README stays short and keeps CI's test
command, no page retypes a flag table, every relative link (and its #section) resolves, and the README and
docs name only flags that exist, the default model's true size and the default corpus's true count."""

import ast
import glob
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "docs"))
import make_flags  # noqa: E402
import make_map  # noqa: E402

README = os.path.join(REPO, "README.md")
PAGES = [README, os.path.join(REPO, "bench", "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
TEST_COMMAND = "pip install -r requirements-dev.txt && python -m pytest -q"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_flags_md_is_what_the_parsers_give():
    assert read(make_flags.FLAGS_MD) == make_flags.render(), "docs/flags.md is stale: run python docs/make_flags.py"


def test_check_fails_on_a_stale_file_and_passes_once_written(tmp_path, monkeypatch):
    monkeypatch.setattr(make_flags, "FLAGS_MD", str(tmp_path / "flags.md"))
    (tmp_path / "flags.md").write_text("| `--lr` | 6e-3 | typed by hand |\n")
    assert make_flags.main(["--check"]) == 1
    assert make_flags.main([]) == 0
    assert make_flags.main(["--check"]) == 0
    assert "| `--lr LR` |" in read(tmp_path / "flags.md")


def test_the_readme_map_is_what_the_files_say():
    trees = make_map.product_files()
    assert read(README) == make_map.render(read(README), trees), "README's map is stale: run python docs/make_map.py"
    assert len(make_map.rows(trees)) == len(trees)  # one row a product file, none left over


def test_the_map_takes_a_files_first_paragraph_and_keeps_the_other_rows():
    trees = {"top": ast.parse('"""Wires it all.\n\nMore."""\nimport leaf\n'), "leaf": ast.parse('"""A | leaf."""')}
    readme = "\n".join(["## Where things live", "", *make_map.TABLE_HEAD, "| `old.py` | gone |", "| `docs/` | kept |"])
    assert make_map.render(readme, trees).splitlines()[4:] == ["| `top.py` | Wires it all. |",
                                                               "| `leaf.py` | A \\| leaf. |", "| `docs/` | kept |"]
    with pytest.raises(ValueError, match="nodoc.py has no docstring"):
        make_map.rows({"nodoc": ast.parse("x = 1\n")})


def test_make_map_check_fails_on_a_stale_map_and_a_run_rewrites_it(tmp_path, monkeypatch):
    stale = read(README).replace("| `train.py` |", "| `train.py` | typed by hand |", 1)
    (tmp_path / "README.md").write_text(stale)
    monkeypatch.setattr(make_map, "README", str(tmp_path / "README.md"))
    assert make_map.main(["--check"]) == 1
    assert make_map.main([]) == 0 and read(tmp_path / "README.md") == read(README)


def test_split_default_takes_only_a_single_trailing_default():
    assert make_flags.split_default("tokens per shard (default: 100)") == ("tokens per shard", "100")
    inside = "the split (default: train), or none"
    assert make_flags.split_default(inside) == (inside, "")
    both = "hellaswag: N examples (default: all); bpb: N tokens (default: 16384)"
    assert make_flags.split_default(both) == (both, "")


def test_readme_is_short():
    text = read(README)
    assert len(text.splitlines()) <= 250
    assert len(text.split()) <= 2500


def test_readme_keeps_the_test_command_ci_runs():
    assert TEST_COMMAND in read(README).splitlines()
    assert read(os.path.join(REPO, ".ci", "run")).splitlines()[-1] == TEST_COMMAND


def flag_rows(text: str) -> list[str]:
    """The table rows whose first cell is a flag in code (`--lr` or `--lr LR`): a flag table's rows."""
    return [line for line in text.splitlines() if re.match(r"\| *`--[^`|]*` *\|", line)]


def test_flag_rows_are_told_from_prose_rows():
    assert flag_rows("| `--lr LR` | 6e-3 | peak LR |\n| `--resume auto` resumes when it can | a test |") == [
        "| `--lr LR` | 6e-3 | peak LR |"]


def test_no_page_retypes_a_flag_table():
    for page in PAGES:
        if page != make_flags.FLAGS_MD:
            rows = flag_rows(read(page))
            assert not rows, f"{page}: a hand-typed flag table ({rows[0]}); link docs/flags.md instead"


def anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    return {anchor(line.lstrip("#")) for line in read(path).splitlines() if line.startswith("#")}


def test_anchor_follows_github():
    assert anchor(" Muon's step across ranks") == "muons-step-across-ranks"
    assert anchor(" data.py") == "datapy"


def test_relative_links_resolve():
    for page in PAGES:
        for target in LINK.findall(read(page)):
            if target.startswith(("http://", "https://")):
                continue
            path, _, section = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert os.path.exists(resolved), f"{page}: broken link {target}"
            if section:
                assert section in anchors(resolved), f"{page}: no section #{section} in {path or 'this page'}"


# Flags of other tools that the pages quote: pip's, TensorBoard's and torchrun's.
OTHER_TOOLS_FLAGS = {"--index-url", "--no-build-isolation", "--logdir", "--nnodes", "--node_rank", "--nproc_per_node",
                     "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--standalone", "--max-restarts",
                     "--signal", "--requeue", "--export"}  # torchrun's, then sbatch's (docs/slurm.sbatch)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")


def project_flags() -> set[str]:
    """Every flag a program of this repository takes: the documented parsers' own option strings, and the
    literal flags of every add_argument call in the other programs and bench/ scripts."""
    known = {option for _, build in make_flags.CLIS for action in build()._actions for option in action.option_strings}
    for path in [*glob.glob(os.path.join(REPO, "*.py")), *glob.glob(os.path.join(REPO, "bench", "*.py"))]:
        for call in re.finditer(r"add_argument\(([^)]*)", read(path)):
            known.update(re.findall(r'"(--[a-z0-9-]+)"', call.group(1)))
    return known


def test_every_flag_the_readme_and_docs_name_exists():
    known = project_flags() | OTHER_TOOLS_FLAGS
    named = {(flag, os.path.relpath(page, REPO)) for page in PAGES if page.startswith(os.path.join(REPO, "docs"))
             or page == README for flag in FLAG.findall(read(page))}
    assert sorted((flag, page) for flag, page in named if flag not in known) == []


def test_the_readme_and_model_py_give_the_default_models_size():
    from model import ModelConfig
    from sizing import param_count

    n = param_count(ModelConfig())
    assert f"The default model has {n / 1e6:.1f}M parameters" in read(README)
    assert f"({n / 1e6:.2f}M parameters" in read(os.path.join(REPO, "model.py"))


def test_the_readme_and_data_md_give_the_gpt2_124m_presets_budget():
    """The preset's tokens (20 per parameter, sizing.py) and steps of its 262,144-token batch, as the pages quote
    them: a change to the model's parameters changes them."""
    import math

    import config

    cfg = config.parse_args(["--preset", "gpt2-124m"])
    tokens, per_step = cfg.schedule.max_tokens, cfg.data.total_batch_tokens
    said, steps = f"{tokens:,} tokens", math.ceil(tokens / per_step)
    assert f"{said},\n  {steps:,} steps" in read(README)
    assert f"budget is {said} (it reads {steps:,} steps of {per_step:,}: {steps * per_step:,})" in read(
        os.path.join(REPO, "docs", "data.md"))


def test_the_readme_gives_the_default_corpus_document_count_on_this_python():
    import platform

    from sources import stdlib_sources

    documents = sum(os.path.getsize(path) > 0 for path in stdlib_sources())  # prepare drops empty documents
    said = re.search(r"on Python ([\d.]+): ([\d,]+) files", read(README))
    if said.group(1) != platform.python_version():
        pytest.skip(f"the README counts Python {said.group(1)}'s standard library; this is {platform.python_version()}")
    assert int(said.group(2).replace(",", "")) == documents
