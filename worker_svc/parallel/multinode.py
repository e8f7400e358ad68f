"""Where the ranks of one TP x PP instance run: torchrun's contract, and a node without rank 0.

World rank r = stage * tensor_parallel_size + tp_rank; the ranks split evenly and consecutively
over `nnodes` hosts, so with as many nodes as stages each node holds one stage's TP ranks (TP inside
a node over its fast links, PP across nodes: one hidden-state hop per step crosses the network).
Every host runs one launch with the same sizes, its own `--node-rank` and rank 0's address
(`--master-addr / --master-port`); node 0's worker is rank 0 and serves the scheduler.

Node r > 0 (`pagoda serve --node-rank r`, whose worker child is `python -m worker_svc --node-rank r`,
or `python -m worker_svc.parallel.multinode --config JSON`): it starts this node's ranks (worker_svc/parallel/tp_rank.py) and, when one
ends (the instance failed: a rank or rank 0 died), ends the others and starts them all again, so
they rejoin rank 0's next rendezvous when the instance restarts. No home-made membership: the
rendezvous is torch.distributed's TCP store on rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pagoda.runtime.logging import configure_logging, get_logger

log = get_logger("worker_svc.parallel.multinode")
REPO = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 10.0
RESTART_BACKOFF_S = (1.0, 30.0)  # first and largest pause before starting a node's ranks again
HEALTHY_RUN_S = 60.0  # ranks that ran this long reset the backoff


class PlacementError(ValueError):
    """Sizes, nodes and addresses that cannot make one world."""


@dataclass(frozen=True, slots=True)
class Placement:
    world_size: int
    nnodes: int
    node_rank: int
    init_method: str

    @classmethod
    def of(cls, config) -> Placement:
        """From a WorkerConfig. One node without a master port: a free loopback port."""
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        nnodes, node_rank = config.nnodes, config.node_rank
        if nnodes < 1 or not 0 <= node_rank < nnodes:
            raise PlacementError(f"--node-rank {node_rank} must be in [0, --nnodes {nnodes})")
        if world % nnodes:
            raise PlacementError(f"{world} ranks (tensor x pipeline parallel sizes) do not split evenly "
                                 f"over {nnodes} nodes")
        port = config.master_port
        if port is None:
            if nnodes > 1:
                raise PlacementError("--nnodes > 1 needs --master-port (and --master-addr): rank 0's "
                                     "rendezvous, which every node dials")
            from worker_svc.parallel.distributed import free_port

            port = free_port()
        return cls(world, nnodes, node_rank, f"tcp://{config.master_addr}:{port}")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def local_ranks(self, node_rank: int | None = None) -> list[int]:
        node = self.node_rank if node_rank is None else node_rank
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))


PLACEMENT_FIELDS = ("nnodes", "node_rank", "master_addr", "master_port")


def adopt_config(own, rank0: dict):
    """Rank 0's WorkerConfig, with this node's own placement: a follower computes what rank 0's
    flags say (LoRA, seed, swap space, pooling...), whatever its own launch was given."""
    from worker_svc.config import WorkerConfig

    return WorkerConfig(**{**rank0, **{name: getattr(own, name) for name in PLACEMENT_FIELDS}})


def rank_argv(rank: int, placement: Placement, config) -> list[str]:
    return [sys.executable, "-m", "worker_svc.parallel.tp_rank", "--rank", str(rank), "--world-size",
            str(placement.world_size), "--init-method", placement.init_method,
            "--config", json.dumps(dataclasses.asdict(config))]


class NodeRanks:
    """Node r > 0: this node's ranks as child processes, started again together whenever one ends."""

    def __init__(self, config) -> None:
        self.config = config
        self.placement = Placement.of(config)
        if self.placement.node_rank == 0:
            raise PlacementError("node 0 runs rank 0 inside the worker (python -m worker_svc)")
        self._stop = threading.Event()
        self.generation = 0

    def run(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        pause = RESTART_BACKOFF_S[0]
        while not self._stop.is_set():
            self.generation += 1
            started = time.monotonic()
            children = [subprocess.Popen(rank_argv(r, self.placement, self.config), env=env, cwd=REPO)
                        for r in self.placement.local_ranks()]
            log.info("node_ranks_started", node_rank=self.placement.node_rank, generation=self.generation,
                     ranks=self.placement.local_ranks(), pids=[c.pid for c in children])
            ended = _wait_any(children, self._stop)
            for child in children:
                if child.poll() is None:
                    child.terminate()
            for child in children:
                try:
                    child.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    child.kill()
            if ended is not None:
                # Ranks that fail at once (a bad path on this node) must not respawn in a tight loop.
                pause = RESTART_BACKOFF_S[0] if time.monotonic() - started > HEALTHY_RUN_S else pause
                log.warning("node_rank_ended", node_rank=self.placement.node_rank, pid=ended.pid,
                            code=ended.returncode, action="restart this node's ranks", after_s=pause)
                self._stop.wait(pause)
                pause = min(2 * pause, RESTART_BACKOFF_S[1])

    def stop(self, *_args) -> None:
        self._stop.set()


def _wait_any(children: list[subprocess.Popen], stop: threading.Event) -> subprocess.Popen | None:
    """The first child to end, or None once `stop` is set. One thread per child waits on it."""
    done = threading.Event()
    first: list[subprocess.Popen] = []

    def wait(child: subprocess.Popen) -> None:
        child.wait()
        first.append(child)
        done.set()

    for child in children:
        threading.Thread(target=wait, args=(child,), daemon=True).start()
    threading.Thread(target=lambda: (stop.wait(), done.set()), daemon=True).start()
    done.wait()
    return None if stop.is_set() and not first else first[0]


def serve_node(config) -> None:
    """Run node r > 0's ranks until SIGTERM / SIGINT (its launch's worker child)."""
    node = NodeRanks(config)
    signal.signal(signal.SIGTERM, node.stop)
    signal.signal(signal.SIGINT, node.stop)
    node.run()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m worker_svc.parallel.multinode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the WorkerConfig as JSON (nnodes, node_rank, master_*)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    from worker_svc.config import WorkerConfig

    config = WorkerConfig(**json.loads(args.config))
    configure_logging(level=args.log_level, service=f"worker-node{config.node_rank}")
    serve_node(config)


if __name__ == "__main__":
    main()
