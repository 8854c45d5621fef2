"""Generated protobuf and gRPC modules for splitserve.v1 (see ../generate.py)."""
