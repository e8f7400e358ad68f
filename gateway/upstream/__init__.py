"""The schedulers behind the gateway: one `engine_client` per scheduler, a `replica_set` (with
`routing` and circuit breakers) for data-parallel replicas, `model_pools` (which model a request
names), `lora_adapters` (adapters served by their base model's pool) and `fallback` (another
model's pool when the requested one refuses)."""
