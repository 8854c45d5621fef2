"""Package layout rules: one import root, and torch-free modules stay torch-free."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_and_kv_bookkeeping_do_not_import_torch():
    code = ("import sys, splitserve.gateway, splitserve.services.kv_cache.block_hash, "
            "splitserve.services.kv_cache.manager, splitserve.services.engine.request, "
            "splitserve.services.engine.scheduler; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_subpackages_live_under_one_root():
    import splitserve.gateway
    import splitserve.kernels
    import splitserve.protos
    import splitserve.services

    for mod in (splitserve.services, splitserve.gateway, splitserve.kernels, splitserve.protos):
        assert mod.__name__.startswith("splitserve.")
