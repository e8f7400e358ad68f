"""Prompt logprobs on the OpenAI routes: vLLM's `prompt_logprobs` field, and `echo` with `logprobs`.

The engine hands a request's prompt logprobs over once (prompt tokens 1..; nothing predicts the
first), on each sequence's first chunk (gateway/generation.py). Two renderings:
- vLLM's `prompt_logprobs` (completions: on each choice; chat: at the top level): per prompt
  token, None for the first, then {token id: {logprob, rank, decoded_token}} holding the prompt
  token first and the top k;
- completions `echo: true` with `logprobs: k` (OpenAI's legacy scoring idiom): the choice's
  `logprobs` covers the echoed prompt's tokens before the completion's, the first with null
  `token_logprobs` / `top_logprobs` (as OpenAI and vLLM do), each other with its logprob and a
  top map of the k best plus the token itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.openai.responses import CompletionLogprobs, PromptLogprob, PromptLogprobs
from gateway.tokenizer import Tokenizer
from pagoda.v1 import common_pb2


def vllm_prompt_logprobs(tokenizer: Tokenizer, prompt_ids: Sequence[int],
                         logprobs: Sequence[common_pb2.TokenLogprobs]) -> PromptLogprobs:
    out: PromptLogprobs = [None]
    for token_id, lp in zip(prompt_ids[1:], logprobs, strict=False):
        entry = {str(token_id): PromptLogprob(logprob=lp.logprob,
                                              rank=lp.rank if lp.HasField("rank") else None,
                                              decoded_token=tokenizer.token_text(token_id))}
        for rank, top in enumerate(lp.top, start=1):
            entry.setdefault(str(top.token_id), PromptLogprob(
                logprob=top.logprob, rank=rank, decoded_token=tokenizer.token_text(top.token_id)))
        out.append(entry)
    return out + [None] * (len(prompt_ids) - len(out))  # (never short: the engine sends them all)


def add_echo_logprobs(out: CompletionLogprobs, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                      logprobs: Sequence[common_pb2.TokenLogprobs], top_k: int, names: Tokenizer | None = None) -> None:
    """Append the echoed prompt's entries to `out`; their text offsets count from 0. `names` names
    the tokens (Tokenizer.logprob_names); the offsets stay those of the text."""
    names = names or tokenizer
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        token = names.token_text(token_id)
        lp = logprobs[i - 1] if 0 < i <= len(logprobs) else None
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(tokenizer.token_text(token_id))
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        top = {names.token_text(t.token_id): t.logprob for t in lp.top[:top_k]}
        top.setdefault(token, lp.logprob)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(top)
