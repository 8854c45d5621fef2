"""A worker process: one engine behind the internal gRPC Worker API.

Request lifecycle in a unified worker: RPC arrives -> waiting -> running -> finished (stream ends);
a cancelled RPC aborts the request and frees its KV blocks at once.
"""
