"""The fake worker's draft model: proposals from the fake sampler, KV in the fake's one slot array.

It follows the plan's `ModelDraft` entries as the real draft model does (worker_svc/draft_model.py):
the draft table becomes table[:table_start] + block_ids, the draft's slots of positions
[0, num_computed) must hold the sequence's tokens (a block the scheduler reused while the draft
still needed it shows up here), and positions [num_computed, c + k) are written, in the same slot
array as the target's KV: draft and target blocks come from one pool. It proposes the token the
fake sampler would draw three times out of four and another one otherwise, so that drafts are
both accepted and rejected (and the target's verification keeps the stream exact either way).
"""

from __future__ import annotations

from pagoda.contract.ids import RequestId
from pagoda.contract.step import ModelDraft
from worker_svc.fake.mixing import mix as _mix


class FakeDraftModel:
    def __init__(self, worker) -> None:
        self.worker = worker  # the FakeWorker: its slot array, residents, sampler
        self.tables: dict[RequestId, list[int]] = {}

    def drop(self, rid: RequestId) -> None:
        self.tables.pop(rid, None)

    def propose(self, drafts: list[ModelDraft], counts: dict[RequestId, int]) -> tuple[dict[RequestId, list[int]], set[int]]:
        """Each entry's proposals, and the slots written (the target's forward must not write them too)."""
        w, bs = self.worker, self.worker.block_size
        proposals: dict[RequestId, list[int]] = {}
        written: set[int] = set()
        for d in drafts:
            state = w.resident[d.request_id]
            assert counts[d.request_id] == 1 + d.num_drafts, f"{d.request_id!r}: count != 1 + {d.num_drafts}"
            table = self.tables.setdefault(d.request_id, [])
            assert d.table_start <= len(table), f"draft table update at {d.table_start} of {len(table)}"
            w._check_blocks(d.block_ids)
            del table[d.table_start:]
            table.extend(d.block_ids)
            last = state.num_computed  # the position of its last token
            assert d.num_computed <= last and len(state.token_ids) == last + 1, "draft ahead of the target"
            assert len(table) * bs >= last + d.num_drafts, f"{d.request_id!r}: draft table too short"
            for pos in range(d.num_computed):  # what the draft's attention reads
                slot = table[pos // bs] * bs + pos % bs
                assert w.kv[slot] == state.token_ids[pos], \
                    f"{d.request_id!r} draft position {pos}: slot {slot} holds {w.kv[slot]}, not {state.token_ids[pos]}"
            tokens, history = list(state.token_ids), state.history
            out = len(tokens) - state.num_prompt_tokens
            for j in range(d.num_drafts):
                true = w.sampler.sample(history, state.seq_index, out + j, state.sampling)
                token = true if _mix(history ^ 0x5BD1) % 4 else (true + 1) % w.sampler.vocab_size
                tokens.append(token)
                history = _mix(history ^ (token + 1))
            for pos in range(d.num_computed, last + d.num_drafts):  # inputs: kept tokens, then proposals
                slot = table[pos // bs] * bs + pos % bs
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                w.kv[slot] = tokens[pos]
            proposals[d.request_id] = tokens[last + 1:]
        return proposals, written
