"""Prompt lookup over the batch: drafts from what the other running sequences have written.

Why: sequences that run side by side often write the same text: forks of one prompt (n > 1),
requests filling one template, agents quoting one tool result, and (the forced copy task of issue
33, at batch 8) eight answers that, past the passage they copy, go on into the same made-up turn
of a chat. A sequence's own prompt and output do not hold that text until it has written it once;
a batch-mate that got there first does. Arctic Inference's suffix decoding drafts from the running
requests' outputs for the same reason.

The index maps every n-gram (n = `prompt_lookup_max`) of each running sequence's output, its last
`window` tokens, to where it ends, one entry per sequence (its latest). Indexing costs O(new
tokens) a step, a lookup one dict probe and at most `MAX_CANDIDATES` comparisons; a sequence's
entries are dropped when it ends. Only a batch-mate of the same tenant and cache salt is a source: how fast a
request decodes would otherwise tell its tenant what another tenant's answers say (a timing side
channel; the prefix cache salts its hashes for the same reason). A candidate's match is counted back as in
`propose_ngram_matched`, and its drafts are cut to it; the caller takes them only over a longer
match of the sequence's own.
"""

from __future__ import annotations

from itertools import islice

from pagoda.contract.ids import RequestId
from scheduler_svc.core.request import Request, Sequence

MAX_CANDIDATES = 8  # batch-mates compared per lookup: bounds its cost in a large batch


class BatchLookup:
    def __init__(self, n: int, window: int = 512) -> None:
        self.n = n
        self.window = window
        self._where: dict[tuple[int, ...], dict[RequestId, int]] = {}  # n-gram -> {seq: its end}
        self._seqs: dict[RequestId, Sequence] = {}
        self._next_end: dict[RequestId, int] = {}  # the first n-gram end not indexed yet

    def _first_end(self, seq: Sequence) -> int:
        return seq.request.num_prompt_tokens + self.n  # n-grams wholly inside the output

    def index(self, seq: Sequence) -> None:
        """Index `seq`'s output tokens written since the last call."""
        tokens, n, sid = seq.token_ids, self.n, seq.seq_id
        first = self._first_end(seq)
        start = max(self._next_end.get(sid, first), first)
        self._seqs[sid] = seq
        for end in range(start, len(tokens) + 1):
            self._where.setdefault(tuple(tokens[end - n:end]), {})[sid] = end
            if end - self.window >= first:
                self._forget(seq, end - self.window)
        self._next_end[sid] = max(start, len(tokens) + 1)

    def _forget(self, seq: Sequence, end: int) -> None:
        key = tuple(seq.token_ids[end - self.n:end])
        ends = self._where.get(key)
        if ends is not None and ends.get(seq.seq_id) == end:
            del ends[seq.seq_id]
            if not ends:
                del self._where[key]

    def drop(self, seq: Sequence) -> None:
        """`seq` ended: its entries go."""
        sid = seq.seq_id
        if self._seqs.pop(sid, None) is None:
            return
        stop = self._next_end.pop(sid)
        for end in range(max(self._first_end(seq), stop - self.window), stop):
            self._forget(seq, end)

    def lookup(self, seq: Sequence, limit: int) -> tuple[list[int], int]:
        """(drafts, matched): up to `limit` tokens that followed `seq`'s last n tokens in another
        running sequence's output, the one whose match counted back is longest, cut to that
        match; ([], 0) when none."""
        tokens, n = seq.token_ids, self.n
        if limit <= 0 or len(tokens) < n:
            return [], 0
        ends = self._where.get(tuple(tokens[-n:]))
        best: tuple[list[int], int] = ([], 0)
        if not ends:
            return best
        length = len(tokens)
        for sid, end in islice(ends.items(), MAX_CANDIDATES + 1):
            other = self._seqs[sid].token_ids
            if sid == seq.seq_id or end >= len(other) or not _may_share(self._seqs[sid].request, seq.request):
                continue  # its own tail, nothing follows yet, or text it may not see
            matched = n
            while matched < limit and end - matched > 0 and length - matched > 0 \
                    and other[end - matched - 1] == tokens[length - matched - 1]:
                matched += 1
            if matched > best[1]:
                best = (other[end:end + min(limit, matched)], matched)
        return best


def _may_share(a: Request, b: Request) -> bool:
    """Whether one request's output may draft for the other: the same cache salt (the prefix
    cache's isolation; the gateway folds a tenant's salt into it) and the same tenant (the core's
    own callers may set a tenant without a salt)."""
    return a.cache_salt == b.cache_salt and a.tenant == b.tenant
