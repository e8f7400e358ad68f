"""Pinned prefixes: prompts prefilled once and kept in the prefix cache for the engine's lifetime.

`pin_prompt(token_ids)` queues an internal request (id `__pin__/N`, one greedy token) like any other;
when it finishes, the full blocks of its prompt that are registered in the prefix index take one
more reference, held by the pin. A block with a reference is never on the evictable LRU list, so no
flood of other prompts can evict it, and every request that starts with the prompt hits it from
the first one on. After a worker loss (the pool and the index are reset) the pins are queued again.
The pinned blocks count as used; `num_pinned_blocks` reports them.
"""

from __future__ import annotations

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import BlockId, RequestId
from pagoda.contract.params import SamplingParams
from scheduler_svc.core.request import EngineRequest, Sequence

PIN_PREFIX = "__pin__/"


class PinningMixin:
    def _init_pinning(self) -> None:
        self._pinned_prompts: list[tuple[int, ...]] = []  # in pin order, kept across worker losses
        self._pinned_blocks: list[BlockId] = []  # one reference each, held for the engine's life
        self._pin_ids: set[RequestId] = set()  # pin requests not finished yet

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pinned_blocks)

    def pin_prompt(self, token_ids: list[int] | tuple[int, ...]) -> RequestId:
        """Queue `token_ids` to be prefilled and pinned; returns the internal request id. Raises
        InvalidRequestError without prefix caching, or for a prompt that fits no full block."""
        if self._kv.index is None:
            raise InvalidRequestError("pinned prompts need prefix caching (--enable-prefix-caching)")
        if len(token_ids) <= self.config.block_size:
            raise InvalidRequestError(f"a pinned prompt needs more than one block ({self.config.block_size} "
                                      f"tokens) to pin anything; got {len(token_ids)}")
        prompt = tuple(int(t) for t in token_ids)
        self._pinned_prompts.append(prompt)
        return self._queue_pin(len(self._pinned_prompts) - 1)

    def _queue_pin(self, index: int) -> RequestId:
        request_id = RequestId(f"{PIN_PREFIX}{index}")
        self.add_request(EngineRequest(request_id, self._pinned_prompts[index],
                                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
        self._pin_ids.add(request_id)
        return request_id

    @property
    def pins_pending(self) -> bool:
        """True until every pinned prompt has been prefilled (and its blocks pinned)."""
        return bool(self._pin_ids)

    def _pin_finished(self, seq: Sequence) -> None:
        """`seq`, a pin request, is finishing: hold its registered prompt blocks (before they drop)."""
        self._pin_ids.discard(seq.request.request_id)
        blocks = seq.block_table[:min(seq.num_registered_blocks, len(seq.block_table))]
        self._kv.share(blocks)
        self._pinned_blocks += blocks

    def _requeue_pins(self) -> None:
        """The pool was reset (worker loss): the pinned references are gone; pin everything again."""
        self._pinned_blocks = []
        self._pin_ids.clear()
        for index in range(len(self._pinned_prompts)):
            request_id = RequestId(f"{PIN_PREFIX}{index}")
            if request_id not in self._requests:
                self._queue_pin(index)
            else:
                self._pin_ids.add(request_id)
