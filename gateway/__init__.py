"""splitserve gRPC gateway (torch-free). Built by the gRPC services issue."""
