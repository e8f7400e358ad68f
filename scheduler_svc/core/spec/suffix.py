"""Suffix decoding (Arctic Inference's, vLLM's "suffix" method): drafts from suffix trees over the
sequence's own prompt + output and over the outputs of recently finished requests. Pure Python.

The tree (SuffixTree) is a suffix trie cut at `depth` tokens: every substring of what was inserted,
up to `depth` long, is a path from the root, and each node counts how often its string occurred
(`count`) and how often it was followed by a next token (`total`, the sum of its children's counts),
so child.count / node.total is the empirical probability of that next token after that string.
A cut trie rather than a compact suffix tree, because it is the simple one to keep fast in Python:
appending a token touches at most `depth` nodes (the ones of the sequence's current suffixes, kept
in an `active` list), and so does following a sequence as it grows through a tree it is not in.

Proposing for a sequence whose last tokens are s: for each tree (its own, and the cache's), for
every length m of a suffix of s found in the tree (each m from 1 to the longest), walk down from the
node of s[-m:] taking the most frequent child, the path's probability the product of the child
probabilities; stop when it falls below `min_token_prob`, or at min(limit, factor * m) tokens: a
longer match earns a longer draft. Score a draft by the sum of its path probabilities (its expected
accepted tokens); the best-scoring draft over all m and both trees wins (ties: the longer match,
then the sequence's own tree). A sequence's own tree counts its current suffixes too, but as they
have no next token yet they add to `count`, never to `total`: only earlier occurrences predict.

The cache (OutputCache) holds the outputs of the last finished sequences, one tree for all of them:
bounded by `max_cached_requests` and by `max_cached_tokens` (its tree has at most depth nodes a
token); past either, the sequence that finished longest ago is evicted (its counts subtracted,
nodes at zero dropped). A sequence's own tree lives while it runs and is dropped when it ends.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pagoda.contract.ids import RequestId
from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.request import Sequence
from scheduler_svc.core.spec.ngram import Speculator


class _Node:
    __slots__ = ("children", "count", "total")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0  # occurrences of this node's string
        self.total = 0  # occurrences followed by a next token (the children's counts summed)


class SuffixTree:
    """A suffix trie cut at `depth` tokens. An `active` list is the nodes of one sequence's current
    suffixes found in the tree: active[k] is the node of its last k tokens (active[0] the root),
    k < depth; a suffix found means every shorter one is too, so the list has no gaps."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Insert `token` after the suffixes in `active` (the sequence being inserted): each gains
        it as a next token. Returns the new active list."""
        new = [self.root]
        keep = self.depth - 1  # a node at `depth` still counts next tokens; it is never extended
        for node in active:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            node.total += 1
            if len(new) <= keep:
                new.append(child)
        return new

    def follow(self, active: list[_Node], token: int) -> list[_Node]:
        """`extend` for a sequence that is not in this tree: the suffixes still found, nothing counted."""
        new = [self.root]
        keep = self.depth - 1
        for node in active:
            child = node.children.get(token)
            if child is None or len(new) > keep:
                break  # not found: no longer suffix is either
            new.append(child)
        return new

    def insert(self, tokens: list[int] | tuple[int, ...]) -> None:
        active = [self.root]
        for token in tokens:
            active = self.extend(active, token)

    def remove(self, tokens: list[int] | tuple[int, ...]) -> None:
        """Undo `insert(tokens)`: the same paths (every start, up to depth long), counts subtracted."""
        depth = self.depth
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + depth]:
                child = node.children[token]
                child.count -= 1
                node.total -= 1
                if not child.count:
                    del node.children[token]
                node = child


def speculate(active: list[_Node], limit: int, factor: float, min_prob: float) -> tuple[list[int], float]:
    """The best-scoring draft (at most `limit` tokens) from any suffix in `active`, and its score."""
    best: list[int] = []
    best_score = 0.0
    for m in range(len(active) - 1, 0, -1):  # longest match first: it keeps a tie
        node = active[m]
        if not node.total:
            continue
        cap = min(limit, int(m * factor + 1e-6))
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < cap and node.total:
            children = node.children
            token = max(children, key=lambda t: children[t].count)  # ties: the first seen
            child = children[token]
            prob *= child.count / node.total
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            node = child
        if score > best_score:
            best, best_score = draft, score
    return best, best_score


class OutputCache:
    """The outputs of the last finished sequences in one SuffixTree, bounded by requests and tokens;
    the one that finished longest ago goes first. `version` changes whenever the tree does."""

    def __init__(self, depth: int, max_requests: int, max_tokens: int) -> None:
        self.tree = SuffixTree(depth)
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._outputs: OrderedDict[RequestId, tuple[int, ...]] = OrderedDict()
        self.num_tokens = 0
        self.version = 0

    def __len__(self) -> int:
        return len(self._outputs)

    def keys(self) -> list[RequestId]:
        return list(self._outputs)

    def add(self, key: RequestId, tokens: tuple[int, ...]) -> None:
        if key in self._outputs:  # an id used again: its newest output replaces the old one
            self._evict(key)
        if not tokens or len(tokens) > self.max_tokens or self.max_requests == 0:
            return
        while self._outputs and (len(self._outputs) >= self.max_requests
                                 or self.num_tokens + len(tokens) > self.max_tokens):
            self._evict(next(iter(self._outputs)))
        self.tree.insert(tokens)
        self._outputs[key] = tokens
        self.num_tokens += len(tokens)
        self.version += 1

    def _evict(self, key: RequestId) -> None:
        tokens = self._outputs.pop(key)
        self.tree.remove(tokens)
        self.num_tokens -= len(tokens)
        self.version += 1


@dataclass(slots=True)
class _SeqState:
    """One running sequence's own tree (its tokens inserted up to `inserted`) and where it stands
    in the cache's tree (followed up to `followed`, valid while the cache is at `version`)."""

    tree: SuffixTree
    active: list[_Node]
    inserted: int = 0
    cache_active: list[_Node] = field(default_factory=list)
    followed: int = 0
    version: int = -1


class SuffixSpeculator(Speculator):
    def __init__(self, config: SpeculativeConfig, kv: KVCacheManager, threshold: int) -> None:
        super().__init__(config, kv, threshold)
        depth = config.suffix_decoding_max_tree_depth
        self.cache = OutputCache(depth, config.suffix_decoding_max_cached_requests,
                                 config.suffix_decoding_max_cached_tokens)
        self._seqs: dict[RequestId, _SeqState] = {}

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        tokens = seq.token_ids
        state = self._seqs.get(seq.seq_id)
        if state is None or len(tokens) < state.inserted:  # (tokens only grow; rebuilt if not)
            tree = SuffixTree(self.config.suffix_decoding_max_tree_depth)
            state = self._seqs[seq.seq_id] = _SeqState(tree, [tree.root])
        tree, active = state.tree, state.active
        for token in tokens[state.inserted:]:
            active = tree.extend(active, token)
        state.active, state.inserted = active, len(tokens)
        cache = self.cache
        if state.version != cache.version:  # the cache changed: find the suffixes in it afresh
            state.cache_active, state.followed, state.version = [cache.tree.root], 0, cache.version
        cache_active, followed = state.cache_active, state.followed
        window = len(tokens) - (tree.depth - 1)  # a suffix found is shorter than depth
        if followed < window:  # many new tokens (a fresh start): only the last depth - 1 matter
            cache_active, followed = [cache.tree.root], window
        for token in tokens[followed:]:
            cache_active = cache.tree.follow(cache_active, token)
        state.cache_active, state.followed = cache_active, len(tokens)
        if limit <= 0:
            return []
        spec = self.config
        factor, min_prob = spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob
        own, own_score = speculate(active, limit, factor, min_prob)
        cached, cached_score = speculate(cache_active, limit, factor, min_prob)
        return cached if cached_score > own_score else own

    def finished(self, seq: Sequence) -> None:
        self._seqs.pop(seq.seq_id, None)
        req = seq.request
        if req.beam is None:  # a beam's tokens are candidates re-pointed at will: not an output
            self.cache.add(seq.seq_id, tuple(seq.token_ids[req.num_prompt_tokens:]))

    @property
    def num_tracked(self) -> int:
        """Sequences with a tree of their own (the running ones that drafted): for tests."""
        return len(self._seqs)
