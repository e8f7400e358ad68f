"""Anthropic's `thinking: {"type": "enabled", "budget_tokens": N}` on a reasoning model.

What is done, exactly: a reasoning model's thinking starts with its reply, so while its thinking
is open every output token is a thinking token. `within_budget` watches the steps (a parser of its
own reads their text) and, when N output tokens have come and the end tag has not, ends the reply
there: the step that reached N becomes the last, finished "length" (stop_reason "max_tokens":
the reply was cut, and holds only thinking), with the usage so far; closing the steps cancels
the request upstream. A step carries one token per sequence unless speculative decoding is on,
so the thinking holds exactly N tokens, or up to a step's worth more with speculation. The
reply is not continued past a forced end tag (that would be a second request); a thinking that
closes within the budget is untouched, and max_tokens bounds thinking and answer together.

`thinking_tokens` gives Usage.output_tokens_details: the thinking's tokens, its tags included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

from gateway.anthropic.protocol import OutputTokensDetails
from gateway.generation import GenerationStep
from gateway.openai.reasoning_parsers import ReasoningParser
from gateway.tokenizer import Tokenizer


async def within_budget(steps: AsyncIterator[GenerationStep], reasoner: type[ReasoningParser],
                        budget: int) -> AsyncIterator[GenerationStep]:
    """`steps` (one sequence), ended at the step where `budget` tokens of open thinking are reached."""
    watcher, used = reasoner(), 0
    close = getattr(steps, "aclose", None)
    try:
        async for step in steps:
            cut = None
            for chunk in step.chunks:
                watcher.feed(chunk.text)
                used += len(chunk.token_ids)
                if used >= budget and watcher.thinking and chunk.finish_reason is None:
                    cut = dataclasses.replace(chunk, finish_reason="length", stop_reason=None)
            if cut is not None:
                if close is not None:
                    await close()  # cancels the request upstream now, before the reply's end goes out
                yield GenerationStep([cut], usage=step.progress, progress=step.progress)
                return
            yield step
            if step.usage is not None:
                return
    finally:
        if close is not None:
            await close()  # idempotent: a client gone mid-reply cancels the request too


def thinking_tokens(reasoner: ReasoningParser | None, tokenizer: Tokenizer,
                    token_ids: Sequence[int]) -> OutputTokensDetails | None:
    if reasoner is None:
        return None
    return OutputTokensDetails(thinking_tokens=type(reasoner).count_reasoning_tokens(token_ids, tokenizer.decode))
