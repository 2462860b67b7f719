"""The package's parts import only downward.

Every `import` and `from ... import` in adaflash/ is read with `ast`: module level, inside functions and under
`if TYPE_CHECKING:` alike (a lazy import is still a dependency). Each top-level part of adaflash/ (a folder or a
module) is one layer; a module may import its own part and the parts below it, never one above, so no two parts
can import each other. Inside models/ the rooms are layers too (`MODEL_ROOMS`), and across the whole package no two
modules import each other, directly or around a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "adaflash"

# The top-level parts of adaflash/, bottom to top. A new part fails the test until it is placed here.
UNITS: list[str] = [
    "data",  # prompt sets; imports nothing else of the package
    "models",  # the networks and their files: target runtime, KV cache, drafter, length heads, tokenizer codec
    "formats",  # trajectories and verification outcomes: written by the engine's recorder, read by training
    "speculative",  # over token ids: sampling, verifier, proposer, prompt lookup, length policies, cost model
    "engine",  # the continuous-batching engine, its factory, scheduler, runner thread, recorder, hot swap
    "pipeline",  # text in, text out: tokenizer + the engine or the reference loops
    "cli_args",  # argument helpers every command module shares
    "report",  # the JSON + markdown files a measurement writes, and their tables: training's and evaluation's alike
    "plots",  # figures (matplotlib)
    "training",  # drafter and length-head training, data generation, online adaptation; its commands
    "server",  # the OpenAI-compatible HTTP server over the engine, and `adaflash serve`
    "evaluation",  # benchmarks and reports; their commands
    "export",  # GGUF export; its command
    "simulation",  # the engine in virtual time: step-cost models, synthetic models, `bench simulate`
    "cli",  # the `adaflash` command: every part's commands under one parser
    "",  # the package's own __init__
]
LAYERS = {unit: i for i, unit in enumerate(UNITS)}
# The rooms of models/, bottom to top (a folder or a module of models/); the same rule holds between them.
MODEL_ROOMS: list[str] = [
    "files",  # safetensors, config.json, the user cache
    "device",  # where models run, what the CPU is, memory, the CUDA path checked without a GPU
    "kernels",  # our CPU kernels, the quantization formats they read, the kernel choice, the compute dtype
    "layers",  # functional pieces the target and the drafters share
    "kv_cache",  # the KV cache and the ragged batch that addresses it
    "targets",  # the target runtime, its architectures, GGUF and checkpoint loading, its tokenizer
    "drafters",  # the DFlash drafters, their checkpoints and vocabularies, the length heads
]
ROOMS = {room: i for i, room in enumerate(MODEL_ROOMS)}


def unit_of(module: str) -> str:
    """`adaflash.engine.runner` -> `engine`; the package itself -> ''."""
    return module.split(".")[1] if module.count(".") else ""


def layer_of(module: str) -> int | None:
    return LAYERS.get(unit_of(module)) if module.split(".")[0] == "adaflash" else None


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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


def room_of(module: str) -> str | None:
    """`adaflash.models.targets.model` -> `target`; None outside models/ and for models/ itself."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["adaflash", "models"] else None


def upward_imports(path: Path, source: str | None = None) -> list[str]:
    """Every import in the file (or in `source`, read as that file) of a part above the file's own, or of a room of
    models/ above the file's own room."""
    name = module_name(path)
    here = layer_of(name)
    found = []
    for line, module in imported_modules(path, source):
        there = layer_of(module)
        where = f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {name}"
        if here is None or there is None or there > here:
            found.append(f"{where} ({unit_of(name) or 'adaflash'}) imports {module} ({unit_of(module) or 'adaflash'})")
        elif room_of(name) is not None and room_of(module) is not None:
            if room_of(module) not in ROOMS or ROOMS[room_of(module)] > ROOMS.get(room_of(name), -1):
                found.append(f"{where} (models/{room_of(name)}) imports {module} (models/{room_of(module)})")
    return found


def import_graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the package's modules it imports (lazy imports too), over every file of adaflash/; `sources` replaces
    or adds files (path relative to adaflash/ -> its text)."""
    texts = {p.relative_to(PACKAGE_DIR).as_posix(): None for p in SOURCES} | (sources or {})
    graph = {}
    for rel, text in texts.items():
        path = PACKAGE_DIR / rel
        graph[module_name(path)] = {m for _, m in imported_modules(path, text)}
    return {name: {m for m in deps if m in graph and m != name} for name, deps in graph.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm): each is a circle of imports."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_finds_the_package_and_its_lazy_imports():
    assert len(SOURCES) > 50
    cli = dict((m, line) for line, m in imported_modules(PACKAGE_DIR / "cli.py"))
    assert "adaflash.pipeline" in cli and "adaflash.training.datagen" in cli  # the second one is function-level


def test_every_part_has_a_layer():
    parts = {p.relative_to(PACKAGE_DIR).parts[0].removesuffix(".py") for p in SOURCES}
    parts = {"" if part == "__init__" else part for part in parts}
    assert parts == set(UNITS), f"place new parts in UNITS, drop gone ones: {sorted(parts ^ set(UNITS))}"
    unplaced = [module_name(p) for p in SOURCES if layer_of(module_name(p)) is None]
    assert not unplaced, f"add these modules' parts to UNITS in {Path(__file__).name}: {unplaced}"


def test_imports_only_go_down():
    upward = [found for path in SOURCES for found in upward_imports(path)]
    assert not upward, "imports going up a layer:\n" + "\n".join(upward)


def test_every_room_of_models_is_placed():
    rooms = {p.relative_to(PACKAGE_DIR / "models").parts[0].removesuffix(".py") for p in (PACKAGE_DIR / "models").iterdir()
             if p.suffix == ".py" or (p / "__init__.py").is_file()} - {"__init__"}
    assert rooms == set(MODEL_ROOMS), f"place new rooms in MODEL_ROOMS, drop gone ones: {sorted(rooms ^ set(MODEL_ROOMS))}"


def test_no_module_imports_another_that_imports_it_back():
    found = circles(import_graph())
    assert not found, "circles of imports:\n" + "\n".join(" <-> ".join(group) for group in found)


@pytest.mark.parametrize("sources, expected", [
    # a pair inside one part, as simulation/replay.py and simulate.py once were
    ({"simulation/probe_a.py": "from adaflash.simulation.probe_b import f\n",
      "simulation/probe_b.py": "def f():\n    from adaflash.simulation.probe_a import g\n"},
     [["adaflash.simulation.probe_a", "adaflash.simulation.probe_b"]]),
    # three modules around a circle
    ({"speculative/probe_a.py": "from adaflash.speculative.probe_b import x\n",
      "speculative/probe_b.py": "from adaflash.speculative.probe_c import y\n",
      "speculative/probe_c.py": "from adaflash.speculative.probe_a import z\n"},
     [["adaflash.speculative.probe_a", "adaflash.speculative.probe_b", "adaflash.speculative.probe_c"]]),
])
def test_a_circle_is_caught(sources, expected):
    assert circles(import_graph(sources)) == expected


@pytest.mark.parametrize("probe, source", [
    ("models/kernels/probe.py", "from adaflash.models.targets.registry import cache_root\n"),
    ("models/device/probe.py", "def f():\n    from adaflash.models.kernels import packed\n"),
    ("models/targets/probe.py", "from adaflash.models.drafters.dflash import DFlashDrafter\n"),
    ("models/files.py", "from adaflash.models.device.placement import placed\n"),
])
def test_an_import_up_the_rooms_of_models_is_caught(probe, source):
    assert len(upward_imports(PACKAGE_DIR / probe, source)) == 1


@pytest.mark.parametrize("probe, source", [
    ("engine/probe.py", "from adaflash.pipeline import Pipeline\n"),
    ("speculative/probe.py", "def f():\n    from adaflash.engine import request\n"),
    ("speculative/probe.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from adaflash.engine.request import Request\n"),
    ("training/probe.py", "from adaflash.evaluation.tau import run\n"),
    ("pipeline.py", "from .server import server\n"),
    ("data/probe.py", "import adaflash.models.targets.registry\n"),
])
def test_an_upward_import_is_caught(probe, source):
    assert len(upward_imports(PACKAGE_DIR / probe, source)) == 1


def test_the_package_never_imports_the_benchmark_scripts():
    # benchmarks/ sits beside the package and is not installed with it: such an import works only in a checkout.
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}" for n in names
                      if n.split(".")[0] == "benchmarks"]
    assert not found, "the package imports from benchmarks/: " + ", ".join(found)


def test_data_is_a_leaf():
    for path in (PACKAGE_DIR / "data").rglob("*.py"):
        outside = [m for _, m in imported_modules(path) if not m.startswith("adaflash.data")]
        assert not outside, f"{path.name} imports {outside}"


@pytest.mark.parametrize("source, expected", [
    ("from adaflash.training.trainer import train\n", ["adaflash.training.trainer"]),
    ("def f():\n    from adaflash import pipeline\n", ["adaflash.pipeline"]),
    ("import adaflash.cli_args as a\n", ["adaflash.cli_args"]),
    ("from .engine import Engine\n", ["adaflash.engine.engine"]),
    ("from ..pipeline import Pipeline\n", ["adaflash.pipeline"]),
    ("if TYPE_CHECKING:\n    from adaflash.plots import pyplot\n", ["adaflash.plots"]),
])
def test_imported_modules_reads_every_form(source, expected):
    probe = PACKAGE_DIR / "engine" / "layering_probe.py"  # never written: `source` is parsed as this file
    assert [m for _, m in imported_modules(probe, source)] == expected


def test_the_table_puts_the_named_cycles_in_order():
    # Each pair was a cycle once: the left side may not import the right side any more.
    assert layer_of("adaflash.engine.recorder") < layer_of("adaflash.training.trainer")
    assert layer_of("adaflash.pipeline") < layer_of("adaflash.server.server")
    assert layer_of("adaflash.engine.engine") < layer_of("adaflash.pipeline")
    assert layer_of("adaflash.training.cli") < layer_of("adaflash.evaluation.tau")
    assert layer_of("adaflash.speculative.length_policy") < layer_of("adaflash.engine.request")
    assert layer_of("adaflash.models.targets.text_codec") < layer_of("adaflash.engine.engine")
    assert layer_of("adaflash.training.length_head") < layer_of("adaflash.cli")
    assert layer_of("adaflash.formats.trajectories") < layer_of("adaflash.engine.recorder")
