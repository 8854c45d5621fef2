"""The torch-free layer every process shares (the gateway imports nothing else but protos):
block hashes and KV events, sampling parameters, worker roles, tokenizer and model-file lookup,
proto conversions and the metrics HTTP server."""
