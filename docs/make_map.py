"""Write the README's map of the product files ("Where things live") from the files themselves.

    python docs/make_map.py           # (re)write the map's rows in README.md
    python docs/make_map.py --check   # exit 1 when the map differs from what the files say

Each product file (a .py file at the root) is one row: its name and the first paragraph of its docstring,
which therefore says in a line or two what the file owns. The rows run from the top of the import graph
down (train.py first, the files that import nothing of the project last), so that the table reads in the
order the README promises: a file can be read knowing only the files below it. The rows after the .py
files (configs/, bench/, tests/, docs/) are kept as they are. tests/test_docs.py fails while the map is stale;
tests/test_structure.py reads the import graph from here.
"""

import argparse
import ast
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_flags import write_or_check  # noqa: E402

DOCS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(DOCS)
README = os.path.join(REPO, "README.md")
HEADING = "## Where things live"
TABLE_HEAD = ("| file | owns |", "|---|---|")


def product_files(repo: str = REPO) -> dict[str, ast.Module]:
    """module name -> its parsed source, for every .py file at the repository's root."""
    files = sorted(glob.glob(os.path.join(repo, "*.py")))
    return {os.path.basename(f)[:-3]: ast.parse(open(f, encoding="utf-8").read(), f) for f in files}


def project_imports(tree: ast.Module, modules) -> set[str]:
    """The modules of `modules` that tree imports, at any depth of its code (a function's lazy import too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(modules)


def import_graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    return {m: project_imports(tree, trees) - {m} for m, tree in trees.items()}


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 0 for one that imports nothing of the project, else one above its highest import.
    The graph must have no circle (tests/test_structure.py holds that)."""
    floor = {}

    def visit(module):
        if module not in floor:
            floor[module] = 1 + max(map(visit, graph[module]), default=-1)
        return floor[module]

    for module in graph:
        visit(module)
    return floor


def summary(tree: ast.Module, name: str) -> str:
    """The first paragraph of a module's docstring, on one line, as a table cell."""
    doc = ast.get_docstring(tree)
    if not doc:
        raise ValueError(f"{name}.py has no docstring: its first paragraph is its row in the README's map")
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def rows(trees: dict[str, ast.Module]) -> list[str]:
    floor = floors(import_graph(trees))
    order = sorted(trees, key=lambda m: (-floor[m], m))
    return [f"| `{m}.py` | {summary(trees[m], m)} |" for m in order]


def render(readme: str, trees: dict[str, ast.Module]) -> str:
    """readme with the map's .py rows replaced by what the files say; the other rows stay."""
    lines = readme.split("\n")
    try:
        head = lines.index(TABLE_HEAD[0], lines.index(HEADING))
    except ValueError:
        raise ValueError(f"README.md has no '{HEADING}' section with a '{TABLE_HEAD[0]}' table") from None
    start = end = head + len(TABLE_HEAD)
    while end < len(lines) and lines[end].startswith("| `") and lines[end].split("`")[1].endswith(".py"):
        end += 1
    return "\n".join(lines[:start] + rows(trees) + lines[end:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's map is stale; write nothing")
    text = render(open(README, encoding="utf-8").read(), product_files())
    return write_or_check(README, text, parser.parse_args(argv).check, "python docs/make_map.py")


if __name__ == "__main__":
    sys.exit(main())
