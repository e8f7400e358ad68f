"""The one model-less worker: `fake_worker.FakeWorker` applies step plans exactly as a real worker
must and models the KV cache slot by slot; `runner.FakeStepRunner` puts it behind the runner
interface the worker service drives.

Only tests, benchmarks, the user-facing tools and the worker's entry point (`--fake`) import it;
product modules never do (tests/unit/test_boundaries.py).
"""
