"""Session save / restore through the real runner (the tiny model, fp32, CPU): turn 1 of a session
runs, its lease is saved as block files in the snapshot folder, the engine is closed and a new one
started on the same folder (a restart, or another replica); the snapshot is read and verified,
restored by its one-token request, and turn 2 then reports the saved prefix as cached tokens and
samples exactly the tokens turn 2 sampled on the first engine, which never restarted. A corrupt file
or another model's is refused by the listing, before anything is scheduled."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda import LLM
from pagoda.contract.errors import SessionNotFoundError, SnapshotRefusedError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason, SamplingParams
from scheduler_svc.core import EngineRequest
from scheduler_svc.core.request import KvHandoff
from scheduler_svc.core.tiers.snapshots import snapshot_name
from worker_svc.disk_tier.block_file import read_block_file, write_block_file

TURN1 = tuple((i * 37) % 1900 + 20 for i in range(75))  # 4 full blocks of 16 and a partial one
MAX_TOKENS = 12
NAME = snapshot_name(None, "chat")


def _engine(model: str, folder: str, device: str = "cpu") -> LLM:
    return LLM(model=model, dtype="float32", device=device, num_gpu_blocks_override=64, kv_snapshot_dir=folder)


def _run(llm: LLM, request: EngineRequest) -> tuple[list[int], int]:
    """Its tokens and its cached prompt tokens."""
    llm.scheduler.add_request(request)
    tokens: list[int] = []
    while llm.scheduler.has_unfinished_requests():
        for delta in llm.scheduler.update(llm.runner.execute(llm.scheduler.schedule())):
            tokens += delta.new_token_ids
            if delta.finish_reason is not None:
                assert delta.finish_reason is FinishReason.LENGTH
                cached = delta.num_cached_tokens
    llm.scheduler.check_invariants()
    return tokens, cached


def _turn(rid: str, prompt, max_tokens: int = MAX_TOKENS) -> EngineRequest:
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                         session_id="chat", session_ttl=600.0)


def save_two_turns(model: str, folder: str, device: str = "cpu") -> tuple[tuple[int, ...], list[int]]:
    """Turn 1, its save, turn 2 on one engine: (turn 2's prompt, turn 2's tokens)."""
    with _engine(model, folder, device) as llm:
        out1, _ = _run(llm, _turn("t1", TURN1))
        save = llm.scheduler.save_session(None, "chat", NAME)
        plan = llm.scheduler.schedule()
        llm.scheduler.update(llm.runner.execute(plan))
        assert llm.scheduler.take_saved_sessions() == [save] and save.ok
        # 75 prompt + 12 sampled tokens, 86 computed: 5 full blocks leased and saved
        assert (save.num_tokens, save.num_blocks) == (80, 5)
        turn2 = TURN1 + tuple(out1) + (7, 8, 9)
        expected, cached = _run(llm, _turn("t2", turn2))
        assert cached == 80
    return turn2, expected


def restore_and_hit(model: str, folder: str, turn2, expected, device: str = "cpu") -> None:
    """A new engine on the folder restores the snapshot; turn 2 hits its 80 tokens, same tokens."""
    with _engine(model, folder, device) as llm:
        tokens, num_blocks, num_bytes = llm.runner.snapshots.listing(NAME)
        assert (len(tokens), num_blocks) == (80, 5) and tuple(tokens) == turn2[:80] and num_bytes > 0
        before = llm.scheduler.stats().prefill_tokens_computed
        _, cached = _run(llm, EngineRequest(
            RequestId("restore"), tuple(tokens), SamplingParams(max_tokens=1), session_id="chat",
            session_ttl=600.0, kv_import=KvHandoff(NAME, 80, 5, snapshot=True)))
        assert cached == 0 and llm.scheduler.stats().prefill_tokens_computed == before + 1
        assert (llm.scheduler.num_sessions, llm.scheduler.num_session_blocks) == (1, 5)
        out2, cached = _run(llm, _turn("t2", turn2))
    assert cached == 80 and out2 == expected


@pytest.fixture(scope="module")
def saved(tiny_model_dir: str, tmp_path_factory):
    """The first engine's two turns, and the snapshot it saved between them."""
    folder = str(tmp_path_factory.mktemp("snapshots"))
    return (folder, *save_two_turns(tiny_model_dir, folder))


def test_a_restored_session_hits_its_saved_prefix_after_a_restart(saved, tiny_model_dir):
    folder, turn2, expected = saved
    restore_and_hit(tiny_model_dir, folder, turn2, expected)


def test_a_corrupt_or_foreign_snapshot_is_refused(saved, tiny_model_dir, tmp_path):
    folder, _, _ = saved
    with _engine(tiny_model_dir, str(tmp_path)) as llm:
        store = llm.runner.snapshots
        with pytest.raises(SessionNotFoundError):
            store.listing(NAME)
        first = Path(folder) / NAME / "00000000.safetensors"  # the saved session's first block
        payload, block = read_block_file(first, store.fingerprint)
        copy = store.dir / NAME / first.name
        copy.parent.mkdir()
        write_block_file(copy, payload, block, "another model's fingerprint")
        with pytest.raises(SnapshotRefusedError, match="another model"):
            store.listing(NAME)
        write_block_file(copy, payload, block, store.fingerprint)
        assert store.listing(NAME)[:2] == (list(block.token_ids), 1)
        raw = copy.read_bytes()
        copy.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # a flipped bit in the payload
        with pytest.raises(SnapshotRefusedError, match="checksum"):
            store.listing(NAME)
