"""The package's shape: no import circle, no module over 600 lines, packages used by their face.

Imports are read from the source with ``ast``, all of them: at module level, inside functions
(a lazy import still closes a circle, it only hides it) and under ``TYPE_CHECKING``. A
package (a folder with ``__init__.py``) is used from outside only through the names its
``__init__`` lists in ``__all__``; those lists are pinned here, so that widening what other
packages may import is a visible change, as httpx pins its ``__all__``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "gemmd"
MAX_LINES = 600

# What each package offers the rest of gemmd. Change with care: every name here is a
# promise to the modules outside the package.
PUBLIC = {
    "gemmd.cli": ["EXIT_CONFIG", "EXIT_RUNTIME", "UsageError", "build_parser", "main"],
    "gemmd.config": [
        "BACKENDS", "DEFAULT_EXPLORATION", "DEFAULT_SENTINELS", "MIN_WINDOW_S",
        "BudgetConfig", "Config", "DriftConfig", "ExplorationConfig", "FakeConfig",
        "FakeDeviceConfig", "ListenConfig", "MeasureConfig", "MetricsConfig", "ModelConfig",
        "ProbeGroup", "ProbesConfig", "ScheduleConfig", "StoreConfig", "TLSSettings",
        "WebConfig", "budget_warnings", "check", "load", "load_web_config", "parse",
        "warnings",
    ],
    "gemmd.datasets": ["Dataset", "FORMATS", "KNOWN_GPUS", "SHARED", "detect_format",
                       "known_gpu", "known_gpu_names", "load", "load_shared", "shared_data_dir"],
    "gemmd.drift": ["Alarm", "CAUSES", "DeviceDrift", "DriftMonitor", "Track", "Transition",
                    "measured_of", "predicted_of", "residual_of", "stand_in"],
    "gemmd.devices": ["BusyLimits", "Device", "open_devices", "select"],
    "gemmd.model": ["ForestModel", "RooflinePredictor", "TARGETS", "TransferModel",
                    "describe_calibration", "shape_hashes", "table_hash"],
    "gemmd.exporter": ["Exposition", "Metrics", "assemble", "host_name", "serve"],
    "gemmd.store": ["DAEMON_SOURCE", "INTERVAL_COLUMNS", "REQUIRED_COLUMNS", "SCHEMA_VERSION",
                    "SIDECARS", "InstanceLock", "Store", "events_sql", "measured_by",
                    "sentinels_sql"],
    "gemmd.report.fleet": ["write_fleet"],
    "gemmd.report": ["MIN_ROWS", "check_out", "work_units", "write", "write_fleet"],
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _package_of(module: str) -> str:
    return module if module in PACKAGES else module.rpartition(".")[0]


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported gemmd module, name taken from it or None, line) for every import in it."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("gemmd")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = _package_of(module).split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if not base.startswith("gemmd"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:  # `from gemmd import model` imports the module gemmd.model
                    out.append((sub, None, node.lineno))
                else:
                    out.append((base, alias.name, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in _imports(m) if target in MODULES and target != m}
            for m in MODULES}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_counting_lazy_imports():
    assert _circles(_graph()) == []


def test_the_checker_sees_a_lazy_circle(tmp_path, monkeypatch):
    # The check itself must be able to fail: a circle closed inside a function is found.
    graph = {"a": {"b"}, "b": set(), "c": {"a"}}
    assert _circles(graph) == []
    graph["b"].add("c")
    assert _circles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_600_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module]} has {lines} lines"


def test_packages_are_used_through_their_face():
    wrong = []
    for module in MODULES:
        own = _package_of(module)
        for target, name, line in _imports(module):
            if target not in MODULES:
                continue
            pkg = _package_of(target)
            if pkg == "gemmd" or own == pkg or own.startswith(pkg + "."):
                continue  # a top-level module, or inside the package itself
            where = f"{MODULES[module].relative_to(ROOT.parent)}:{line}"
            if target != pkg:
                wrong.append(f"{where}: {target} is inside {pkg}")
            elif name is not None and name not in PUBLIC.get(pkg, []):
                wrong.append(f"{where}: {pkg}.{name} is not in its __all__")
    assert wrong == []


def test_no_module_imports_its_own_package_face():
    # gemmd/x/y.py importing gemmd.x would run x/__init__ half-way: a circle in all but name.
    wrong = [f"{m}:{line}" for m in MODULES if m not in PACKAGES
             for target, _, line in _imports(m)
             if target == _package_of(m) and target != "gemmd"]
    assert wrong == []


@pytest.mark.parametrize("package", sorted(PACKAGES - {"gemmd"}))
def test_public_api_is_pinned(package):
    mod = importlib.import_module(package)
    assert sorted(getattr(mod, "__all__", [])) == sorted(PUBLIC.get(package, []))
    for name in PUBLIC.get(package, []):
        assert hasattr(mod, name), f"{package}.__all__ names {name}, which it lacks"



def _readme_map() -> list[str]:
    """The lines of the module map in the README's architecture section."""
    text = (ROOT.parent / "README.md").read_text()
    section = text.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```\n", 2)[1].splitlines()


def test_the_readme_module_map_matches_the_tree():
    lines = _readme_map()
    mapped = [line.split()[0] for line in lines if line.strip() and not line.startswith(" ")]
    for name in mapped:  # "drift/" is a package, "gemm.py" a module
        assert (ROOT / name.rstrip("/")).exists(), f"README maps {name}, which gemmd/ lacks"
    # Every top-level module and package is named, first on a line or in another's text
    # ("systemd.py, rebaseline.py beside it").
    named = set(mapped) | {w.strip(",;:()") for line in lines for w in line.split()}
    top = sorted(p.name + ("/" if p.is_dir() else "") for p in ROOT.iterdir()
                 if (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))
                 or (p.is_dir() and (p / "__init__.py").exists()))
    assert [t for t in top if t not in named] == []
