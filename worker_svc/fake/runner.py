"""A model-less step runner for the worker service: FakeWorker behind ModelRunner's interface.

Used by the service tests, the overhead benchmark and `python -m worker_svc --fake` (a worker that
answers instantly, for gateway/scheduler tests without torch weights). Plans are validated with
the real worker's `validate_plan` before anything changes, exactly as ModelRunner does.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path

from pagoda.contract.errors import NotInitializedError
from pagoda.contract.ids import RequestId
from pagoda.contract.step import StepPlan, StepResult, WorkerInfo
from worker_svc import fault_injection
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker
from worker_svc.plan_validation import validate_plan

# The tiny model's vocabulary: a fake stack's gateway usually loads that tokenizer.
DEFAULT_FAKE_VOCAB_SIZE = 2048
# `--fake --swap-space GiB`: a fake block has no bytes, so a nominal MiB each sizes its host pool.
FAKE_BLOCKS_PER_GIB = 1024


def fake_vocab_size(model_dir: str | Path | None) -> int:
    """The vocabulary a fake worker should report: the model's (config.json `vocab_size`, else the
    tokenizer.json vocabulary plus added tokens) when `model_dir` has one, else 2048. It must
    cover every id the gateway's tokenizer emits, or text prompts fail the vocabulary check."""
    directory = Path(model_dir) if model_dir else None
    if directory is not None and (directory / "config.json").is_file():
        vocab_size = json.loads((directory / "config.json").read_text()).get("vocab_size")
        if vocab_size:
            return int(vocab_size)
    if directory is not None and (directory / "tokenizer.json").is_file():
        tokenizer = json.loads((directory / "tokenizer.json").read_text())
        ids = [*tokenizer.get("model", {}).get("vocab", {}).values(),
               *(token["id"] for token in tokenizer.get("added_tokens", []))]
        if ids:
            return max(ids) + 1
    return DEFAULT_FAKE_VOCAB_SIZE


class _StateView:
    """The three fields validate_plan reads, over FakeWorker's resident record."""

    __slots__ = ("_state",)

    def __init__(self, state) -> None:
        self._state = state

    @property
    def token_ids(self) -> list[int]:
        return self._state.token_ids

    @property
    def block_ids(self) -> list[int]:
        return self._state.block_table

    @property
    def num_computed_tokens(self) -> int:
        return self._state.num_computed


class _ResidentView(Mapping):
    def __init__(self, resident: dict) -> None:
        self._resident = resident

    def __getitem__(self, key: RequestId) -> _StateView:
        return _StateView(self._resident[key])

    def __iter__(self) -> Iterator[RequestId]:
        return iter(self._resident)

    def __len__(self) -> int:
        return len(self._resident)


class FakeStepRunner:
    def __init__(self, num_blocks: int = 4096, block_size: int = 16, max_model_len: int = 4096,
                 vocab_size: int = 1000, eos_token_id: int | None = None, check_kv: bool = True,
                 num_cpu_blocks: int = 0, sliding_window: int = 0, num_offload_blocks: int = 0,
                 num_disk_blocks: int = 0) -> None:
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.sliding_window = sliding_window  # the model's window on every layer (0: none)
        self.num_cpu_blocks = num_cpu_blocks  # the host pool for swap preemption
        self.num_offload_blocks = num_offload_blocks  # then the prefix cache's host tier, same pool
        # The disk tier's files (FakeWorker.disk): they outlive every reset, as files a restart.
        self.num_disk_blocks = num_disk_blocks
        self.disk: OrderedDict = OrderedDict()
        self.sampler = FakeSampler(vocab_size=vocab_size, eos_token_id=eos_token_id)
        self.check_kv = check_kv
        self.worker: FakeWorker | None = None
        self.eos_token_ids = () if eos_token_id is None else (eos_token_id,)

    def initialize(self) -> WorkerInfo:
        self.reset()
        return WorkerInfo(num_blocks=self.num_blocks, block_size=self.block_size,
                          max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                          vocab_size=self.sampler.vocab_size, model_name="fake",
                          num_cpu_blocks=self.num_cpu_blocks, sliding_window=self.sliding_window,
                          num_offload_blocks=self.num_offload_blocks, num_disk_blocks=self.num_disk_blocks,
                          disk_blocks=self.disk_listing())

    def disk_listing(self) -> tuple:
        """The files, least recently used first, trimmed to the cap (as worker_svc/disk_tier)."""
        while len(self.disk) > self.num_disk_blocks:
            self.disk.popitem(last=False)
        return tuple(block for _, block in self.disk.values())

    def reset(self) -> None:
        self.worker = FakeWorker(self.num_blocks, self.block_size, self.sampler, self.check_kv,
                                 self.num_cpu_blocks + self.num_offload_blocks, self.sliding_window,
                                 self.disk)
        self._baseline = True  # the next plan may start at any step id (as ModelRunner.reset)

    @property
    def num_resident(self) -> int:
        return 0 if self.worker is None else len(self.worker.resident)

    def validate(self, plan: StepPlan) -> None:
        if self.worker is None:
            raise NotInitializedError("initialize() must run before any step")
        validate_plan(plan, _ResidentView(self.worker.resident), self.num_blocks, self.block_size,
                      self.num_cpu_blocks + self.num_offload_blocks, self.num_disk_blocks > 0)

    def execute(self, plan: StepPlan) -> StepResult:
        """Raises PlanError (before any change) for a plan that does not apply."""
        self.validate(plan)
        assert self.worker is not None
        if self._baseline:
            self.worker.next_step_id = plan.step_id
            self._baseline = False
        result = self.worker.execute(plan)
        fault_injection.check(result.request_ids)  # after the state changed, as the real runner
        return result
