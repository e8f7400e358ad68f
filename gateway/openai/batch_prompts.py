"""Several prompts in one /v1/completions call (vLLM and OpenAI accept a list of them).

Each prompt becomes its own upstream request (id `<id>-<k>`), so the scheduler batches them like
any others; their steps are merged into one stream whose choice indices are OpenAI's:
index = prompt_index * n + sequence_index. Usage is summed over the prompts. A tenant's lease is
taken once for the whole call, reserving what every prompt may use.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from gateway.batch_admission import MAX_PROMPTS
from gateway.generation import GenerationStep, Usage
from pagoda.contract.errors import InvalidRequestError


def split_prompts(prompt: str | list) -> list[str | list[int]]:
    """A string, a token id list, or a list of either -> the list of prompts."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return list(prompt)
    return [prompt]


async def merge_steps(streams: Sequence[AsyncIterator[GenerationStep]], n: int
                      ) -> AsyncIterator[GenerationStep]:
    """One stream of steps from one per prompt: chunk indices renumbered prompt_index * n + i,
    usage (and progress) summed; the last step carries the total once every prompt finished, and the
    timings of the prompt that took longest.
    The first error of any stream is raised; leaving early cancels every stream (aborts upstream)."""
    if len(streams) == 1:
        async for step in streams[0]:
            yield step
        return
    queue: asyncio.Queue[tuple[int, GenerationStep | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, steps: AsyncIterator[GenerationStep]) -> None:
        try:
            async for step in steps:
                await queue.put((k, step))
            await queue.put((k, None))
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((k, error))
        finally:
            await steps.aclose()

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    progress: list[Usage | None] = [None] * len(streams)
    finals: list[Usage | None] = [None] * len(streams)
    timings: list = [None] * len(streams)
    try:
        running = len(streams)
        while running:
            k, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            for chunk in item.chunks:
                chunk.index += k * n
            progress[k] = item.progress or progress[k]
            finals[k] = item.usage or finals[k]
            timings[k] = item.timings or timings[k]
            done = all(u is not None for u in finals)
            total = _sum(finals) if done else None
            # The batch's timings: its slowest prompt's (timings do not add up across prompts).
            slowest = max((t for t in timings if t is not None), key=lambda t: t.total_seconds,
                          default=None) if done else None
            yield GenerationStep(item.chunks, usage=total, progress=total or _sum(progress), timings=slowest)
            if done:
                return
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sum(usages: Sequence[Usage | None]) -> Usage:
    present = [u for u in usages if u is not None]
    return Usage(sum(u.prompt_tokens for u in present), sum(u.completion_tokens for u in present),
                 sum(u.cached_tokens for u in present))
