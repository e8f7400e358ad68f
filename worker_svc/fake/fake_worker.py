"""A fake worker that applies step plans exactly as a real one must, without a model.

It keeps the resident state a worker keeps (token ids, num_computed, block table), rejects plans
that do not apply cleanly (AssertionError), "samples" deterministically from each sequence's token
history and seq_index, and models the KV cache as one int per slot: the token whose KV was written
there. Every step checks that each attended position holds the right token, which catches wrong
prefix hits, bad copy-on-write, bad swaps and stale or reused blocks. Its host pool (swap
preemption) is modelled the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import PromptLogprobs, StepPlan, StepResult, TokenLogprobs
from worker_svc.fake.fake_draft import FakeDraftModel
from worker_svc.fake.mixing import mix as _mix


def history_hash(token_ids: list[int]) -> int:
    h = 0
    for token in token_ids:
        h = _mix(h ^ (token + 1))
    return h


def fake_prompt_logprob(prompt: list[int], index: int, top_k: int) -> TokenLogprobs:
    """Prompt token `index`'s (>= 1) fake logprob: a function of it, its position and the token
    before it; its top k: itself, then the next ids."""
    token = prompt[index]
    logprob = -((token * 31 + index * 7 + prompt[index - 1]) % 1000) / 100
    return TokenLogprobs(logprob, [(token + j, logprob - j) for j in range(top_k)], rank=1)


@dataclass(frozen=True, slots=True)
class FakeSampler:
    """next token = f(hash of the whole token history, seq_index): a pure function of the stream."""

    vocab_size: int = 1000
    eos_token_id: int | None = None
    eos_probability: float = 0.0

    def sample(self, history: int, seq_index: int, num_outputs: int, sampling: SamplingParams) -> int:
        x = _mix(history ^ _mix(seq_index + 0x51ED))
        banned = set(sampling.stop_token_ids) if num_outputs < sampling.min_tokens else set()
        if self.eos_token_id is not None:
            if x / 2.0**64 < self.eos_probability and num_outputs >= sampling.min_tokens:
                return self.eos_token_id
            banned.add(self.eos_token_id)  # EOS only through eos_probability
        if len(banned) >= self.vocab_size and banned.issuperset(range(self.vocab_size)):
            # Looping below would never end: say which request asked for the impossible.
            raise ValueError(f"every token of the fake vocabulary ({self.vocab_size}) is banned: "
                             f"EOS and stop ids {sorted(banned)} before min_tokens")
        token = _mix(x) % self.vocab_size
        while token in banned:
            token = (token + 1) % self.vocab_size
        return token

    def beam_candidates(self, token_ids: list[int], count: int) -> list[tuple[int, float]]:
        """A beam's candidates after `token_ids`: `count` distinct tokens (at most the vocabulary)
        with made-up logprobs < 0, best first; a pure function of the history."""
        top: list[tuple[int, float]] = []
        seen: set[int] = set()
        x = history_hash(token_ids)
        while len(top) < min(count, self.vocab_size):
            x = _mix(x)
            token = x % self.vocab_size
            if token not in seen:
                seen.add(token)
                top.append((token, -0.5 * len(top) - (x >> 40) / 2.0**24))
        top.sort(key=lambda c: -c[1])
        return top

    def reference_stream(self, prompt: list[int], seq_index: int, sampling: SamplingParams,
                         max_tokens: int, stop_ids: set[int]) -> list[int]:
        """What a sequence must produce whatever the scheduling: sample until a stop condition."""
        tokens, out, h = list(prompt), [], history_hash(prompt)
        while len(out) < max_tokens:
            token = self.sample(h, seq_index, len(out), sampling)
            out.append(token)
            tokens.append(token)
            h = _mix(h ^ (token + 1))
            if len(out) >= sampling.min_tokens and token in stop_ids:
                break
        return out


@dataclass(slots=True)
class _Resident:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_table: list[int]
    seq_index: int
    sampling: SamplingParams
    history: int  # history_hash(token_ids)


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, sampler: FakeSampler | None = None,
                 check_kv: bool = True, num_cpu_blocks: int = 0, sliding_window: int = 0,
                 disk: OrderedDict | None = None, migrations: dict | None = None) -> None:
        self.num_blocks, self.block_size, self.num_cpu_blocks = num_blocks, block_size, num_cpu_blocks
        # A model whose every layer has this window (0: none): attention reads, and so the KV
        # check covers, only positions inside it; the scheduler may have reused the blocks before.
        self.sliding_window = sliding_window
        self.host_kv = [-1] * (num_cpu_blocks * block_size)  # the host pool's slots, likewise
        # The disk tier's files: hash -> (slot tokens, DiskBlock), least recently used first
        self.disk: OrderedDict = OrderedDict() if disk is None else disk
        # Live migration's shared folder: migration id -> each exported block's slot tokens (two
        # fakes given one dict are two replicas' workers on one file system)
        self.migrations: dict = {} if migrations is None else migrations
        self.sampler = sampler or FakeSampler()
        self.check_kv = check_kv
        self.kv = [-1] * (num_blocks * block_size)  # token written in each slot, -1 = never
        self.resident: dict[RequestId, _Resident] = {}
        self.sampled: dict[RequestId, list[int]] = {}  # every token sampled per sequence id
        self.next_step_id = 1

        self.drafter = FakeDraftModel(self)  # draft-model speculation's plans (fake_draft.py)
        self._proposals: dict[RequestId, list[int]] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        assert plan.step_id == self.next_step_id, f"step {plan.step_id}, expected {self.next_step_id}"
        self.next_step_id += 1
        bs = self.block_size
        for export in plan.kv_exports:  # first of all, as the real worker: the drops come next
            assert export.snapshot or export.request_id in self.resident, f"export of {export.request_id!r}"
            self._check_blocks(export.block_ids)
            self.migrations[export.migration_id] = [self.kv[b * bs:(b + 1) * bs] for b in export.block_ids]
            if export.snapshot:  # a session save: the blocks hold exactly the tokens it names
                saved = [t for block in self.migrations[export.migration_id] for t in block]
                assert saved == list(export.token_ids), f"session save {export.migration_id}: KV of other tokens"
        self._apply_beam_updates(plan)  # before the drops, as the real worker: parents may go
        self._drop(plan)
        self._add_new(plan)
        self._apply_tables(plan)
        counts = {rid: plan.num_scheduled_tokens.get(rid, 1) for rid in self.resident}
        counts.update((new.request_id, new.num_scheduled_tokens) for new in plan.new_requests)
        for rid, drafts in plan.draft_token_ids.items():  # computed after the request's tokens
            assert counts[rid] == 1 + len(drafts), f"{rid!r}: drafts need a count of 1 + {len(drafts)}"
            self.resident[rid].token_ids.extend(drafts)
        self._proposals, written = self.drafter.propose(plan.model_drafts, counts)
        for rid, drafts in self._proposals.items():
            self.resident[rid].token_ids.extend(drafts)
        prompt_logprobs = self._prompt_logprobs(counts)  # before the step advances num_computed
        samplers = self._forward(counts, written)
        result = self._sample(plan, samplers)
        result.prompt_logprobs = prompt_logprobs
        return result

    def _prompt_logprobs(self, counts: dict[RequestId, int]) -> list[PromptLogprobs]:
        """As the real worker: a chunk computing positions [start, end) reports prompt tokens
        start+1 .. min(end, num_prompt - 1)."""
        reports = []
        for rid, count in counts.items():
            state = self.resident[rid]
            top_k = state.sampling.prompt_logprobs
            if top_k is None:
                continue
            start = state.num_computed
            end = min(start + count, state.num_prompt_tokens - 1)
            if end > start:
                reports.append(PromptLogprobs(rid, start + 1, [
                    fake_prompt_logprob(state.token_ids, i, top_k) for i in range(start + 1, end + 1)]))
        return reports

    def _apply_beam_updates(self, plan: StepPlan) -> None:
        parents = {u.parent_id: self.resident[u.parent_id] for u in plan.beam_updates}
        for update in plan.beam_updates:
            parent = parents[update.parent_id]
            assert parent.num_computed == len(parent.token_ids) - 1, "beam parent has not just sampled"
            tokens = [*parent.token_ids[:-1], update.token_id]
            current = self.resident.get(update.request_id)
            self.resident[update.request_id] = _Resident(
                tokens, parent.num_prompt_tokens, parent.num_computed, list(parent.block_table),
                current.seq_index if current else parent.seq_index, parent.sampling, history_hash(tokens))

    def _drop(self, plan: StepPlan) -> None:
        for rid in (*plan.finished_ids, *plan.preempted_ids):
            assert rid in self.resident, f"drop of {rid!r}, which is not resident"
            del self.resident[rid]
            self.drafter.drop(rid)
        for rid in plan.num_scheduled_tokens:
            assert rid in self.resident, f"num_scheduled_tokens for non-resident {rid!r}"

    def _add_new(self, plan: StepPlan) -> None:
        for new in plan.new_requests:
            assert new.request_id not in self.resident, f"{new.request_id!r} is already resident"
            assert 0 < new.num_prompt_tokens <= len(new.token_ids)
            self._check_blocks(new.block_ids)
            self.resident[new.request_id] = _Resident(
                list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens, list(new.block_ids),
                new.seq_index, new.sampling, history_hash(new.token_ids))

    def _apply_tables(self, plan: StepPlan) -> None:
        for update in plan.table_updates:
            state = self.resident.get(update.request_id)
            assert state is not None, f"table update for unknown {update.request_id!r}"
            assert 0 <= update.start <= len(state.block_table), "table update leaves a hole"
            self._check_blocks(update.block_ids)
            state.block_table[update.start:update.start + len(update.block_ids)] = update.block_ids
        bs = self.block_size
        self._disk_deletes_and_writes(plan)  # before the swap-outs refill the host slots, as the real worker
        for copy in plan.swap_out:  # first swap-outs, then swap-ins, then copies, as the real worker
            self._check_blocks([copy.src])
            assert 0 <= copy.dst < self.num_cpu_blocks, f"host block id {copy.dst} out of range"
            self.host_kv[copy.dst * bs:(copy.dst + 1) * bs] = self.kv[copy.src * bs:(copy.src + 1) * bs]
        for copy in plan.swap_in:
            assert 0 <= copy.src < self.num_cpu_blocks, f"host block id {copy.src} out of range"
            self._check_blocks([copy.dst])
            self.kv[copy.dst * bs:(copy.dst + 1) * bs] = self.host_kv[copy.src * bs:(copy.src + 1) * bs]
        for load in plan.disk_loads:  # after the swaps: the swap-out saved the block's old content
            assert load.block_hash in self.disk, f"disk load of {load.block_hash.hex()[:12]}, not on disk"
            self._check_blocks([load.dst])
            self.disk.move_to_end(load.block_hash)
            self.kv[load.dst * bs:(load.dst + 1) * bs] = self.disk[load.block_hash][0]
        for load in plan.kv_imports:  # with the disk loads, as the real worker
            # A snapshot stays (it may be restored again); a migration's folder is read once.
            files = self.migrations[load.migration_id] if load.snapshot else self.migrations.pop(load.migration_id)
            self._check_blocks(load.block_ids)
            for k, block in enumerate(load.block_ids):
                self.kv[block * bs:(block + 1) * bs] = files[load.first_block + k]
        for copy in plan.block_copies:  # before the forward, as the real worker does
            self._check_blocks([copy.src, copy.dst])
            self.kv[copy.dst * bs:(copy.dst + 1) * bs] = self.kv[copy.src * bs:(copy.src + 1) * bs]

    def _disk_deletes_and_writes(self, plan: StepPlan) -> None:
        """The disk tier: a file is the host slot's tokens, kept with its DiskBlock (`disk` outlives
        the worker: FakeStepRunner keeps it across resets, as files survive a restart)."""
        bs = self.block_size
        for block_hash in plan.disk_deletes:
            assert self.disk.pop(block_hash, None) is not None, "disk delete of a file not on disk"
        for write in plan.disk_writes:
            if write.from_device:
                self._check_blocks([write.src])
            else:
                assert 0 <= write.src < self.num_cpu_blocks, f"host block id {write.src} out of range"
            content = (self.kv if write.from_device else self.host_kv)[write.src * bs:(write.src + 1) * bs]
            assert content[0] != -1, f"disk write of host block {write.src}, never written"
            self.disk[write.block.block_hash] = (content, write.block)

    def _forward(self, counts: dict[RequestId, int], written: set[int]) -> list[RequestId]:
        """Write each scheduled token's KV, check what attention reads; return who samples.
        `written`: the slots the draft model wrote this step."""
        bs, kv = self.block_size, self.kv
        samplers = []
        for rid, count in counts.items():
            if count == 0:
                continue
            state = self.resident[rid]
            start, end = state.num_computed, state.num_computed + count
            assert end <= len(state.token_ids), f"{rid!r}: {count} tokens scheduled past its tokens"
            assert end <= len(state.block_table) * bs, f"{rid!r}: positions up to {end} exceed table"
            table = state.block_table
            for pos in range(start, end):
                slot = table[pos // bs] * bs + pos % bs
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                kv[slot] = state.token_ids[pos]
            if self.check_kv:
                self._check_attended(rid, state, start, end)
            state.num_computed = end
            if end == len(state.token_ids):
                samplers.append(rid)
        return samplers

    def _check_attended(self, rid: RequestId, state: _Resident, start: int, end: int) -> None:
        # Rows [start, end) read positions [0, end), or, under a window, > start - window.
        bs, table = self.block_size, state.block_table
        first = max(0, start - self.sliding_window + 1) if self.sliding_window else 0
        for pos in range(first, end):
            slot = table[pos // bs] * bs + pos % bs
            if self.kv[slot] != state.token_ids[pos]:
                raise AssertionError(f"{rid!r} position {pos}: slot {slot} holds {self.kv[slot]}, "
                                     f"expected token {state.token_ids[pos]}")

    def _sample(self, plan: StepPlan, samplers: list[RequestId]) -> StepResult:
        forks = {fork.parent_id: fork.child_ids for fork in plan.forks}
        result = StepResult(plan.step_id)
        for rid in samplers:
            drafts = plan.draft_token_ids.get(rid) or self._proposals.get(rid)
            if drafts:
                self._verify_drafts(rid, drafts, result)
                continue
            state = self.resident[rid]
            for i, child in enumerate(forks.pop(rid, ()), start=1):  # children copy pre-sample state
                assert child not in self.resident, f"fork child {child!r} exists"
                self.resident[child] = _Resident(list(state.token_ids), state.num_prompt_tokens,
                                                 state.num_computed, list(state.block_table), i,
                                                 state.sampling, state.history)
                self._sample_one(child, result)
            self._sample_one(rid, result)
        assert not forks, f"forks of requests that did not sample: {list(forks)}"
        if any(self.resident[rid].sampling.beam_width for rid in result.request_ids):
            result.logprobs = [self._beam_candidates(rid) for rid in result.request_ids]
        return result

    def _beam_candidates(self, rid: RequestId) -> TokenLogprobs | None:
        state = self.resident[rid]
        sampling = state.sampling
        if not sampling.beam_width:
            return None
        count = 2 * sampling.beam_width + len(sampling.stop_token_ids) + 1
        top = self.sampler.beam_candidates(state.token_ids[:-1], count)  # before the sampled token
        return TokenLogprobs(top[0][1], top)

    def _verify_drafts(self, rid: RequestId, drafts: list[int], result: StepResult) -> None:
        """Greedy verification: keep the drafts the sampler would have produced, then sample one.
        The rejected drafts' tokens and slots are rolled back (the table cut as the scheduler cuts)."""
        state = self.resident[rid]
        del state.token_ids[len(state.token_ids) - len(drafts):]
        state.num_computed -= len(drafts) + 1  # the last token's position: verification starts there
        for token in drafts:
            if self.sampler.sample(state.history, state.seq_index, len(state.token_ids) - state.num_prompt_tokens,
                                   state.sampling) != token:
                break
            state.num_computed += 1
            self._append(rid, token, result)
        state.num_computed += 1
        del state.block_table[state.num_computed // self.block_size + 1:]
        self._sample_one(rid, result)

    def _sample_one(self, rid: RequestId, result: StepResult) -> None:
        state = self.resident[rid]
        token = self.sampler.sample(state.history, state.seq_index,
                                    len(state.token_ids) - state.num_prompt_tokens, state.sampling)
        self._append(rid, token, result)

    def _append(self, rid: RequestId, token: int, result: StepResult) -> None:
        state = self.resident[rid]
        state.token_ids.append(token)
        state.history = _mix(state.history ^ (token + 1))
        self.sampled.setdefault(rid, []).append(token)
        result.request_ids.append(rid)
        result.token_ids.append(token)

    def _check_blocks(self, block_ids: list[int]) -> None:
        for block in block_ids:
            assert 0 <= block < self.num_blocks, f"block id {block} out of range"
