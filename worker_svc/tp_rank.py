"""`python -m worker_svc.tp_rank --rank R ...`: a follower rank of a tensor-parallel worker group.

Spawned by rank 0 (worker_svc/tp_worker.py), never by hand. It joins the group, loads its shard,
then runs rank 0's commands until "stop". It has no gRPC server: rank 0 alone talks to the
scheduler. Any error, or rank 0 going away, ends the process non-zero (rank 0 then fails too).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from pagoda.runtime.logging import configure_logging, get_logger

log = get_logger("worker_svc.tp_rank")
PARENT_POLL_S = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker_svc.tp_rank", description=__doc__)
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
    import torch

    from worker_svc.config import WorkerConfig
    from worker_svc.distributed import ControlChannel, destroy_group, init_group
    from worker_svc.model_runner import ModelRunner, resolve_device
    from worker_svc.tp_worker import cpu_threads_per_rank

    config = WorkerConfig(**json.loads(args.config))
    device = resolve_device(config.device, args.rank, args.world_size)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(args.world_size))
    tp = init_group(args.rank, args.world_size, args.init_method, device)
    runner = ModelRunner(config, tp=tp)
    channel = ControlChannel(tp)
    log.info("tp_rank_ready", rank=args.rank, device=str(runner.device))
    while True:
        command, *payload = channel.receive()
        if command == "step":
            plan, previous_tokens = payload
            runner.append_sampled(previous_tokens)
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
    log.info("tp_rank_stopped", rank=args.rank)


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
