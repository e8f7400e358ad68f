"""`--distributed-executor-backend ray`: the other ranks as Ray actors on the cluster's nodes.

Rank 0 (this worker process, a Ray driver of the running cluster: `ray start --head` on one node,
`ray start --address=HEAD:6379` on the others) creates one placement group with a bundle per
pipeline stage, STRICT_SPREAD across nodes (PP across nodes, TP inside one: a bundle holds its
stage's TP ranks), and starts ranks 1..N-1 as actors in their stage's bundle. Stage 0 takes the
bundle Ray put on this node, since rank 0 runs here. The actors join rank 0's torch.distributed
rendezvous at this node's address, then run rank 0's commands (tp_rank.serve_rank) until "stop".

Ray is an optional extra (`pip install 'pagoda[ray]'`), imported only here. A dead actor (its
process killed, its node lost) is noticed twice: by the gloo socket it held closing (the group's
next operation raises), and by the actor's `serve` call failing (RayActorError), which calls
`on_failure` — the driver then fails the instance and its supervisor restarts it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from pathlib import Path

from pagoda.runtime.logging import get_logger

log = get_logger(__name__)
REPO = Path(__file__).resolve().parents[2]
PLACEMENT_TIMEOUT_S = 60.0
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # Ray's own variable; "auto" (the default here) finds a local cluster


class RayPlacementError(RuntimeError):
    """The Ray cluster cannot hold this instance's ranks."""


def _rank_actor_class():
    import ray

    @ray.remote
    class RankActor:
        """One follower rank: its process lives as long as the actor."""

        def where(self) -> tuple[str, int]:
            return ray.get_runtime_context().get_node_id(), os.getpid()

        def serve(self, rank: int, world_size: int, init_method: str, config: dict) -> None:
            from worker_svc.config import WorkerConfig
            from worker_svc.parallel.tp_rank import serve_rank

            serve_rank(rank, world_size, init_method, WorkerConfig(**config))

    return RankActor


class RayRanks:
    def __init__(self, config, placement, on_failure: Callable[[str], None]) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as error:
            raise RayPlacementError("--distributed-executor-backend ray needs Ray: pip install 'pagoda[ray]'") from error
        from worker_svc.parallel.distributed import free_port

        if placement.nnodes != 1:
            raise RayPlacementError("with the ray backend Ray places the ranks: leave --nnodes at 1")
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if not ray.is_initialized():
            ray.init(address=os.environ.get(RAY_ADDRESS_ENV, "auto"), log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        self._ray = ray
        self._on_failure = on_failure
        self._closing = False
        here = ray.get_runtime_context().get_node_id()
        # The address Ray knows this node by (its --node-ip-address), where the other nodes' ranks
        # can reach rank 0's rendezvous.
        address = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == here)
        self.init_method = f"tcp://{address}:{free_port()}"
        strategy = "STRICT_SPREAD" if pp > 1 else "STRICT_PACK"
        # A rank per GPU where the worker computes on GPUs (Ray then sets each actor's
        # CUDA_VISIBLE_DEVICES); CPU ranks reserve a core each.
        gpus = config.device == "cuda" or (config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        unit = "GPU" if gpus else "CPU"
        self._group = placement_group([{unit: float(tp)}] * pp, strategy=strategy)
        try:
            ray.get(self._group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as error:
            ray.util.remove_placement_group(self._group)
            raise RayPlacementError(
                f"the Ray cluster could not place {pp} stage(s) of {tp} {unit}(s) each ({strategy}: one stage "
                f"per node) within {PLACEMENT_TIMEOUT_S:.0f} s: {error}") from error
        bundle_nodes = ray.util.placement_group_table(self._group)["bundles_to_node_id"]
        order = sorted(bundle_nodes, key=lambda b: bundle_nodes[b] != here)  # this node's bundle first
        if bundle_nodes[order[0]] != here:
            ray.util.remove_placement_group(self._group)
            raise RayPlacementError("no bundle of the placement group is on this node, where rank 0 runs: "
                                    "start the worker on one of the cluster's nodes with free CPUs")
        actor = _rank_actor_class()
        self._actors = []
        for rank in range(1, tp * pp):
            strategy_for = PlacementGroupSchedulingStrategy(placement_group=self._group,
                                                            placement_group_bundle_index=order[rank // tp])
            self._actors.append(actor.options(num_cpus=0 if gpus else 1, num_gpus=1 if gpus else 0,
                                              scheduling_strategy=strategy_for, max_restarts=0).remote())
        where = ray.get([a.where.remote() for a in self._actors])
        self.node_ids = [here, *(node for node, _ in where)]
        self.pids = [pid for _, pid in where]
        payload = dataclasses.asdict(config)
        self._calls = [a.serve.remote(rank, tp * pp, self.init_method, payload)
                       for rank, a in enumerate(self._actors, start=1)]
        for rank, call in enumerate(self._calls, start=1):
            threading.Thread(target=self._watch, args=(rank, call), daemon=True, name=f"ray-rank-{rank}").start()
        log.info("ray_ranks_placed", placement_group=self._group.id.hex(), strategy=strategy,
                 node_ids=self.node_ids, pids=self.pids)

    def _watch(self, rank: int, call) -> None:
        try:
            self._ray.get(call)
        except Exception as error:  # noqa: BLE001 - RayActorError and friends: the rank is gone
            if not self._closing:
                self._on_failure(f"Ray rank {rank} (node {self.node_ids[rank]}) failed: {error!r}")

    def close(self, timeout_s: float) -> None:
        """After the "stop" broadcast: the actors' calls return; then the actors and the group go."""
        self._closing = True
        try:
            self._ray.wait(self._calls, num_returns=len(self._calls), timeout=timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        self._closing = True
        for actor in self._actors:
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001, S110 - already dead
                pass
        try:
            self._ray.util.remove_placement_group(self._group)
        except Exception:  # noqa: BLE001, S110 - the cluster may be gone
            pass
