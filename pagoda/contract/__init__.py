"""The contract every service shares: what crosses a process boundary, defined once.

- `ids`, `params`, `errors`: request/block ids, SamplingParams and its validation (with the
  context-length rule), every domain exception — pure Python, no grpc, no torch.
- `step`: the scheduler↔worker boundary types (StepPlan, StepResult, NewRequestData, WorkerInfo).
- `error_table`: the one table from those exceptions to gRPC status codes and HTTP statuses.
- `common_codec`, `worker_codec`: protobuf ⇄ dataclass for common.proto and worker.proto.

Every service imports this package; it imports none of them (tests/unit/test_boundaries.py).
Submodules are imported explicitly: importing the package itself loads nothing.
"""
