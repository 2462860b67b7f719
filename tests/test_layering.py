"""The package's layers import only downward (or sideways, within a layer).

Every `import` and `from ... import` in adaflash/ is read with `ast`: module level, inside functions and under
`if TYPE_CHECKING:` alike (a lazy import is still a dependency). A module may import its own layer and the
layers below it, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "adaflash"

# Module (or package) prefix -> layer, bottom 0 to top. The longest matching prefix decides, so a listed module
# overrides its package's entry. A module that matches nothing fails the test: place new modules here.
LAYERS: dict[str, int] = {
    # 0: prompt sets; a leaf every layer may use (it imports only itself).
    "adaflash.data": 0,
    # 1: the networks and their files: target runtime, KV cache, drafter, length heads, registry.
    "adaflash.models": 1,
    # 2: file formats shared by the serving recorder (writes) and training/evaluation (read): trajectories and
    #    verification outcomes.
    "adaflash.formats": 2,
    # 3: the algorithms over token ids: sampling, verifier, proposer, reference loops.
    "adaflash.speculative": 3,
    # 4: the serving engine and what runs it: engine, request, scheduler, length policies, cost model, engine
    #    config + factory, recorder, runner (engine thread), hot swap.
    "adaflash.serving": 4,
    # 5: text in, text out (tokenizer + the engine or the reference loops).
    "adaflash.pipeline": 5,
    # 6: training workflows above the engine (datagen drives the engine; online adaptation serves through the
    #    pipeline and the runner): trainer, losses, datasets, length-head fitting, block outcomes, online rounds.
    "adaflash.training": 6,
    # 7: the top: front-ends and experiments. The HTTP server and its parts, every CLI module and its argument
    #    helpers, evaluation/benchmarks/plots, export.
    "adaflash.serving.server": 7,
    "adaflash.serving.protocol": 7,
    "adaflash.serving.gate": 7,
    "adaflash.serving.metrics": 7,
    "adaflash.serving.shutdown": 7,
    "adaflash.serving.cli": 7,
    "adaflash.training.cli": 7,
    "adaflash.evaluation": 7,
    "adaflash.export": 7,
    "adaflash.cli": 7,
    "adaflash.cli_args": 7,
    "adaflash": 7,  # the package's own __init__
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    return None


def imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every adaflash import in the file (or in `source`, read as that file);
    `from pkg import mod` names pkg.mod when mod is a module of its own."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                is_module = (PACKAGE_DIR.parent / Path(*sub.split("."))).with_suffix(".py").is_file() or \
                    (PACKAGE_DIR.parent / Path(*sub.split("."))).is_dir()
                found.append((node.lineno, sub if is_module else module))
    return [(line, m) for line, m in found if m == "adaflash" or m.startswith("adaflash.")]


SOURCES = sorted(PACKAGE_DIR.rglob("*.py"))


def test_the_walk_finds_the_package_and_its_lazy_imports():
    assert len(SOURCES) > 50
    cli = dict((m, line) for line, m in imported_modules(PACKAGE_DIR / "cli.py"))
    assert "adaflash.pipeline" in cli and "adaflash.training.datagen" in cli  # the second one is function-level


def test_every_module_has_a_layer():
    unplaced = [module_name(p) for p in SOURCES if layer_of(module_name(p)) is None]
    assert not unplaced, f"add these modules to LAYERS in {Path(__file__).name}: {unplaced}"


def test_imports_only_go_down():
    upward = []
    for path in SOURCES:
        name = module_name(path)
        here = layer_of(name)
        for line, module in imported_modules(path):
            there = layer_of(module)
            if there is None or (here is not None and there > here):
                upward.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {name} (layer {here}) imports "
                              f"{module} (layer {there})")
    assert not upward, "imports going up a layer:\n" + "\n".join(upward)


def test_data_is_a_leaf():
    for path in (PACKAGE_DIR / "data").rglob("*.py"):
        outside = [m for _, m in imported_modules(path) if not m.startswith("adaflash.data")]
        assert not outside, f"{path.name} imports {outside}"


@pytest.mark.parametrize("source, expected", [
    ("from adaflash.training.trainer import train\n", ["adaflash.training.trainer"]),
    ("def f():\n    from adaflash import pipeline\n", ["adaflash.pipeline"]),
    ("import adaflash.cli_args as a\n", ["adaflash.cli_args"]),
    ("from .engine import Engine\n", ["adaflash.serving.engine"]),
    ("from ..pipeline import Pipeline\n", ["adaflash.pipeline"]),
    ("if TYPE_CHECKING:\n    from adaflash.evaluation.plots import pyplot\n", ["adaflash.evaluation.plots"]),
])
def test_imported_modules_reads_every_form(source, expected):
    probe = PACKAGE_DIR / "serving" / "layering_probe.py"  # never written: `source` is parsed as this file
    assert [m for _, m in imported_modules(probe, source)] == expected


def test_the_table_puts_the_named_cycles_in_order():
    # Each pair was a cycle once: the left side may not import the right side any more.
    assert layer_of("adaflash.serving.recorder") < layer_of("adaflash.training.trainer")
    assert layer_of("adaflash.pipeline") < layer_of("adaflash.serving.server")
    assert layer_of("adaflash.training.online") < layer_of("adaflash.evaluation.plots")
    assert layer_of("adaflash.training.length_head") < layer_of("adaflash.cli_args")
    assert layer_of("adaflash.formats.trajectories") < layer_of("adaflash.serving.recorder")
