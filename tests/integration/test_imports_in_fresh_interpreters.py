"""Package layout rules: one import root, and torch-free modules stay torch-free."""

from __future__ import annotations

import subprocess
import sys


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


def test_the_public_api_loads_lazily_and_without_torch_until_used():
    code = (
        "import sys, splitserve; assert 'torch' not in sys.modules; "
        "from splitserve import SamplingParams; assert 'torch' not in sys.modules; "
        "from splitserve import LLM, EngineConfig; "
        "from splitserve.services.engine.llm import LLM as L; assert LLM is L; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_generated_proto_code_is_current():
    out = subprocess.run(
        [sys.executable, "-m", "splitserve.protos.generate", "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
