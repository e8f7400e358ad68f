"""Structured outputs on the worker: grammar compilation off the step loop, one matcher per resident
sequence, and the token bitmask applied to the logits rows that need it, batched on the device.

Why here and not in the scheduler: the mask of step N+1 depends on the token sampled at step N,
and only the worker has that token when step N+1 runs. The scheduler pipelines (it sends plan N+1
before result N returns), so a scheduler-side grammar would either stall the pipeline or send a
stale mask, and it would put a [V/32] mask per row on every plan (6 KB a row for a 49k vocabulary)
where plans carry only changes. The worker already keeps every sequence's tokens; a matcher is one
more piece of that resident state.

A matcher is never told about tokens directly: before each mask it catches up with the sequence's
own token list (prompt + outputs), rolling back what the list no longer holds. So a request
resumed after preemption, re-sent after a worker restart, or forked for n > 1 rebuilds its grammar
state by replaying its outputs, and a speculative step masks each draft position with the state
after the drafts before it (a draft the grammar refuses gets probability 0, so it is rejected),
with no protocol change.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagoda.contract.structured import StructuredOutputsParams, to_grammar
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)


class GrammarCompiler:
    """Compiles specs on a background thread; keeps the last `cache_size` compiled grammars (as
    fresh matchers that each request deep-copies). The llguidance tokenizer is built on first use."""

    def __init__(self, model: str, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 256, max_workers: int = 2) -> None:
        self._model, self._vocab_size, self._eos = model, vocab_size, list(eos_token_ids)
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the cache (taken on the step loop: never held for long)
        self._tokenizer_lock = threading.Lock()  # the one slow tokenizer build (compile threads)
        self._tokenizer: Any = None

    def start(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled matcher (a template: copy it); cached by (kind, spec)."""
        key = (params.kind, params.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._executor.submit(self._compile, params)
                self._cache[key] = future
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return future

    def state(self, params: StructuredOutputsParams | None) -> GrammarState | None:
        return GrammarState(self.start(params)) if params is not None else None

    def _compile(self, params: StructuredOutputsParams) -> Any:
        """The matcher, or None when it cannot be built (then the sequence may only end)."""
        import llguidance

        try:
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), to_grammar(params), log_level=0)
        except Exception as error:  # noqa: BLE001 - no tokenizer, or a spec the gateway let through
            log.warning("grammar_compile_failed", kind=params.kind, error=str(error))
            return None
        if matcher.is_error():
            log.warning("grammar_compile_failed", kind=params.kind, error=matcher.get_error())
        return matcher

    def _llg_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance.hf

                from pagoda.runtime.model_files import load_tokenizer

                self._tokenizer = llguidance.hf.from_tokenizer(
                    load_tokenizer(self._model), n_vocab=self._vocab_size, eos_token=self._eos)
            return self._tokenizer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One sequence's matcher, synced lazily with its token list (rolled back where the list no
    longer holds what it consumed: drafts a speculative step did not keep)."""

    __slots__ = ("_future", "_matcher", "_consumed")

    def __init__(self, future: Future) -> None:
        self._future = future
        self._matcher: Any = None
        self._consumed: list[int] = []  # the output tokens the matcher has consumed, in order

    def fork(self) -> GrammarState:
        """A fresh state for a forked sequence; it replays its own outputs on first use."""
        return GrammarState(self._future)

    def matcher(self, token_ids: Sequence[int], num_prompt_tokens: int) -> Any:
        """The matcher after every output token so far (waits for compilation the first time);
        None when the grammar could not be compiled."""
        if self._matcher is None:
            template = self._future.result()
            if template is None:
                return None
            self._matcher = template.deep_copy()
        outputs = token_ids[num_prompt_tokens:]
        consumed = self._consumed
        keep = len(consumed)
        if len(outputs) < keep or list(outputs[:keep]) != consumed:
            keep = next((i for i, (a, b) in enumerate(zip(outputs, consumed, strict=False)) if a != b),
                        min(len(outputs), len(consumed)))
            self._matcher.rollback(len(consumed) - keep)
            del consumed[keep:]
        if len(outputs) > keep:
            new = list(outputs[keep:])
            # a token the grammar refuses (only a draft can be one) stops the catch-up there
            consumed.extend(new[:self._matcher.try_consume_tokens(new)])
        return self._matcher


class GrammarMasks:
    """The next-token bitmasks [R, ceil(V/32)] int32 (CPU) of the rows that have a grammar.

    `apply` masks rows of the logits (one unpack on the device, O(R*V)). A greedy row need not be
    masked at all when its argmax is a token the grammar allows (one bit test): masking commutes
    with every other logits adjustment (they never raise a -inf), so the masked argmax is the same
    token. The sampler masks random rows before drawing and greedy rows only when refused.
    """

    def __init__(self, rows: Sequence[Any], eos_token_ids: Sequence[int], vocab: int) -> None:
        import llguidance.torch as llg_torch

        self.index = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
        self.position = {i: j for j, i in enumerate(self.index)}  # row -> its bitmask row
        self.vocab = vocab
        self.bitmask = torch.empty(len(self.index), (vocab + 31) // 32, dtype=torch.int32)  # [R, W]
        for j, i in enumerate(self.index):
            row = rows[i]
            matcher = row.grammar.matcher(row.token_ids, row.num_prompt_tokens)
            if matcher is None or matcher.is_error():  # only EOS, so the sequence ends
                self.bitmask[j] = 0
                for eos in eos_token_ids:
                    if eos < vocab:
                        self.bitmask[j, eos // 32] |= _bit(eos % 32)
            else:
                llg_torch.fill_next_token_bitmask(matcher, self.bitmask, j)

    def apply(self, logits: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """Mask `rows` (default: every constrained row) of logits [N, V] in place."""
        rows = self.index if rows is None else rows
        if not rows:
            return
        device = logits.device
        bits = self.bitmask if len(rows) == len(self.index) else self.bitmask[[self.position[i] for i in rows]]
        blocked = _blocked_bits(device)[bits.to(device).view(torch.uint8).int()]  # [R, 4W, 8]
        blocked = blocked.reshape(len(rows), -1)[:, :self.vocab]  # [R, V] bool: True = refused
        if len(rows) == logits.shape[0]:  # every row: in place, no gather/scatter
            logits.masked_fill_(blocked, float("-inf"))
            return
        rows_idx = torch.tensor(rows, dtype=torch.long, device=device)
        logits[rows_idx] = logits[rows_idx].masked_fill_(blocked, float("-inf"))

    def refused(self, row: int, token: int) -> bool:
        """Whether constrained `row`'s grammar refuses `token` (a bit test on the CPU mask)."""
        word = int(self.bitmask[self.position[row], token >> 5])
        return not (word >> (token & 31)) & 1


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[Any], eos_token_ids: Sequence[int]) -> None:
    """Mask every row that has a grammar (row.grammar) to the tokens it allows next; in place on
    logits [N, V]. A matcher in an error state allows only EOS, so the sequence ends."""
    if any(getattr(r, "grammar", None) is not None for r in rows):
        GrammarMasks(rows, eos_token_ids, logits.shape[1]).apply(logits)


_BLOCKED_BITS: dict[torch.device, torch.Tensor] = {}


def _blocked_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: for each byte value, which of its 8 bits (little-endian) are 0. Indexing it
    with the bitmask's bytes unpacks 32 tokens per int32 word in one gather."""
    table = _BLOCKED_BITS.get(device)
    if table is None:
        table = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 0).to(device)
        _BLOCKED_BITS[device] = table
    return table


def _bit(position: int) -> int:
    """The int32 value with bit `position` set (bit 31 is the sign bit)."""
    return -(2**31) if position == 31 else 1 << position
