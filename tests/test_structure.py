"""The project's shape, held by its own test: every product file (the .py files at the root) within its size,
every function within its length (the bench's and docs' scripts' too), train.py within its own limit, no import
circle among the product files, model.py free of the project's other files but option.py (a leaf), and one way
to declare a config field."""

import ast
import os
import sys

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "docs"))
from make_map import import_graph, product_files  # noqa: E402  (the README's map reads the same graph)


MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 60
MAX_TRAIN_LINES = 250  # train.py only wires the pieces; a feature that needs more moves something out


def line_count(module: str) -> int:
    with open(os.path.join(REPO, f"{module}.py"), encoding="utf-8") as f:
        return sum(1 for _ in f)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle among graph's modules as the path that closes it, or None."""
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for dep in sorted(graph[module]):
            if circle := visit(dep):
                return circle
        path.pop()
        done.add(module)
        return None

    return next((c for m in sorted(graph) if (c := visit(m))), None)


def test_no_product_file_is_over_its_size():
    over = {m: n for m in product_files() if (n := line_count(m)) > MAX_FILE_LINES}
    assert not over, f"over {MAX_FILE_LINES} lines: {over}; move a concern out rather than raise the limit"


def test_train_py_stays_a_table_of_contents():
    assert line_count("train") <= MAX_TRAIN_LINES


def script_trees() -> dict[str, ast.Module]:
    """The benchmarks' and the docs' generators: held to the product's function length too."""
    trees = {}
    for folder in ("bench", "docs"):
        for name in sorted(os.listdir(os.path.join(REPO, folder))):
            if name.endswith(".py"):
                with open(os.path.join(REPO, folder, name), encoding="utf-8") as f:
                    trees[f"{folder}/{name[:-3]}"] = ast.parse(f.read())
    return trees


def test_no_function_is_over_its_length():
    long = [f"{m}.py:{node.name} {node.end_lineno - node.lineno + 1}"
            for m, tree in {**product_files(), **script_trees()}.items()
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_import_circle_and_model_py_imports_only_the_field_declaration_and_the_loss():
    graph = import_graph(product_files())
    assert find_circle(graph) is None, f"import circle: {' -> '.join(find_circle(graph))}"
    assert graph["model"] <= {"option", "loss"}, f"model.py imports {graph['model']}"
    assert graph["option"] == graph["loss"] == set()
    assert "transformer_engine" not in open(os.path.join(REPO, "model.py")).read()


def test_the_circle_finder_finds_a_circle():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def in_option(tree: ast.Module, node: ast.AST) -> bool:
    return any(isinstance(f, ast.FunctionDef) and f.name == "option" and f.lineno <= node.lineno <= f.end_lineno
               for f in tree.body)


def test_every_config_field_is_declared_with_option():
    """A field with help text comes from option.option, never a hand-written field(metadata=...)."""
    handwritten = [f"{m}.py:{node.lineno}" for m, tree in product_files().items() for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "field"
                   and any(k.arg == "metadata" for k in node.keywords) and not in_option(tree, node)]
    assert not handwritten, f"field(metadata=...) instead of option(): {handwritten}"
