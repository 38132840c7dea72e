"""Every command and path the README and docs/ show is checked against the repository: make targets exist,
recipes named exist, `zerotune` command lines parse and their overrides load, linked files and named repository
paths exist. A doc that drifts from the code fails here, not in a newcomer's terminal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO
from zerotune.cli import _parser
from zerotune.config import RECIPES_DIR, load_recipe

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RECIPES = {p.stem for p in RECIPES_DIR.glob("*.yaml")}
PLACEHOLDER = re.compile(r"[<>]|\.\.\.|^(NAME|RECIPE|R|X|N|KEY|VALUE|\$\w+)$")


def _make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.M))


def _command_lines(text: str) -> list[str]:
    """Shell lines in fenced code blocks (comments and continuations joined) and inline `code` spans."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip().lstrip("$ ").strip()
            if line:
                lines.append(line)
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return lines


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def _overrides(words: list[str]) -> list[str]:
    return [w for w in words if re.match(r"^[a-z_]+\.[a-z_.]+=", w) and not PLACEHOLDER.search(w.split("=", 1)[1])]


def _check_make(words: list[str], where: str) -> list[str]:
    problems, targets = [], _make_targets()
    args = [w for w in words[1:] if not w.startswith("-")]
    goals = [w for w in args if "=" not in w]
    for g in goals:
        if g not in targets and not PLACEHOLDER.search(g):
            problems.append(f"{where}: `make {g}`: no such target in the Makefile")
    recipe = next((w.split("=", 1)[1] for w in args if w.startswith("RECIPE=")), "tiny")
    if PLACEHOLDER.search(recipe):
        return problems
    if recipe not in RECIPES:
        return problems + [f"{where}: RECIPE={recipe}: no recipes/{recipe}.yaml"]
    extra = [w for w in args if w.startswith("ARGS=")]
    ovs = _overrides(args) + [o for a in extra for o in _overrides(a.split("=", 1)[1].split())]
    try:
        load_recipe(recipe, ovs)
    except Exception as e:  # noqa: BLE001 - the message is the finding
        problems.append(f"{where}: `{' '.join(words)}`: {e}")
    return problems


def _check_zerotune(words: list[str], where: str) -> list[str]:
    i = words.index("zerotune")
    args = words[i + 1:]
    if not args or args[0].startswith("-") or PLACEHOLDER.search(args[0]):
        return []
    try:
        parsed = _parser().parse_args(args)
    except SystemExit:
        return [f"{where}: `zerotune {' '.join(args)}` does not parse"]
    if parsed.stage == "explain" or PLACEHOLDER.search(parsed.recipe):
        return []
    if parsed.recipe not in RECIPES and not Path(parsed.recipe).suffix:
        return [f"{where}: recipe {parsed.recipe}: no recipes/{parsed.recipe}.yaml"]
    try:
        load_recipe(parsed.recipe, _overrides(parsed.overrides))
    except Exception as e:  # noqa: BLE001
        return [f"{where}: `zerotune {' '.join(args)}`: {e}"]
    return []


def _check_sbatch(words: list[str], where: str) -> list[str]:
    script = next((w for w in words if w.endswith(".sbatch")), None)
    if script is None:
        return []
    problems = [] if (REPO / script).exists() else [f"{where}: {script} does not exist"]
    rest = words[words.index(script) + 1:]
    if rest and not PLACEHOLDER.search(rest[0]) and rest[0] not in RECIPES and not rest[0].startswith("-"):
        problems.append(f"{where}: {script} {rest[0]}: no recipes/{rest[0]}.yaml")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_shown_parses_against_the_repository(doc):
    problems = []
    for line in _command_lines(doc.read_text()):
        for part in re.split(r"\s*(?:&&|;|\|\|)\s*", line):
            words = _words(part)
            if not words:
                continue
            where = f"{doc.relative_to(REPO)}: `{part}`"
            if words[0] == "make":
                problems += _check_make(words, where)
            elif "zerotune" in words and any(w in ("-m", "python", ".venv/bin/python") for w in words[:3]):
                problems += _check_zerotune(words, where)
            elif words[0] == "sbatch":
                problems += _check_sbatch(words, where)
    assert not problems, "\n".join(problems)


REPO_PATH = re.compile(r"^(?:src|tests|slurm|recipes|configs|scripts|docs|bench|data|assets)/[\w./-]*[\w/]$")


def _ignored(path: str) -> bool:
    import subprocess

    return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_linked_file_and_named_path_exists(doc):
    text = doc.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target and not (doc.parent / target).exists():
            missing.append(f"link {target}")
    for span in re.findall(r"`([^`\n]+)`", text):
        for word in span.split():
            word = word.rstrip(",.:;)").split("::")[0]
            if REPO_PATH.match(word) and not any(c in word for c in "<>*{}") and not (REPO / word).exists() \
                    and not _ignored(word):  # made by a command (bench/work/, runs/): not in a clone
                missing.append(f"path {word}")
    assert not missing, f"{doc.relative_to(REPO)}: " + ", ".join(sorted(set(missing)))


def test_docs_data_shows_a_row_of_every_format_that_reads_as_that_format():
    """docs/data.md's Formats table against format_table.py's FORMATS: a row of every format and of no other, and
    each example reads as its format with no key ignored (a renamed field or a new format shows up here)."""
    import json

    from zerotune.data.formats import read_row
    from zerotune.format_table import FORMATS

    section = (REPO / "docs" / "data.md").read_text().split("\n## Formats", 1)[1].split("\n## ", 1)[0]
    shown = re.findall(r"^\| `(\w+)`[^|]*\| `([^`]+)`", section, re.M)
    assert {name for name, _ in shown} == set(FORMATS), f"docs/data.md shows {sorted({n for n, _ in shown})}"
    for name, row in shown:
        notes = read_row(json.loads(row), name, {}, f"docs/data.md ({name})").notes or {}
        assert not [k for k in notes if k.startswith(("row:", "message:"))], (name, notes)


def test_every_description_of_the_demo_names_its_stages_in_the_makefiles_order():
    """The demo's stage order is the Makefile's `demo` target (what runs); README, docs/, recipes, the Makefile's
    own help and the package docstring say it one way (issue 43: it was written three ways)."""
    make = (REPO / "Makefile").read_text()
    recipe = make.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    order = re.findall(r"^\t\$\(ZT\) (\w+)", recipe, re.M)
    assert order == ["data", "finetune", "quantize", "eval", "check"]
    sources = [*DOCS, *sorted(RECIPES_DIR.glob("*.yaml")), REPO / "Makefile", REPO / "src" / "zerotune" / "__init__.py"]
    seen = 0
    for path in sources:
        for chain in re.findall(r"\b(\w+(?: (?:->|→) \w+){3,})", path.read_text()):
            stages = re.split(r" (?:->|→) ", chain)
            if "quantize" not in stages or not set(stages) <= {*order, "prepare", "train", "serve"}:
                continue  # another chain (a requeue rehearsal's), not the stages of the pipeline
            seen += 1
            shown = [s for s in stages if s != "serve"]  # the package docstring goes on to serving
            assert shown == order, f"{path.relative_to(REPO)}: '{chain}' is not the demo's order {order}"
    assert seen >= 6


def test_the_module_table_names_every_module():
    """docs/layout.md's module table names every module of src/zerotune (a package row may list its files)."""
    text = (REPO / "docs" / "layout.md").read_text()
    table = text[text.index("| module | what |"):]
    pkg = REPO / "src" / "zerotune"
    missing = [str(f.relative_to(pkg)) for f in sorted(pkg.rglob("*.py"))
               if f.name not in ("__init__.py",) and f"`{f.name}`" not in table and f"`{f.relative_to(pkg)}`" not in table]
    assert not missing, f"docs/layout.md's module table does not name {missing}"


def _extended_tests() -> set[tuple[str, str]]:
    """(file, test function) of every test marked `extended`, read from the test files themselves."""
    import ast

    out = set()
    for f in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and any(
                    ast.unparse(d).endswith("mark.extended") for d in node.decorator_list):
                out.add((f"tests/{f.name}", node.name))
    return out


def test_the_extended_table_lists_exactly_the_tests_marked_extended():
    """The marker is the one source of which tests CI leaves out; docs/testing.md's table must name each of them
    (with the path CI covers instead) and nothing else (issue 43: the lists in pyproject, the Makefile help and the
    docs had drifted apart)."""
    text = (REPO / "docs" / "testing.md").read_text()
    table = text[text.index("| extended test |"):text.index("\n\n", text.index("| extended test |"))]
    named = set()
    for row in table.splitlines()[2:]:
        first = row.split(" | ")[0]
        current = None
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)", first):
            current = path or current
            named.add((current, name))
    assert named == _extended_tests()
    for place in (REPO / "pyproject.toml", REPO / "Makefile"):  # they point at the table, they do not repeat it
        assert "docs/testing.md" in place.read_text()


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).strip().replace(" ", "-")


def test_the_code_points_at_docs_that_exist():
    """What the code cites from docs/ (a page, a #section, or a page and a quoted "Heading") is there: a pointer
    to a README section that had moved survived in quant_types.py (issue 43)."""
    bad = []
    for f in [*(REPO / "src").rglob("*.py"), *(REPO / "scripts").glob("*.py"), *(REPO / "slurm").glob("*")]:
        text = f.read_text() if f.is_file() else ""
        for page, anchor, quoted in re.findall(r'(docs/[a-z_]+\.md|README\.md)(?:#([a-z0-9-]+))?(?:, "([^"]+)")?', text):
            doc = REPO / page
            if not doc.exists():
                bad.append(f"{f.name}: {page}")
                continue
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", doc.read_text(), re.M)}
            if anchor and anchor not in slugs:
                bad.append(f"{f.name}: {page}#{anchor}")
            if quoted and _slug(quoted) not in slugs:
                bad.append(f'{f.name}: {page}, "{quoted}"')
    assert not bad, bad


def test_gguf_checks_reads_keys_by_name():
    """gguf_checks.py's own rule (its docstring): GGUF keys and tensor names come from gguf-py, never as strings."""
    import sys

    sys.path.insert(0, str(REPO / "assets" / "llama.cpp" / "gguf-py"))
    import gguf

    keys = {v for group in vars(gguf.Keys).values() if isinstance(group, type)
            for v in vars(group).values() if isinstance(v, str) and "." in v}
    names = {f"{n}.weight" for n in gguf.TENSOR_NAMES.values()}
    literals = set(re.findall(r'"([a-z_0-9.]+)"', (REPO / "src" / "zerotune" / "gguf_checks.py").read_text()))
    assert not literals & (keys | names), sorted(literals & (keys | names))


def _run_tree() -> dict[str, str]:
    """layout.py's docstring tree: each top-level entry of a run folder (`data/`, `model.tmp/`, ...) -> its text."""
    import zerotune.layout

    tree, current = {}, None
    for line in zerotune.layout.__doc__.splitlines():
        entry = re.match(r"^ {6}([\w.]+/)\s", line)
        if entry:
            current = entry.group(1)
            tree[current] = line[entry.end():]
        elif current and re.match(r"^ {7,}\S", line):
            tree[current] += " " + line.strip()
        else:
            current = None
    return tree


def test_the_run_tree_is_layouts_docstring_whole_and_nowhere_else():
    """The tree of a run folder is stated once, in layout.py's docstring (the one module that builds every path):
    it names every path RunLayout returns, and no doc restates it (issue 51: three copies, the README's missing
    base/, reference/ and model.tmp/)."""
    from zerotune.layout import RunLayout, layout

    r = load_recipe("tiny_dpo")  # a random init (base/ in the run folder) and DPO (reference/)
    paths = layout(r)
    built = {name: getattr(paths, name) for name, v in vars(RunLayout).items() if isinstance(v, property)}
    built |= {"base": paths.base, "gguf": paths.gguf, "replay_answers": paths.replay_answers("<key>")}
    assert len(built) > 30 and paths.base.is_relative_to(r.out)
    tree, missing = _run_tree(), []
    for name, path in sorted(built.items()):
        rel = path.relative_to(r.out).as_posix().replace(f"{r.name}-{r.quantize.type.lower()}", "<recipe>-<type>")
        top, *rest = rel.split("/")
        entry = tree.get(f"{top}/")
        if entry is None or any(not re.search(rf"(?<![\w.<>-]){re.escape(part)}(?![\w-])", entry) for part in rest):
            missing.append(f"{name} ({rel})")
    assert not missing, f"src/zerotune/layout.py's tree does not name {missing}"

    copies = []
    for doc in [*DOCS, REPO / "bench" / "README.md"]:
        text = doc.read_text()
        blocks = re.findall(r"```.*?```", text, re.S) + re.split(r"\n\s*\n", re.sub(r"```.*?```", "", text, flags=re.S))
        copies += [f"{doc.relative_to(REPO)}: {b.strip()[:60]!r}" for b in blocks
                   if "checkpoints/" in b and "metrics.jsonl" in b]
    assert not copies, f"the run tree is layout.py's docstring; link to it instead of copying it: {copies}"
