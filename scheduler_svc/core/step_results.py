"""The scheduler's results half: a step's sampled tokens (or a beam's candidates) applied to its
sequences, prefix blocks registered once their writing step reported, deltas out.

A mixin so scheduler.py stays about building plans; it uses the Scheduler's attributes.
"""

from __future__ import annotations

from pagoda.contract.step import StepResult
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.prompt_logprobs import attach_prompt_logprobs, fold_prompt_logprobs
from scheduler_svc.core.request import Request, SeqStatus


class StepResultsMixin:
    # -- results ------------------------------------------------------------------------------
    def update(self, result: StepResult) -> list[SequenceDelta]:
        """Apply one step's sampled tokens (steps in order); return the sequences' deltas."""
        if not self._inflight or self._inflight[0].step_id != result.step_id:
            expected = self._inflight[0].step_id if self._inflight else None
            raise ValueError(f"result for step {result.step_id}, expected step {expected}")
        step = self._inflight.popleft()
        kv, bs = self._kv, self.config.block_size
        if kv.index is not None:
            for seq, generation, num_computed in step.computed:
                if num_computed // bs > seq.num_registered_blocks and seq.generation == generation \
                        and seq.status is SeqStatus.RUNNING:
                    kv.register_computed(seq, num_computed)
        self._observe_step_cost(step.num_tokens, result.forward_seconds + result.sample_seconds)
        if result.prompt_logprobs:
            fold_prompt_logprobs(self._live, result.prompt_logprobs, self._prompt_logprobs_ready)
        deltas = self._append_tokens(result)
        if self._prompt_logprobs_ready:
            attach_prompt_logprobs(deltas, self._prompt_logprobs_ready, self._requests)
        if step.spec:
            self._settle_drafts(step.spec, result.request_ids)
        if self._probe is not None:
            self._note_probe_reported(step.step_id, result)
        kv.step_reported(step.step_id)
        return deltas

    def _append_tokens(self, result: StepResult) -> list[SequenceDelta]:
        deltas: list[SequenceDelta] = []
        live, eos = self._live, self.config.eos_token_ids
        token_ids, logprobs = result.token_ids, result.logprobs
        num_accepted, previous = 0, None
        beam_requests: list[Request] = []
        for i, seq_id in enumerate(result.request_ids):
            seq = live.get(seq_id)
            if seq is None:  # finished (e.g. EOS seen while its next token was in flight): discard
                continue
            token = token_ids[i]
            if seq_id != previous:  # the next entries of a drafted sequence are its other tokens
                seq.num_placeholders -= 1
                previous = seq_id
            req = seq.request
            if req.beam is not None:  # candidates, not a token: ranked once the group reported
                if seq.status is SeqStatus.RUNNING:  # (a preempted beam recomputes them)
                    req.beam.candidates[seq.seq_index] = logprobs[i].top
                    beam_requests.append(req)
                continue
            tokens = seq.token_ids
            tokens.append(token)
            num_accepted += 1
            delta = SequenceDelta(req.request_id, seq.seq_index, [token],
                                  [logprobs[i]] if logprobs and logprobs[i] is not None else [],
                                  None, req.num_prompt_tokens, req.num_cached_tokens)
            # stop_reason() can only answer for a stop token or at max_tokens: test that first.
            if token in req.stop_token_set or len(tokens) >= req.max_num_tokens:
                reason = seq.stop_reason(token, eos)
                if reason is not None:
                    delta.finish_reason = reason
                    self._finish(seq)
            deltas.append(delta)
        for req in dict.fromkeys(beam_requests):
            if req.request_id in self._requests:
                self._advance_beams(req, deltas)
        self.generation_tokens += num_accepted
        return deltas
