"""Package layout rules: one import root, and torch-free modules stay torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def test_gateway_and_kv_bookkeeping_do_not_import_torch():
    code = (
        "import sys, splitserve.gateway, splitserve.common.block_hash, "
        "splitserve.services.engine.kv_cache.manager, splitserve.services.engine.request, "
        "splitserve.services.engine.scheduler, splitserve.gateway.server; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_planner_does_not_import_torch():
    """It runs beside the gateway; only `splitserve profile` (services/planner/profiler.py) loads torch."""
    code = (
        "import sys, splitserve.services.planner.cli, splitserve.services.planner.loop, "
        "splitserve.services.planner.reader, splitserve.services.planner.simulator, "
        "splitserve.services.planner.metrics; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


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


def test_the_public_api_loads_lazily_and_without_torch_until_used():
    code = (
        "import sys, splitserve; assert 'torch' not in sys.modules; "
        "from splitserve import SamplingParams; assert 'torch' not in sys.modules; "
        "from splitserve import LLM, EngineConfig; "
        "from splitserve.services.engine.llm import LLM as L; assert LLM is L; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_gateway_imports_only_the_common_layer_and_protos():
    """The torch-free layer is common/: the gateway reaches nothing else of the workers' code."""
    import re
    from pathlib import Path

    import splitserve.gateway

    for path in Path(splitserve.gateway.__file__).parent.rglob("*.py"):
        for module in re.findall(r"^\s*(?:from|import) (splitserve\.\w+)", path.read_text(), re.M):
            assert module in ("splitserve.gateway", "splitserve.common", "splitserve.protos"), (path.name, module)


def test_generated_proto_code_is_current():
    out = subprocess.run(
        [sys.executable, "-m", "splitserve.protos.generate", "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


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
    """services/disagg/ and services/worker/ use AsyncEngine (streams), HandoffPort (everything else of a handoff) and
    plain data types; never the engine's scheduler, block pool, runner or leases."""
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

    root = Path(__file__).resolve().parent.parent
    installed = importlib.metadata.packages_distributions()
    for folder in ("benchmarks", "scripts", "tests"):
        clashes = sorted(p.name for p in (root / folder).glob("*.py") if p.stem in installed)
        assert not clashes, f"{folder}/ shadows installed packages: {clashes}"
    for sub in sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists()):
        spec = importlib.util.find_spec(sub)
        origin = spec.origin if spec is not None else None
        assert origin is None or Path(origin).resolve() != root / sub / "__init__.py", f"{sub} imports top-level"
