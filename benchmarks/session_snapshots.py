"""Session save / restore: a session's next turn after a restart, restored from its snapshot or recomputed.

    python -m benchmarks.session_snapshots [--model models/smollm2-135m-instruct] [--history 2000]
        [--reps 1] [--out benchmarks/results/session_snapshots.json]

Offline, through `LLM` (fp32, CPU) and its scheduler and runner, as the services drive them: a
session's first turn (`--history` tokens, 8 generated, `session_id` set), then its lease saved into
`--kv-snapshot-dir` (a temporary directory: the save's step timed). The LLM is closed and a new one
started on the folder: the snapshot is read and verified (Worker.ReadSnapshot's listing), restored
(its one-token request, which loads the files), and the session's next turn (history + reply + 3 new
tokens, 1 output token) runs; against the same turn on a new LLM without the snapshot (recompute).
Times exclude model loading and a first 8-token warm-up request. Prints the figures and writes JSON.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
import time

from benchmarks.result_file import write_result
from pagoda import LLM
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from scheduler_svc.core import EngineRequest
from scheduler_svc.core.request import KvHandoff
from scheduler_svc.core.tiers.snapshots import snapshot_name

NAME = snapshot_name(None, "bench")


def make_llm(model: str, num_blocks: int, folder: str) -> LLM:
    return LLM(model=model, dtype="float32", device="cpu", seed=0, num_gpu_blocks_override=num_blocks,
               kv_snapshot_dir=folder)


def run(llm: LLM, rid: str, prompt, max_tokens: int, **fields) -> tuple[float, list[int], int]:
    """(seconds, tokens, cached prompt tokens) of one request run to its end."""
    started = time.perf_counter()
    llm.scheduler.add_request(EngineRequest(RequestId(rid), tuple(prompt),
                                            SamplingParams(max_tokens=max_tokens, temperature=0.0), **fields))
    tokens: list[int] = []
    cached = 0
    while llm.scheduler.has_unfinished_requests():
        for delta in llm.scheduler.update(llm.runner.execute(llm.scheduler.schedule())):
            tokens += delta.new_token_ids
            if delta.finish_reason is not None:
                cached = delta.num_cached_tokens
    return time.perf_counter() - started, tokens, cached


def one_rep(args: argparse.Namespace, rng: random.Random, folder: str) -> dict:
    history = [rng.randrange(10, 40000) for _ in range(args.history)]
    num_blocks = args.history // 16 + 32
    session = dict(session_id="bench", session_ttl=600.0)
    with make_llm(args.model, num_blocks, folder) as llm:
        run(llm, "warm", range(11, 19), 2)
        _, reply, _ = run(llm, "t1", history, 8, **session)
        started = time.perf_counter()
        save = llm.scheduler.save_session(None, "bench", NAME)
        llm.scheduler.update(llm.runner.execute(llm.scheduler.schedule()))
        save_s = time.perf_counter() - started
    next_turn = history + reply + [rng.randrange(10, 40000) for _ in range(3)]
    with make_llm(args.model, num_blocks, folder) as llm:
        run(llm, "warm", range(11, 19), 2)
        started = time.perf_counter()
        tokens, num_blocks_saved, num_bytes = llm.runner.snapshots.listing(NAME)
        listing_s = time.perf_counter() - started
        restore_s, _, _ = run(llm, "restore", tokens, 1, **session,
                              kv_import=KvHandoff(NAME, len(tokens), num_blocks_saved, snapshot=True))
        turn_s, restored_token, cached = run(llm, "t2", next_turn, 1, **session)
    with make_llm(args.model, num_blocks, tempfile.mkdtemp(prefix="empty-", dir=folder)) as llm:
        run(llm, "warm", range(11, 19), 2)
        recompute_s, recompute_token, _ = run(llm, "t2", next_turn, 1)
    assert restored_token == recompute_token, "greedy output differs between the restore and the recompute"
    return dict(saved_tokens=save.num_tokens, saved_blocks=save.num_blocks, snapshot_bytes=num_bytes,
                save_s=save_s, listing_s=listing_s, restore_s=restore_s, turn_after_restore_s=turn_s,
                cached_tokens=cached, recompute_s=recompute_s, prompt_tokens=len(next_turn))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--history", type=int, default=2000)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/session_snapshots.json")
    args = p.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder:
        reps = [one_rep(args, rng, folder) for _ in range(args.reps)]
    median = {key: statistics.median(r[key] for r in reps)
              for key in ("save_s", "listing_s", "restore_s", "turn_after_restore_s", "recompute_s")}
    first = reps[0]
    restored = median["listing_s"] + median["restore_s"] + median["turn_after_restore_s"]
    print(f"{first['saved_tokens']} tokens saved as {first['saved_blocks']} files, {first['snapshot_bytes']:,} bytes; "
          f"median of {args.reps}: save {median['save_s']:.3f} s; after a restart: verify {median['listing_s']:.3f} s "
          f"+ restore {median['restore_s']:.3f} s + next turn {median['turn_after_restore_s']:.3f} s "
          f"({first['cached_tokens']} cached) = {restored:.3f} s, against {median['recompute_s']:.3f} s "
          f"recomputed: {median['recompute_s'] / restored:.2f}x")
    write_result(args.out, {"args": vars(args), "cpu": platform.processor() or platform.machine(),
                            "reps": reps, "median": median})


if __name__ == "__main__":
    main()
