"""The scheduler core: pure Python (no torch, no grpc), see scheduler.py for the policy."""

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.errors import QueueFullError, SchedulerError
from scheduler_svc.core.kv_cache_manager import KVCacheManager, position_to_block, slot_mapping
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.params import (
                                       BlockId,
                                       EngineRequest,
                                       FinishReason,
                                       InvalidRequestError,
                                       RequestId,
                                       SamplingParams,
)
from scheduler_svc.core.plan import (
                                       BlockCopy,
                                       Fork,
                                       NewRequestData,
                                       StepPlan,
                                       StepResult,
                                       TableUpdate,
                                       TokenLogprobs,
)
from scheduler_svc.core.prefix_index import PrefixIndex, hash_block
from scheduler_svc.core.scheduler import Scheduler, SchedulerStats

__all__ = [
    "BlockCopy", "BlockId", "BlockPool", "EngineRequest", "FinishReason", "Fork", "InvalidRequestError",
    "KVCacheManager", "NewRequestData", "PrefixIndex", "QueueFullError", "RequestId", "SamplingParams",
    "Scheduler", "SchedulerConfig", "SchedulerError", "SchedulerStats", "SequenceDelta", "StepPlan",
    "StepResult", "TableUpdate", "TokenLogprobs", "hash_block", "position_to_block", "slot_mapping",
]
