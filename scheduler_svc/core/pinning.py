"""Pinned prefixes: prompts prefilled once and kept in the prefix cache for the engine's lifetime.

`pin_prompt(token_ids)` queues an internal request (id `__pin__/N`, one greedy token) like any other;
when it finishes, the full blocks of its prompt that are registered in the prefix index take one
more reference, held by the pin. A block with a reference is never on the evictable LRU list, so no
flood of other prompts can evict it, and every request that starts with the prompt hits it from
the first one on. After a worker loss (the pool and the index are reset) the pins are queued again.
The pinned blocks count as used; `num_pinned_blocks` reports them.

The Scheduler holds one PromptPinner; it queues its requests through the scheduler's add_request
(a callback) and keeps its references through the KV manager.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import BlockId, RequestId
from pagoda.contract.params import SamplingParams
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.request import EngineRequest, Request, Sequence

PIN_PREFIX = "__pin__/"


class PromptPinner:
    def __init__(self, kv: KVCacheManager, requests: Mapping[RequestId, Request],
                 add_request: Callable[[EngineRequest], None]) -> None:
        self._kv = kv
        self._requests = requests  # the scheduler's unfinished requests (read only)
        self._add_request = add_request
        self._prompts: list[tuple[int, ...]] = []  # in pin order, kept across worker losses
        self.blocks: list[BlockId] = []  # one reference each, held for the engine's life
        self._ids: set[RequestId] = set()  # pin requests not finished yet

    @property
    def pending(self) -> bool:
        """True until every pinned prompt has been prefilled (and its blocks pinned)."""
        return bool(self._ids)

    def pin(self, token_ids: list[int] | tuple[int, ...]) -> RequestId:
        """Queue `token_ids` to be prefilled and pinned; returns the internal request id. Raises
        InvalidRequestError without prefix caching, or for a prompt that fits no full block."""
        block_size = self._kv.block_size
        if self._kv.index is None:
            raise InvalidRequestError("pinned prompts need prefix caching (--enable-prefix-caching)")
        if len(token_ids) <= block_size:
            raise InvalidRequestError(f"a pinned prompt needs more than one block ({block_size} "
                                      f"tokens) to pin anything; got {len(token_ids)}")
        prompt = tuple(int(t) for t in token_ids)
        self._prompts.append(prompt)
        return self._queue(len(self._prompts) - 1)

    def _queue(self, index: int) -> RequestId:
        request_id = RequestId(f"{PIN_PREFIX}{index}")
        self._add_request(EngineRequest(request_id, self._prompts[index],
                                        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
        self._ids.add(request_id)
        return request_id

    def is_pin(self, request: Request) -> bool:
        return bool(self._ids) and request.request_id in self._ids

    def finishing(self, seq: Sequence) -> None:
        """`seq`, running, is finishing: if it is a pin request, hold its registered prompt blocks
        (before they drop)."""
        if not self._ids or seq.request.request_id not in self._ids:
            return
        self._ids.discard(seq.request.request_id)
        blocks = seq.block_table[:min(seq.num_registered_blocks, len(seq.block_table))]
        self._kv.share(blocks)
        self.blocks += blocks

    def requeue(self) -> None:
        """The pool was reset (worker loss): the pinned references are gone; pin everything again."""
        self.blocks = []
        self._ids.clear()
        for index in range(len(self._prompts)):
            request_id = RequestId(f"{PIN_PREFIX}{index}")
            if request_id not in self._requests:
                self._queue(index)
            else:
                self._ids.add(request_id)
