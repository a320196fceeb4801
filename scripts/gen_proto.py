"""Generate the gRPC stubs from proto/ into the `pdserve_proto` package (reproducibly: the
grpcio-tools version is pinned in pyproject's dev extra, and a test fails if the committed stubs
differ from a fresh generation).

    python scripts/gen_proto.py [--out DIR]     (default: the repository root)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PACKAGE = "pdserve_proto"


def generate(out_dir: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    (out_dir / PACKAGE).mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [str(p.relative_to(PROTO_ROOT)) for p in protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {protos}")
    init = out_dir / PACKAGE / "__init__.py"
    init.write_text('"""Stubs generated from proto/pdserve_proto by scripts/gen_proto.py."""\n')
    return sorted((out_dir / PACKAGE).iterdir())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
