"""zerotune's modules import each other without a cycle.

Two modules that import each other are one job split in two (check and evaluate once shared the answering of
prompts that way); a function-level import only hides such a cycle from Python, not from a reader. So every
`import` / `from` statement counts, wherever it sits in the file."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "zerotune"


def module_files() -> dict[str, Path]:
    """{dotted module name: file}; a package is its __init__.py."""
    out = {}
    for f in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The zerotune modules that `name` imports. `from pkg import x` means pkg.x when that is a module (so
    `from . import manifest` is an edge to zerotune.manifest), else pkg itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                edges.add(sub if sub in known else target)
    return {e for e in edges if e in known and e != name}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, f, set(files)) for name, f in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Find a cycle, drop its closing edge, look again: a failure lists each cycle it can break, not just
    the first one."""
    graph = {k: set(v) for k, v in graph.items()}
    found = []
    while c := find_cycle(graph):
        found.append(c)
        graph[c[-2]].discard(c[-1])
    return found


def test_graph_sees_relative_absolute_and_function_level_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nfrom .sub import c\n")
    (pkg / "b.py").write_text("def f():\n    import zerotune.sub.c\n    from zerotune import a\n")
    (pkg / "sub" / "__init__.py").write_text("from ..b import f\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom . import d\nimport os\n")
    known = {"zerotune", "zerotune.a", "zerotune.b", "zerotune.sub", "zerotune.sub.c"}
    assert imported_modules("zerotune.a", pkg / "a.py", known) == {"zerotune.b", "zerotune.sub.c"}
    assert imported_modules("zerotune.b", pkg / "b.py", known) == {"zerotune.sub.c", "zerotune.a"}
    assert imported_modules("zerotune.sub", pkg / "sub" / "__init__.py", known) == {"zerotune.b"}
    # `from . import d` with no module d: the package itself (zerotune.sub)
    assert imported_modules("zerotune.sub.c", pkg / "sub" / "c.py", known) == {"zerotune.a", "zerotune.sub"}
    graph = {"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}
    assert find_cycle(graph) == ["x", "y", "z", "x"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


def test_zerotune_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    assert "zerotune.check" in graph and "zerotune.manifest" in graph["zerotune.check"]
    cycles = all_cycles(graph)
    assert not cycles, "import cycles among zerotune modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_house_stays_eleven_floors_and_no_file_over_600_lines():
    """Issue 43: the longest chain of in-package imports, function-level ones included, is at most 11 imports deep
    (it was 15), and no module in src is over 600 lines (plan.py was 852)."""
    import functools

    graph = import_graph()

    @functools.cache
    def longest(n: str) -> tuple[str, ...]:
        return max(((n, *longest(m)) for m in graph[n]), key=len, default=(n,))

    chain = max((longest(n) for n in graph), key=len)
    assert len(chain) - 1 <= 11, " -> ".join(chain)
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_gguf_checks_reads_the_chat_template_facts_without_the_data_package():
    """Checking a GGUF needs what the chat template says (end tokens, tool rendering), not the training data
    pipeline: those facts live in chat_template.py, a leaf, and gguf_checks reaches nothing under data/."""
    graph = import_graph()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for m in graph[todo.pop()] - seen:
                seen.add(m)
                todo.append(m)
        return seen

    assert graph["zerotune.chat_template"] == set()
    assert "zerotune.chat_template" in graph["zerotune.gguf_checks"]
    assert not {m for m in reaches("zerotune.gguf_checks") if m == "zerotune.data" or m.startswith("zerotune.data.")}


# What each base module may import from zerotune: the floors everything else stands on. A base module that
# reaches up (manifest importing the layout for one function) lifts every module above it one floor.
BASE_IMPORTS = {
    "errors": set(), "quant_types": set(), "ports": set(), "scorers": set(), "chat_template": set(),
    "hardware": {"errors"}, "families": {"errors"},  # a family is handed to hardware.choose, not imported there
    # the tables the schema validates against
    "config": {"errors", "hardware", "quant_types", "scorers", "data.formats"}, "data.formats": {"errors"},
    "layout": {"config"},
    "manifest": set(),
}


def test_base_modules_import_only_what_they_are_allowed():
    graph = import_graph()
    got = {m: {d.removeprefix(f"{PACKAGE}.") for d in graph[f"{PACKAGE}.{m}"]} for m in BASE_IMPORTS}
    assert got == BASE_IMPORTS
