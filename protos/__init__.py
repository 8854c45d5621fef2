"""Versioned protobuf definitions (splitserve.v1). Built by the gRPC services issue."""
