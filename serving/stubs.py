"""Regenerates the committed Python stubs from serving/proto (`python -m serving.stubs [OUT_DIR]`).

The stubs are committed so that the server needs no code generation at install time; a test
regenerates them into a temporary folder and checks that they match the .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO = "serving/proto/jaxinfer/v1/inference.proto"
GENERATED = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")


def generate(out_dir: Path) -> Path:
    """Writes the stubs under out_dir (mirroring the proto's path); returns their folder."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{REPO}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(REPO / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return out_dir / Path(PROTO).parent


if __name__ == "__main__":
    print(generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO))
