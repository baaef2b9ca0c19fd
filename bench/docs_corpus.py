"""The recipe bench's second corpus: the prose of the Python standard library, its docstrings and comments,
tokenized by prepare.py (GPT-2) into shards. Prints the shards' directory.

    python bench/docs_corpus.py [OUT]     # OUT default: <cache>/bench/stdlib-docs-<python version>

Every machine with Python has it, and it is unlike both other corpora: the prose corpus
(bench/prose_corpus.sh) is reStructuredText documentation of a kernel, and train.py's default corpus is the
same library's code, of which this keeps only the English. One document a module (the files of the default
corpus, sources.stdlib_sources), in the module's order: its docstrings (module, classes, functions) and its
comments, a comment's consecutive lines joined into one paragraph, paragraphs apart by a blank line. A file
that does not parse or tokenize is left out. OUT/corpus.json records how the corpus was made; bench/recipe.py
--corpus docs reads its id from it.
"""

import argparse
import ast
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from cli import ArgumentParser, UsageError, cache_root  # noqa: E402
from sources import stdlib_sources  # noqa: E402

VAL_TOKENS = 262144  # as the prose corpus's: the same val size for every corpus the recipe compares


def default_dir() -> str:
    return os.path.join(cache_root(), "bench", f"stdlib-docs-{platform.python_version()}")


def docstrings(tree: ast.AST) -> list[str]:
    """The docstrings of a module and of every class and function in it, in the order they appear."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [node for node in ast.walk(tree) if isinstance(node, kinds)]
    nodes.sort(key=lambda node: getattr(node, "lineno", 0))
    return [doc for node in nodes if (doc := ast.get_docstring(node))]


def comments(source: str) -> list[str]:
    """The comments, each run of comment lines on consecutive lines as one paragraph, without the '#'."""
    paragraphs, last_line = [], None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        text = token.string.lstrip("#").strip()
        if not text or text.startswith("!"):  # a blank comment line; a shebang
            last_line = None
            continue
        if last_line is not None and token.start[0] == last_line + 1:
            paragraphs[-1] += " " + text
        else:
            paragraphs.append(text)
        last_line = token.start[0]
    return paragraphs


def module_prose(path: str) -> str | None:
    """One module's docstrings and comments as one document, or None when it has none or does not parse."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        parts = docstrings(ast.parse(source)) + comments(source)
    except (SyntaxError, ValueError, UnicodeDecodeError, tokenize.TokenError):
        return None
    return "\n\n".join(parts) if parts else None


def write_text(out_text: str) -> int:
    """Each module's prose as OUT.text/NNNNN.txt, numbered in sources.stdlib_sources's order -> files written."""
    os.makedirs(out_text)
    written = 0
    for path in stdlib_sources():
        prose = module_prose(path)
        if prose:
            with open(os.path.join(out_text, f"{written:05d}.txt"), "w", encoding="utf-8") as f:
                f.write(prose + "\n")
            written += 1
    return written


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default=default_dir(), help="the shards' directory (OUT.text: the text, for "
                                                                 "the time it takes)")
    try:
        out = os.path.abspath(p.parse_args(argv).out)  # prepare.py runs from the repository
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.path.exists(os.path.join(out, "corpus.json")):
        print(out)
        return 0
    text = out + ".text"
    if os.path.exists(text):  # never removed unasked: it may be the user's, or a failed run's to look at
        print(f"error: {text} is in the way (where the text goes): remove it, or give another OUT", file=sys.stderr)
        return 2
    files = write_text(text)
    command = [sys.executable, "prepare.py", "--input", text, "--out", out, "--tokenizer", "gpt2",
               "--text-documents", "file", "--val-tokens", str(VAL_TOKENS)]
    if code := subprocess.run(command, cwd=REPO, stdout=sys.stderr).returncode:
        print(f"error: prepare.py exited with {code} (its message is above); {text} is left to look at",
              file=sys.stderr)
        return code
    record = {"corpus": f"Python {platform.python_version()}'s standard library: the docstrings and comments of "
                        f"{files} modules, one document each",
              "made_by": "python bench/docs_corpus.py: python prepare.py --input OUT.text --tokenizer gpt2 "
                         f"--text-documents file --val-tokens {VAL_TOKENS}",
              "id": f"stdlib-docs-{platform.python_version()}-gpt2-{VAL_TOKENS}"}
    with open(os.path.join(out, "corpus.json.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(out, "corpus.json.tmp"), os.path.join(out, "corpus.json"))
    shutil.rmtree(text)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
