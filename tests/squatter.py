"""A squatter: a plaintext gRPC server on a port a member of the cluster will dial, recording every
call's metadata (the attack of issue 35, items 1 and 2). It answers health checks SERVING and GetLoad
with an idle load, as a fake worker would, to be believed.

Run as a script (`python squatter.py PORT`, e.g. as another user) it prints `listening` once bound,
then one line of JSON per call: [method, {header: value}].
"""

from __future__ import annotations

import json
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2

from splitserve.protos.v1 import worker_pb2 as wpb


class Squatter:
    def __init__(self, port: int, host: str = "127.0.0.1", echo: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.called = threading.Event()
        self.echo = echo
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers(
            [
                self._service("grpc.health.v1.Health", "Check", health_pb2.HealthCheckRequest, self._serving),
                self._service("splitserve.v1.Worker", "GetLoad", wpb.GetLoadRequest, self._load),
            ]
        )
        bound = self.server.add_insecure_port(f"{host}:{port}")
        assert bound == port, f"could not bind {host}:{port}"
        self.address = f"{host}:{port}"
        self.server.start()

    def _service(self, service: str, method: str, request_type, behavior) -> grpc.GenericRpcHandler:
        handler = grpc.unary_unary_rpc_method_handler(
            self._recording(method, behavior),
            request_deserializer=request_type.FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )
        return grpc.method_handlers_generic_handler(service, {method: handler})

    def _recording(self, method: str, behavior):
        def record(request, context):
            self.calls.append((method, dict(context.invocation_metadata())))
            if self.echo:
                print(json.dumps(self.calls[-1]), flush=True)
            self.called.set()
            return behavior()

        return record

    @staticmethod
    def _serving():
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    @staticmethod
    def _load():
        return wpb.LoadReport(num_total_blocks=64, num_free_blocks=64, block_size=8)

    def received(self, secret: str) -> bool:
        """Whether any call carried secret in any header."""
        return any(secret in value for _, headers in self.calls for value in headers.values())

    def stop(self) -> None:
        self.server.stop(grace=None)


if __name__ == "__main__":
    squatter = Squatter(int(sys.argv[1]), echo=True)
    print("listening", flush=True)
    squatter.server.wait_for_termination()
