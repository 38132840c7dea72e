"""zerotune's modules import each other without a cycle, on few floors, and at the top of the file.

Two modules that import each other are one job split in two (check and evaluate once shared the answering of
prompts that way); a function-level import only hides such a cycle from Python, not from a reader. So every
`import` / `from` statement counts, wherever it sits in the file, and importing `a.b.c` imports the packages `a`
and `a.b` too: each package's `__init__` is a floor of its own (the real graph Python runs)."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "zerotune"
MAX_DEPTH = 11  # imports in the longest chain (issue 43: was 15; issue 51: 12 on the real graph, now 11)
# Third-party modules that cost CLI start-up (numpy + tqdm ~0.3 s, torch + transformers seconds): a function-level
# import of a zerotune module is kept only where it keeps one of these off a module that does not load them itself.
HEAVY = {"torch", "transformers", "deepspeed", "datasets", "peft", "accelerate", "liger_kernel", "bitsandbytes",
         "llama_cpp", "matplotlib", "numpy", "tqdm", "pandas", "pyarrow", "gguf", "openai", "huggingface_hub",
         "safetensors", "uvicorn", "fastapi", "pydantic", "lm_eval", "wandb"}


@functools.cache
def module_files() -> dict[str, Path]:
    """{dotted module name: file}; a package is its __init__.py."""
    out = {}
    for f in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(name: str, path: Path, node: ast.AST, known: set[str]) -> set[str]:
    """The zerotune modules one import statement runs. `from pkg import x` means pkg.x when that is a module (so
    `from . import manifest` is an edge to zerotune.manifest), else pkg itself; importing a.b.c runs the packages a
    and a.b first, except those the importer is itself inside of (they are running already)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    if isinstance(node, ast.Import):
        edges.update(a.name for a in node.names)
    else:
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for a in node.names:
            sub = f"{target}.{a.name}"
            edges.add(sub if sub in known else target)
    mine = set(_ancestors(name)) | {name}
    edges |= {p for e in edges for p in _ancestors(e)}
    return {e for e in edges if e in known and e not in mine}


def _function_level(tree: ast.AST) -> set[int]:
    return {id(x) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for x in ast.walk(fn) if isinstance(x, (ast.Import, ast.ImportFrom))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The zerotune modules that `name` imports, wherever the statement sits."""
    return {t for node in ast.walk(_parse(path))
            if isinstance(node, (ast.Import, ast.ImportFrom)) for t in _targets(name, path, node, known)}


@functools.cache
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
    # zerotune.sub.c runs zerotune.sub (its package) first
    assert imported_modules("zerotune.a", pkg / "a.py", known) == {"zerotune.b", "zerotune.sub", "zerotune.sub.c"}
    assert imported_modules("zerotune.b", pkg / "b.py", known) == {"zerotune.sub", "zerotune.sub.c", "zerotune.a"}
    assert imported_modules("zerotune.sub", pkg / "sub" / "__init__.py", known) == {"zerotune.b"}
    # `from . import d` with no module d: the package itself (zerotune.sub), which c is inside of: no edge
    assert imported_modules("zerotune.sub.c", pkg / "sub" / "c.py", known) == {"zerotune.a"}
    graph = {"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}
    assert find_cycle(graph) == ["x", "y", "z", "x"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


def test_zerotune_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    assert "zerotune.check" in graph and "zerotune.manifest" in graph["zerotune.check"]
    cycles = all_cycles(graph)
    assert not cycles, "import cycles among zerotune modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def longest_chain(graph: dict[str, set[str]]) -> tuple[str, ...]:
    @functools.cache
    def longest(n: str) -> tuple[str, ...]:
        return max(((n, *longest(m)) for m in graph[n]), key=len, default=(n,))

    return max((longest(n) for n in graph), key=len)


def test_the_house_stays_eleven_floors_and_no_file_over_600_lines():
    """Issue 51: the longest chain of in-package imports on the real graph (function-level ones and the packages
    each import runs included) is at most 11 imports deep, and no module in src is over 600 lines."""
    chain = longest_chain(import_graph())
    assert len(chain) - 1 <= MAX_DEPTH, " -> ".join(chain)
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_the_depth_counts_a_package_as_a_floor_of_its_own(tmp_path):
    """A package whose __init__ imports its modules stands above them: an importer of the package stands above
    both. The old count (one floor fewer through a re-exporting __init__) fails this."""
    pkg = tmp_path / PACKAGE
    (pkg / "p").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "p" / "__init__.py").write_text("from .m import f\n")
    (pkg / "p" / "m.py").write_text("from .. import leaf\n")
    (pkg / "leaf.py").write_text("")
    (pkg / "top.py").write_text("from .p.m import f\n")
    known = {"zerotune", "zerotune.p", "zerotune.p.m", "zerotune.leaf", "zerotune.top"}
    files = {"zerotune": pkg / "__init__.py", "zerotune.p": pkg / "p" / "__init__.py",
             "zerotune.p.m": pkg / "p" / "m.py", "zerotune.leaf": pkg / "leaf.py", "zerotune.top": pkg / "top.py"}
    graph = {n: imported_modules(n, f, known) for n, f in files.items()}
    assert longest_chain(graph) == ("zerotune.top", "zerotune.p", "zerotune.p.m", "zerotune.leaf")


def test_no_package_hands_on_names():
    """A package's face hides no module: no __init__.py imports anything (train/__init__ re-exported the functions
    launch, worker, finalize under their own modules' names, so `from .train import launch` was not the module)."""
    for init in (SRC / PACKAGE).rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], init


def test_no_import_points_up_between_rooms():
    """With each folder of src/zerotune seen as one room (data/, planner/, train/, preference/) and each other
    module as its own, the rooms import each other without a cycle: nothing below a folder reaches into it while the
    folder reaches down to it (config -> data.formats, universal -> train.args, preference.reference ->
    train.callbacks were such arrows)."""
    def room(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 or (SRC / Path(*parts)).is_dir() else m

    rooms: dict[str, set[str]] = {}
    for m, deps in import_graph().items():
        rooms.setdefault(room(m), set()).update(room(d) for d in deps if room(d) != room(m))
    assert not all_cycles(rooms), all_cycles(rooms)


@functools.cache
def _heavy_at_import() -> dict[str, set[str]]:
    """{module: the HEAVY third-party modules importing it runs}: its own top-level imports and those of every
    zerotune module it imports at top level, transitively."""
    files = module_files()
    known = set(files)
    own, top = {}, {}
    for name, path in files.items():
        tree = _parse(path)
        inner = _function_level(tree)
        stmts = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inner]
        own[name] = {a.name.split(".")[0] for n in stmts if isinstance(n, ast.Import) for a in n.names} | {
            (n.module or "").split(".")[0] for n in stmts if isinstance(n, ast.ImportFrom) and not n.level}
        own[name] &= HEAVY
        top[name] = {t for n in stmts for t in _targets(name, path, n, known)}

    @functools.cache
    def heavy(m: str) -> frozenset:
        return frozenset(own[m].union(*(heavy(t) for t in top[m])))

    return {m: set(heavy(m)) for m in files}


@functools.cache
def function_level_imports() -> list[tuple[str, int, set[str]]]:
    """(module, line, the zerotune modules it imports) of every in-package import inside a function."""
    files = module_files()
    out = []
    for name, path in files.items():
        tree = _parse(path)
        inner = _function_level(tree)
        for n in ast.walk(tree):
            if id(n) in inner and (t := _targets(name, path, n, set(files))):
                out.append((name, n.lineno, t))
    return out


def test_imports_sit_at_the_top_unless_they_keep_a_heavy_module_off_a_light_one():
    """Issue 51: 123 of 306 in-package imports sat inside functions (94 file-to-file edges hidden that way), each an
    arrow no reader or tool sees. The rule now: an in-package import sits at the top of the file, unless the module it
    imports loads a HEAVY third-party module at import (torch, transformers, numpy...) and the importer does not (the
    CLI's start-up path: `zerotune plan` must not load torch). Measured after the move: 8 left, each by the rule; 9 since
    the launcher's check of GRPO's prompts (train/launch.py: rl.prompts reads numpy through data.tokenize)."""
    heavy = _heavy_at_import()
    wrong = [(m, line, sorted(t)) for m, line, t in function_level_imports()
             if not any(heavy[x] - heavy[m] for x in t)]
    assert not wrong, "move to the top of the file (nothing heavy kept off a light module): " + repr(wrong)
    assert len(function_level_imports()) <= 9


def test_the_cli_starts_without_heavy_modules():
    """What the rule above protects: importing the CLI loads none of HEAVY (each stage loads what it needs)."""
    code = (f"import sys, zerotune.cli; print(sorted(set({sorted(HEAVY)!r}) & "
            "{m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


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
    # the tables the schema validates against, and how its fields are declared and read
    "format_table": set(), "recipe_fields": {"errors"},
    "config": {"format_table", "hardware", "quant_types", "recipe_fields", "scorers"},
    "data.formats": {"errors", "format_table"},
    "layout": {"config", "manifest"},  # manifest: the one atomic write (write_resolved_recipe)
    "manifest": set(),
}


def test_base_modules_import_only_what_they_are_allowed():
    graph = import_graph()
    got = {m: {d.removeprefix(f"{PACKAGE}.") for d in graph[f"{PACKAGE}.{m}"]} for m in BASE_IMPORTS}
    assert got == BASE_IMPORTS


def test_stopping_stays_light_and_what_train_uses_does_not_reach_up_into_it():
    """stopping.py is the one home of a stop on a signal or the deadline, read by the launcher before torch loads: it
    imports nothing from zerotune and no torch or transformers at module level. reshard.py (the launcher's
    conversion) and preference/reference.py (run by the workers) import nothing under train/, which stands above them."""
    graph = import_graph()
    assert graph["zerotune.stopping"] == set()
    tree = ast.parse((SRC / PACKAGE / "stopping.py").read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert not top & {"torch", "transformers", "deepspeed"}, top
    for m in ("zerotune.reshard", "zerotune.preference.reference"):
        assert not {d for d in graph[m] if d == "zerotune.train" or d.startswith("zerotune.train.")}, m
