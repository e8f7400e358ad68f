"""Live migration's KV worker to worker over gRPC (--kv-transfer grpc): no shared folder needed."""
