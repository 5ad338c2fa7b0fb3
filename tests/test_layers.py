"""The packages form layers: each module imports only from its own package or lower ones,
and nothing in the library imports the command line (``cli/``, installed as ho_onnx.cli)."""

from __future__ import annotations

import ast
from pathlib import Path

import ho_onnx

ROOT = Path(ho_onnx.__file__).resolve().parent
# Lowest first; a module may import from its own layer and the ones before it.
LAYERS = [
    {"ho_onnx.errors", "ho_onnx.contract", "ho_onnx.units", "ho_onnx.kinds", "ho_onnx._ops"},
    {"ho_onnx.graph"},
    {"ho_onnx.target"},
    {"ho_onnx.cost"},
    {"ho_onnx.schedule"},
    {"ho_onnx.rewrite"},
    {"ho_onnx.report"},
]


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in layer):
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def _imports(path: Path, module: str) -> set[str]:
    """Absolute names of the ho_onnx modules ``path`` (module ``module``) imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("ho_onnx"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if name.startswith("ho_onnx"):
                out.update(f"{name}.{a.name}" if name == "ho_onnx" else name
                           for a in node.names)
    return out


def _library_modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = ["ho_onnx", *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def test_every_import_goes_down_the_layers():
    bad = []
    for module, path in _library_modules().items():
        if module in ("ho_onnx", "ho_onnx.__main__", "ho_onnx.cli"):
            continue  # the entry points and the lazy top-level namespace
        for target in _imports(path, module):
            if target == "ho_onnx.__version__":
                continue
            if _layer(target) > _layer(module):
                bad.append(f"{module} imports {target}")
    assert not bad, bad


def test_the_library_never_imports_the_cli():
    users = [m for m, p in _library_modules().items() if m != "ho_onnx.__main__"
             and any(t.startswith("ho_onnx.cli") for t in _imports(p, m))]
    assert not users, users


# Circles known and left (a lazy import inside a function breaks each at import time):
# OffloadChoice.host_bytes reads lifetimes, which reads the choice's types.
KNOWN_CIRCLES = {"ho_onnx.schedule.lifetimes", "ho_onnx.schedule.types"}


def test_no_new_import_circles():
    """No module reaches itself through imports, lazy ones included (issue 35: graph.dims
    imported eval_dim from graph.analyse inside a function, and analyse imports dims)."""
    mods = _library_modules()

    def module_of(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    deps = {m: {module_of(t) for t in _imports(p, m)} - {m, ""} for m, p in mods.items()}

    def reach(m: str) -> set[str]:
        seen, todo = set(), [m]
        while todo:
            for d in deps.get(todo.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    circled = {m for m in deps if m in reach(m)}
    assert circled <= KNOWN_CIRCLES, f"import circles through {sorted(circled - KNOWN_CIRCLES)}"


def _design_map_paths() -> set[str]:
    """The files docs/design.md's map of the packages names, as paths from the repository
    root: a line starting in the first column opens a folder (``ho_onnx/graph/``, or the
    folder of the file it starts with); each ``x.py`` on it and on the indented lines that
    follow is in that folder; a name with a slash is a path from ``ho_onnx/`` (or from the
    root, when it starts with ``ho_onnx/`` or ``cli/``)."""
    import re

    text = (ROOT.parent / "docs" / "design.md").read_text()
    start = text.index("```\n", text.index("## Layout")) + 4
    folder, paths = "", set()
    for line in text[start:text.index("```", start)].splitlines():
        if line[:1].strip():
            first = line.split()[0].rstrip(",")
            folder = first if first.endswith("/") else first.rpartition("/")[0] + "/"
        for name in re.findall(r"(?<![\w/.])([\w/]+\.py)\b", line):
            if "/" not in name:
                paths.add(folder + name)
            else:
                paths.add(name if name.startswith(("ho_onnx/", "cli/")) else f"ho_onnx/{name}")
    return paths


def test_the_design_map_names_every_module_by_path():
    """docs/design.md's map of the packages (issue 13: "the layout described in
    docs/design.md matches the tree") names every module of the library in its own folder,
    and no file that is not there (issue 35: matched by file name, ``cost/contrib.py`` was
    missing unnoticed: ``target/ort/contrib.py`` has the same name)."""
    named = _design_map_paths()
    tree = {str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
            if p.name != "__init__.py" or p.parent == ROOT}
    missing, stale = sorted(tree - named), sorted(
        p for p in named if not (ROOT.parent / p).exists())
    assert not missing, f"add these to the map in docs/design.md: {missing}"
    assert not stale, f"the map in docs/design.md names files that are not there: {stale}"


MAX_FUNCTION_LINES = 60
REASON = "Over 60 lines:"


def test_no_function_over_60_lines_without_a_reason():
    """Issue 13: "no function over ~60 lines without a reason written next to it" (the
    library and the command line; a reason is a comment starting ``Over 60 lines:`` just
    above the ``def`` or its decorators). Found when this test was added: two functions had
    grown past it since the restructure."""
    cli = ROOT.parent / "cli"
    long = []
    for path in [*ROOT.rglob("*.py"), *cli.rglob("*.py")]:
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            above = " ".join(ln.strip() for ln in lines[max(0, first - 4):first - 1])
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and REASON not in above:
                long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"split these, or say why not ('# {REASON} ...' above): {long}"
