"""The scheduler core: pure Python (no torch, no grpc), see scheduler.py for the policy.

It owns the policy only; the types it shares with the other services (ids, SamplingParams, the step
plan and result, the errors) come from `pagoda.contract`.
"""

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.kv_cache_manager import KVCacheManager, position_to_block, slot_mapping
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.prefix_index import PrefixIndex, hash_block
from scheduler_svc.core.request import EngineRequest
from scheduler_svc.core.scheduler import Scheduler, SchedulerStats

__all__ = [
    "BlockPool", "EngineRequest", "KVCacheManager", "PrefixIndex", "Scheduler", "SchedulerConfig",
    "SchedulerStats", "SequenceDelta", "hash_block", "position_to_block", "slot_mapping",
]
