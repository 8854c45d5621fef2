"""Package layout rules: one import root, and torch-free modules stay torch-free."""

from __future__ import annotations

from pathlib import Path


def test_folder_path_is_import_path():
    """The repository's root is the splitserve package: services/engine/scheduler.py is
    splitserve.services.engine.scheduler, and the top level is the design card's."""
    import importlib
    from pathlib import Path

    import splitserve

    root = Path(splitserve.__file__).parent
    for name in (
        "common",
        "gateway",
        "kernels",
        "protos",
        "experiments",
        "services.engine",
        "services.model",
        "services.disagg",
        "services.worker",
        "services.planner",
        "services.launcher",
    ):
        module = importlib.import_module(f"splitserve.{name}")
        assert Path(module.__file__).parent == root.joinpath(*name.split(".")), name
    for folder in ("protos", "services", "kernels", "gateway", "deploy", "tests"):
        assert (root / folder).is_dir(), folder


def test_the_gateway_imports_only_the_common_layer_and_protos():
    """The torch-free layer is common/: the gateway reaches nothing else of the workers' code."""
    import re
    from pathlib import Path

    import splitserve.gateway

    for path in Path(splitserve.gateway.__file__).parent.rglob("*.py"):
        for module in re.findall(r"^\s*(?:from|import) (splitserve\.\w+)", path.read_text(), re.M):
            assert module in ("splitserve.gateway", "splitserve.common", "splitserve.protos"), (path.name, module)


def test_protos_follow_the_house_rules():
    from pathlib import Path

    import splitserve.protos

    for proto in (Path(splitserve.protos.__file__).parent / "v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        assert "package splitserve.v1;" in lines
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "//"))
            if is_field or stripped.startswith(("rpc ", "message ", "enum ", "service ")):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} has no comment: {stripped}"
        enums = [line for line in lines if line.strip().startswith("enum ")]
        for enum_line in enums:
            first_value = lines[lines.index(enum_line) + 2].strip()
            assert "_UNSPECIFIED = 0;" in first_value, f"{proto.name}: {enum_line.strip()} must start at *_UNSPECIFIED"


def test_disagg_and_worker_reach_the_engine_only_through_its_interfaces():
    """services/disagg/ and services/worker/ use the engine core's client (streams, reports),
    HandoffPort (the rest of a handoff) and plain data types; never the engine's scheduler, block pool,
    runner or leases."""
    import re
    from pathlib import Path

    import splitserve.services.disagg
    import splitserve.services.worker

    inside = re.compile(r"\.engine\.engine\b|\.(runner|scheduler|kv|leases|sampler|runtime|_tracked)\.")
    for package in (splitserve.services.disagg, splitserve.services.worker):
        for path in Path(package.__file__).parent.rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if code.lstrip().startswith(("from ", "import ")):
                    continue
                assert not inside.search(code), f"{path.name}:{number} reaches into the engine: {line.strip()}"


def test_no_folder_on_sys_path_shadows_an_installed_package():
    """A script's folder comes first on sys.path (`python benchmarks/x.py`; pytest puts tests/ there):
    a module there named like an installed package's top-level module breaks every import of that
    package (benchmarks/kernels.py did, against Hugging Face's `kernels`, which transformers 5.25
    imports). The root's folders are splitserve's subpackages and never on sys.path in tests
    (conftest.py takes off the directory `python -m pytest` adds)."""
    import importlib.metadata
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    installed = importlib.metadata.packages_distributions()
    for folder in ("benchmarks", "scripts", "tests"):
        clashes = sorted(p.name for p in (root / folder).glob("*.py") if p.stem in installed)
        assert not clashes, f"{folder}/ shadows installed packages: {clashes}"
    for sub in sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists()):
        spec = importlib.util.find_spec(sub)
        origin = spec.origin if spec is not None else None
        assert origin is None or Path(origin).resolve() != root / sub / "__init__.py", f"{sub} imports top-level"


def package_imports(root: Path) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> where, over every module under root that belongs to
    the splitserve package (function-level imports included; the generated protos/v1 and tests left
    out). A package is a top-level folder, or services/<name>; root modules (__init__, __main__) are
    entry points of their own."""
    import ast

    def package(module: str) -> str | None:
        parts = module.split(".")
        if parts[0] != "splitserve" or len(parts) < 2:
            return None
        return ".".join(parts[1:3]) if parts[1] == "services" and len(parts) > 2 else parts[1]

    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("tests", "build") or rel.parts[0].startswith(".") or rel.parts[:2] == ("protos", "v1"):
            continue
        source = package("splitserve." + ".".join(rel.with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
                if node.module in ("splitserve", "splitserve.services"):
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                target = package(name)
                if source and target and target != source:
                    edges.setdefault((source, target), []).append(f"{rel}:{node.lineno}")
    return edges


def import_cycle(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """One cycle of packages with the imports that make it, or [] when the packages form a DAG."""
    import graphlib

    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        cycle = e.args[1]  # [a, b, ..., a], each importing the one before it
        return [f"{b} -> {a}: {', '.join(edges[(b, a)][:3])}" for a, b in zip(cycle, cycle[1:])]
    return []


def test_packages_import_each_other_without_cycles():
    """Layers, bottom up: protos, common, kernels, services.model, services.engine, services.disagg,
    services.worker, services.planner, services.launcher, experiments; the gateway on common and
    protos; `splitserve` (__main__) on all. Engine arguments live beside the engine's config
    (services/engine/arg_utils.py), shared security flags in common/security_args.py."""
    import splitserve

    edges = package_imports(Path(splitserve.__file__).parent)
    assert edges, "no imports found: the walk is broken"
    assert not import_cycle(edges), "packages import each other in a cycle:\n  " + "\n  ".join(import_cycle(edges))


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The check above can fail: two packages that import each other (one inside a function)."""
    (tmp_path / "services" / "planner").mkdir(parents=True)
    (tmp_path / "services" / "launcher").mkdir(parents=True)
    (tmp_path / "services/planner/cli.py").write_text("def f():\n    from splitserve.services.launcher.cli import x\n")
    (tmp_path / "services/launcher/cli.py").write_text("from splitserve.services.planner import loop\n")
    (tmp_path / "common.py").write_text("import splitserve.protos.v1.x\n")  # an edge outside the cycle
    cycle = import_cycle(package_imports(tmp_path))
    assert sorted(line.split(":")[0] for line in cycle) == [
        "services.launcher -> services.planner",
        "services.planner -> services.launcher",
    ], cycle
