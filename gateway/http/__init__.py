"""The gateway's OpenAI-compatible HTTP API (docs/openai.md): Starlette on uvicorn, in the gateway's
process and event loop, over the same request path as gRPC (gateway/generation.py).

  protocol.py   OpenAI JSON -> GenerateRequests (fields.py: typed readers with OpenAI's error shape)
  shaping.py    GenerateResponses -> OpenAI objects: chunks, final bodies, logprobs, usage
  streams.py    n samples as one stream; stop on a client's disconnect
  app.py        the routes, API keys (the gRPC API's, one limiter for both), metrics
  server.py     uvicorn beside grpc.aio: sockets, TLS, no signal handlers of its own
"""
