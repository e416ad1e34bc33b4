"""The package's layers: a module imports only from its own layer or below (inside functions too; only
``if TYPE_CHECKING:`` imports are exempt), and no two packages import each other, so each layer can be used, tested
and reasoned about without what sits above it. A new package must be given its layer here; a new import that breaks
a rule fails here, naming the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "hpctrain"

# The layers, bottom to top (docs/development.md shows the same table). A name is a package or a top-level module.
LAYERS: dict[str, int] = {
    **dict.fromkeys(("errors", "units", "atomic", "compat", "logs", "process_exit", "filesystems", "proctree", "provenance",
                     "threads"), 0),
    "config": 1,
    **dict.fromkeys(("dist", "metrics"), 2),
    **dict.fromkeys(("checkpoint", "data", "fault", "monitor", "slurm", "doctor"), 3),
    "datasets": 4,
    "experiments": 5,
    **dict.fromkeys(("train", "perf", "export", "launcher"), 6),
    **dict.fromkeys(("resolution", "sweep", "userloop"), 7),
    "commands": 8,
    **dict.fromkeys(("cli", "__main__", "launch", "srun_task", "__init__"), 9),
}

# Rules beyond "downwards only", one line each: (importer, what it must not import, why).
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("launcher", "train", "the launcher starts any worker program; the training loop is one of them"),
    ("launcher", "experiments", "the launcher never imports user code"),
    ("checkpoint", "train", "checkpoints are read by export, sample and the launcher's checks without a loop"),
    ("checkpoint", "data", "a checkpoint holds the data order's counters, not the data engine"),
    ("checkpoint", "fault", "the lock check reaches a save as a callable (commit_allowed), not an import"),
    ("checkpoint", "monitor", "checkpoints are read where nothing is monitored (export, sample, submit's checks)"),
    ("checkpoint", "slurm", "a checkpoint is the same under any scheduler"),
    ("experiments", "train", "an experiment is a description the loop runs, usable without it"),
    ("datasets", "experiments", "a data set reader serves any experiment"),
)
ENTRY_POINTS = frozenset(name for name, layer in LAYERS.items() if layer == 9)
LAUNCHER_CEILING = 3
"""The launcher (layer 6, beside train) imports nothing above the runtime, fault and monitor layers."""

# Old module paths kept for what users already hold, each the one import that may run up (and only to its target):
# model cards exported before the reshaping print `from hpctrain.train.entry import resolve`.
COMPATIBILITY = {"train/entry.py": "hpctrain.resolution"}
# Job scripts already rendered into run dirs call these programs; each only runs its new path (runpy, by name).
PROGRAM_SHIMS = {"slurm/task.py": "hpctrain.srun_task", "dist/torchrun_main.py": "hpctrain.launch"}


def unit_of(module: str) -> str:
    """hpctrain.train.step -> train; hpctrain.cli -> cli; hpctrain -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every hpctrain import in ``path``, at any depth, except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
               for body in node.body for n in ast.walk(body)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "hpctrain"]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}:{node.lineno}: a relative import; hpctrain names its modules in full")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hpctrain":
            found.append((node.lineno, node.module))
            # from hpctrain.train import loop; from hpctrain import commands, resolve_config (the public API's)
            found += [(node.lineno, target) for a in node.names
                      if (target := _submodule(node.module, a.name)) is not None]
    return found


def _submodule(package: str, name: str) -> str | None:
    """The module that ``from package import name`` reaches beyond ``package`` itself, if any."""
    folder = SRC.joinpath(*package.split(".")[1:])
    if (folder / name).is_dir() or (folder / f"{name}.py").is_file():
        return f"{package}.{name}"
    if package == "hpctrain":
        return PUBLIC_API.get(name)
    return None


def _public_api() -> dict[str, str]:
    """hpctrain's lazily imported public names and their modules (``_PUBLIC`` in its __init__), read without
    importing it."""
    tree = ast.parse((SRC / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_PUBLIC" \
                or isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_PUBLIC" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("hpctrain/__init__.py has no _PUBLIC table")


PUBLIC_API = _public_api()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def edges() -> list[tuple[Path, int, str, str]]:
    """(file, line, importer unit, imported unit) for every import between two different units (a compatibility
    module's import of its target left out: test_compatibility_modules_only_reach_their_target)."""
    found = []
    for path in sources():
        me = unit_of(module_name(path))
        shim_target = COMPATIBILITY.get(str(path.relative_to(SRC)))
        for line, module in imported_modules(path):
            if module == shim_target:
                continue
            other = unit_of(module)
            if other not in (me, "__init__"):  # the package itself: __version__, imported by everyone anyway
                found.append((path, line, me, other))
    return found


def test_every_package_and_module_has_a_layer():
    units = {unit_of(module_name(p)) for p in sources()}
    missing = sorted(units - set(LAYERS))
    assert not missing, f"give these a layer in LAYERS: {missing}"


def test_imports_go_down_only():
    bad = [f"{p.relative_to(SRC)}:{line} ({me}, layer {LAYERS[me]}) imports {other} (layer {LAYERS[other]})"
           for p, line, me, other in edges() if LAYERS.get(other, 99) > LAYERS.get(me, -1)]
    assert not bad, "an import runs up a layer:\n" + "\n".join(bad)


@pytest.mark.parametrize("importer,forbidden,why", FORBIDDEN, ids=[f"{a}-not-{b}" for a, b, _ in FORBIDDEN])
def test_named_rules(importer: str, forbidden: str, why: str):
    bad = [f"{p.relative_to(SRC)}:{line} imports {other}" for p, line, me, other in edges()
           if me == importer and other == forbidden]
    assert not bad, f"{importer} must not import {forbidden} ({why}):\n" + "\n".join(bad)


def test_the_launcher_imports_nothing_above_the_runtime_fault_and_monitor_layers():
    bad = [f"{p.relative_to(SRC)}:{line} imports {other} (layer {LAYERS[other]})" for p, line, me, other in edges()
           if me == "launcher" and LAYERS[other] > LAUNCHER_CEILING]
    assert not bad, "the launcher starts any worker program and imports no part of one:\n" + "\n".join(bad)


def test_compatibility_modules_only_reach_their_target():
    for name, target in COMPATIBILITY.items():
        imports = {module for _, module in imported_modules(SRC / name)}
        assert imports == {target}, f"{name} is a compatibility module: it imports {target} only, got {imports}"
    for name, target in PROGRAM_SHIMS.items():
        tree = ast.parse((SRC / name).read_text())
        code = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        runs = [node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "attr", "") == "run_module"]
        assert len(code) == 1 and isinstance(code[0], ast.If) and runs == [target], \
            f"{name} only runs {target} as __main__ (a job script's old path); move any code to {target}"


def test_only_entry_points_import_the_commands():
    bad = [f"{p.relative_to(SRC)}:{line}" for p, line, me, other in edges()
           if other == "commands" and me not in ENTRY_POINTS]  # (within commands/ is one unit)
    assert not bad, "only the entry points (cli, __main__, launch, srun_task) import hpctrain.commands:\n" + "\n".join(bad)


def test_no_two_packages_import_each_other():
    graph: dict[str, set[str]] = {}
    for _, _, me, other in edges():
        graph.setdefault(me, set()).add(other)
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, f"import cycles between packages: {cycles}"


def test_no_module_import_cycle():
    graph: dict[str, set[str]] = {}
    names = {module_name(p) for p in sources()}
    for path in sources():
        me = module_name(path)
        for _, module in imported_modules(path):
            target = module if module in names else module.rsplit(".", 1)[0]
            if target in names and target != me and target != "hpctrain":
                graph.setdefault(me, set()).add(target)
    cycles = [sorted(c) for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, f"import cycles between modules: {cycles}"


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative enough for a few hundred modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            found.append(component)

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_the_rules_catch_a_function_level_import_and_skip_type_checking(tmp_path: Path):
    sample = tmp_path / "m.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hpctrain.train.state import S\n"
                      "def f():\n    from hpctrain.train.step import T\n")
    assert imported_modules(sample) == [(5, "hpctrain.train.step")]


def test_the_rules_see_submodules_and_the_public_api(tmp_path: Path):
    sample = tmp_path / "m.py"
    sample.write_text("from hpctrain.train import loop\nfrom hpctrain import resolve_config, __version__\n")
    assert imported_modules(sample) == [(1, "hpctrain.train"), (1, "hpctrain.train.loop"), (2, "hpctrain"),
                                        (2, "hpctrain.resolution")]


def test_a_cycle_is_found():
    assert sorted(map(sorted, strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}))) == [["a", "b"], ["c"]]
