"""`python -m worker_svc.parallel.tp_rank --rank R ...`: a follower rank of a TP x PP worker group.

Spawned by rank 0 (worker_svc/parallel/tp_worker.py) or by another node's launch (worker_svc/parallel/multinode.py),
never by hand. It joins the group, loads its shard,
then runs rank 0's commands until "stop". It has no gRPC server: rank 0 alone talks to the
scheduler. Any error, or rank 0 going away, ends the process non-zero (rank 0 then fails too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time

from pagoda.runtime.logging import configure_logging, get_logger
from worker_svc.parallel.liveness import HEARTBEAT_S, start_beating, store_client

log = get_logger("worker_svc.parallel.tp_rank")
PARENT_POLL_S = 1.0
RANK0_SILENCE_S = 20.0  # a waiting rank that heard nothing for this long ends itself


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker_svc.parallel.tp_rank", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-method", required=True, help="tcp://127.0.0.1:PORT (rank 0's rendezvous)")
    p.add_argument("--config", required=True, help="the WorkerConfig as JSON")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def exit_when_orphaned(parent_pid: int) -> None:
    """NCCL may block forever on a dead peer: rank 0 gone means this rank must go too."""
    stop = threading.Event()
    while not stop.wait(PARENT_POLL_S):
        if os.getppid() != parent_pid:
            log.error("tp_rank_orphaned", parent_pid=parent_pid)
            os._exit(1)


def run(args: argparse.Namespace) -> None:
    from worker_svc.config import WorkerConfig

    serve_rank(args.rank, args.world_size, args.init_method, WorkerConfig(**json.loads(args.config)))


class Watchdog:
    """Ends this rank when rank 0 has said nothing for RANK0_SILENCE_S while it waited: rank 0
    pings every HEARTBEAT_S when idle, so silence means rank 0 (or its node, or the link) is gone
    without a socket closing (a partition, a powered-off host), which no gloo call would report.
    The rank's supervisor then starts it again, to join rank 0's next rendezvous."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._since: float | None = None  # when the current wait began; None while computing
        threading.Thread(target=self._watch, daemon=True, name="rank0-watchdog").start()

    @contextlib.contextmanager
    def waiting(self):
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)  # a poll interval: the deadline is RANK0_SILENCE_S
            since = self._since
            if since is not None and time.monotonic() - since > RANK0_SILENCE_S:
                log.error("tp_rank_rank0_silent", rank=self._rank, seconds=round(time.monotonic() - since, 1))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)


def serve_rank(rank: int, world_size: int, init_method: str, config) -> None:
    """Join the world as `rank`, load this rank's shard of its stage, run rank 0's commands until
    "stop" (a process of the mp backend, or a Ray actor's method)."""
    import torch

    from worker_svc.model_loader.model_config import ModelConfig
    from worker_svc.model_runner import ModelRunner, resolve_device
    from worker_svc.parallel.channels import command_channel
    from worker_svc.parallel.distributed import cpu_threads_per_rank, destroy_group, init_groups
    from worker_svc.parallel.multinode import adopt_config
    from worker_svc.parallel.pipeline import stage_of

    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    device = resolve_device(config.device, rank, world_size)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world_size // config.nnodes))
    groups = init_groups(rank, world_size, tp_size, init_method, device)
    start_beating(store_client(init_method), rank)  # from now on rank 0 can tell we are alive
    channel = command_channel(groups)
    command, rank0_config = channel.receive()
    if command != "config":
        raise ValueError(f"rank 0 sent {command!r} before its config")
    config = adopt_config(config, rank0_config)
    stage = stage_of(rank, tp_size, pp_size, ModelConfig.from_dir(config.model).num_layers,
                     groups.pipe_group, groups.result_group)
    runner = ModelRunner(config, tp=groups.tp, stage=stage)
    log.info("tp_rank_ready", rank=rank, stage=stage.index, layers=f"{stage.start_layer}-{stage.end_layer}",
             device=str(runner.device))
    watchdog = Watchdog(rank)
    while True:
        with watchdog.waiting():
            command, *payload = channel.receive()
        if command == "ping":  # rank 0 is alive and idle
            continue
        if command == "step":
            plan, sampled = payload
            runner.append_sampled(sampled)
            runner.execute(plan)
        elif command == "init":
            runner.max_num_batched_tokens = payload[0]
            runner.initialize()
        elif command == "reset":
            runner.reset()
        elif command == "stop":
            break
        else:
            raise ValueError(f"unknown command {command!r} from rank 0")
    destroy_group()
    log.info("tp_rank_stopped", rank=rank)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(level=args.log_level, service=f"worker-rank{args.rank}")
    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides when followers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    try:
        run(args)
    except Exception as error:  # noqa: BLE001 - logged, then the non-zero exit is the signal
        log.exception("tp_rank_failed", rank=args.rank, error=str(error))
        sys.exit(1)


if __name__ == "__main__":
    main()
