"""Speculative decoding in the scheduler: the shared Speculator and the n-gram proposer (ngram.py),
suffix decoding (suffix.py), a draft model on the worker (draft_model.py); `make_speculator` picks
one by the config's `method`."""

from __future__ import annotations

from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.spec.draft_model import DraftModelSpeculator
from scheduler_svc.core.spec.ngram import NgramSpeculator, Speculator
from scheduler_svc.core.spec.suffix import SuffixSpeculator


def make_speculator(config: SpeculativeConfig, kv: KVCacheManager, threshold: int) -> Speculator:
    cls = {"suffix": SuffixSpeculator, "draft_model": DraftModelSpeculator}.get(config.method, NgramSpeculator)
    return cls(config, kv, threshold)
