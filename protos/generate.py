"""Regenerate the Python modules for protos/v1/*.proto (committed; a test checks they are current).

python -m splitserve.protos.generate          # rewrite protos/v1/*_pb2*.py
python -m splitserve.protos.generate --check  # exit 1 if they differ from the .proto files
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
VIRTUAL_ROOT = "splitserve/protos"  # generated imports then read `from splitserve.protos.v1 import ...`


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted((PROTO_DIR / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{VIRTUAL_ROOT}={PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ]
    args += [f"{VIRTUAL_ROOT}/v1/{p.name}" for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / VIRTUAL_ROOT / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        stale = [
            f.name
            for f in files
            if not (PROTO_DIR / "v1" / f.name).exists() or not filecmp.cmp(f, PROTO_DIR / "v1" / f.name, shallow=False)
        ]
        if args.check:
            if stale:
                print(f"generated code is stale: {stale}; run python -m splitserve.protos.generate")
                return 1
            return 0
        for f in files:
            shutil.copy(f, PROTO_DIR / "v1" / f.name)
    print(f"wrote {len(files)} files to {PROTO_DIR / 'v1'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
