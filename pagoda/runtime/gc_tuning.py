"""Keep Python's cyclic garbage collector off the per-token path of a long-running service.

Every service reaches a steady state where almost every live object (modules, the model, the
tokenizer, gRPC and FastAPI machinery) lives as long as the process. The collector does not know
that: each full collection walks all of them, and the generation counters trigger one every few
hundred thousand allocations, so at batch 1 a token now and then takes a full walk of the heap on
top of its step (measured at 1,024 running requests in the scheduler: p99 step ~6 ms -> ~95 ms).
`gc.freeze()` moves every object alive now to a permanent generation the collector never scans;
they are still freed by reference counting.
"""

from __future__ import annotations

import gc


def freeze_long_lived_objects() -> None:
    """Collect, then freeze what survives. Call it when nothing request-scoped is alive (after
    start-up, or when an engine is idle), so no request's garbage is frozen with it."""
    gc.collect()
    gc.freeze()
