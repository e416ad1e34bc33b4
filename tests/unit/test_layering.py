"""The package's layers: lower ones never import upper ones (not even inside a function), so each can be used,
tested and reasoned about without what sits above it. A new import that breaks a rule fails here, naming it."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "hpctrain"

# package -> the hpctrain packages and modules it must not import
FORBIDDEN = {
    "checkpoint": ("train", "fault", "monitor", "cli", "experiments", "launch", "slurm", "data"),
    "dist": ("train", "fault", "monitor", "cli", "experiments", "launch", "checkpoint", "slurm", "data"),
    "config": ("train", "fault", "monitor", "cli", "experiments", "launch", "checkpoint", "data"),
    "metrics": ("train", "fault", "cli", "experiments", "launch", "checkpoint"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(package: str):
    bad = []
    for path in sorted((SRC / package).rglob("*.py")):
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "hpctrain" and len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(SRC)}:{line} imports {module}")
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_the_rule_catches_a_function_level_import(tmp_path: Path):
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from hpctrain.train.state import TrainState\n")
    assert (2, "hpctrain.train.state") in imported_modules(sample)
