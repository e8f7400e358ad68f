"""One PP=2 instance over two "hosts" on this machine, served through the gateway to the openai client.

- torchrun's contract: two launchers, node 0 (rank 0, scheduler, gateway on 127.0.0.1) and node 1
  (only its rank), meeting at the rendezvous given as 127.0.0.2 (rank 0's store answers on every
  loopback address). The greedy completions equal the single-rank offline LLM's.
- Ray: a real two-node cluster (ray.cluster_utils.Cluster, both raylets on loopback); the worker
  places rank 1 as an actor with a STRICT_SPREAD placement group, so the ranks sit on two distinct
  Ray node ids; the completions are the same.
- A killed rank on the second node: the request in flight ends with a clear error (the scheduler's
  --worker-timeout is short here; with the default a restart within it recomputes instead), rank 0
  exits, the supervisors start the ranks again, and the instance serves the same tokens again.
  A frozen rank (SIGSTOP: a lost node closes no socket) is noticed by rank 0 within seconds too.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from pagoda import LLM, SamplingParams
from tests.e2e.conftest import free_port
from tests.e2e.gateway_conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The river", "Once upon a time", "A list of primes:"]
MAX_TOKENS = 12
COMMON = ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", "64",
          "--pipeline-parallel-size", "2", "--worker-timeout", "2"]


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[str]:
    with LLM(model=str(tiny_model_dir), dtype="float32", device="cpu", num_gpu_blocks_override=64) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


class Launcher:
    def __init__(self, name: str, log_dir: Path, args: list[str], env: dict | None = None) -> None:
        self.log_path = log_dir / f"{name}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.launcher", *args], cwd=REPO,
                                     stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_line(self, text: str, deadline_s: float = 180.0) -> None:
        end = time.monotonic() + deadline_s
        while text not in self.log():
            assert self.proc.poll() is None and time.monotonic() < end, self.log()[-4000:]
            time.sleep(0.2)  # a poll interval bounded by the deadline

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


def node0_args(model: str, log_dir: Path) -> tuple[list[str], str]:
    ports = {flag: free_port() for flag in ("--worker-port", "--scheduler-port", "--gateway-port", "--grpc-port")}
    args = ["--model", model, *COMMON, *(x for flag, port in ports.items() for x in (flag, str(port)))]
    return args, f"http://127.0.0.1:{ports['--gateway-port']}/v1"


def complete_all(base_url: str, model: str) -> list[str]:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    return [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
            for p in PROMPTS]


def kill_rank_mid_stream(base_url: str, model: str, pid: int) -> Exception:
    """Start a long stream, SIGKILL `pid` once its first token came; the error the stream ends with."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model=model, prompt="The river", max_tokens=900, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        os.kill(pid, signal.SIGKILL)
        for _ in stream:
            pass
    except (openai.APIError, openai.APIConnectionError) as error:
        return error
    raise AssertionError("the stream finished although a rank of its instance was killed")


def rank_pids(rank: int, master_port: int | str) -> list[int]:
    """The live tp_rank processes of `rank` in the world whose rendezvous port is `master_port`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker_svc.parallel.tp_rank" in argv and f":{master_port}".encode() in b" ".join(argv) \
                and argv[argv.index(b"--rank") + 1] == str(rank).encode():
            found.append(int(cmdline.parent.name))
    return found


def serves_again(base_url: str, model: str, expected: list[str]) -> None:
    def ok() -> bool:
        try:
            return complete_all(base_url, model) == expected
        except openai.APIError:
            return False
    wait_for(ok, deadline_s=180)


def test_two_launchers_one_instance(tiny_model_dir, expected, tmp_path) -> None:
    tiny_model_dir = str(tiny_model_dir)
    master_port = free_port()
    nodes = ["--nnodes", "2", "--master-port", str(master_port)]
    args, base_url = node0_args(tiny_model_dir, tmp_path)
    node0 = Launcher("node0", tmp_path, [*args, *nodes, "--node-rank", "0", "--master-addr", "127.0.0.1"])
    node1 = Launcher("node1", tmp_path, ["--model", tiny_model_dir, *COMMON, *nodes, "--node-rank", "1",
                                         "--master-addr", "127.0.0.2"])
    try:
        node0.wait_for_line("Pagoda is serving")
        assert complete_all(base_url, tiny_model_dir) == expected
        [rank1] = rank_pids(1, master_port)
        assert "node_ranks_started" in node1.log() and rank_pids(0, master_port) == []  # rank 0 is the worker
        error = kill_rank_mid_stream(base_url, tiny_model_dir, rank1)
        assert "worker" in str(error).lower() or "unavailable" in str(error).lower(), error
        serves_again(base_url, tiny_model_dir, expected)
        assert rank_pids(1, master_port) not in ([], [rank1])  # node 1 started its rank again
        assert "tp_group_failed" in node0.log() and "restarting" in node0.log()
        freeze_a_rank_and_see_rank0_fail(node0, rank_pids(1, master_port))
        serves_again(base_url, tiny_model_dir, expected)
    finally:
        codes = node0.stop(), node1.stop()
    assert codes == (0, 0), (node0.log()[-3000:], node1.log()[-3000:])


def freeze_a_rank_and_see_rank0_fail(node0: Launcher, pids: list[int]) -> None:
    """A lost node closes no socket: SIGSTOP its rank. Rank 0 must notice from the heartbeat
    counters within seconds (worker_svc/parallel/liveness.py), not at a receive's 10-minute timeout."""
    [pid] = pids
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        node0.wait_for_line("sent no heartbeat", deadline_s=90)
    finally:
        os.kill(pid, signal.SIGCONT)  # then rank 0's silence ends it and node 1 starts it again
    assert time.monotonic() - started < 60, "rank 0 took more than a minute to notice a frozen rank"


def test_ray_cluster_places_the_stages_on_two_nodes(tiny_model_dir, expected, tmp_path, monkeypatch) -> None:
    ray = pytest.importorskip("ray")
    tiny_model_dir = str(tiny_model_dir)
    from ray.cluster_utils import Cluster

    # Loopback only: Ray otherwise advertises this host's outward address for its GCS and raylets.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    args, base_url = node0_args(tiny_model_dir, tmp_path)
    node0 = Launcher("ray", tmp_path, [*args, "--distributed-executor-backend", "ray"],
                     env={"RAY_ADDRESS": cluster.address, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    try:
        node0.wait_for_line("Pagoda is serving", deadline_s=300)
        placed = re.search(r'"node_ids": \["(\w+)", "(\w+)"\], "pids": \[(\d+)\]', node0.log())
        assert placed, node0.log()[-3000:]
        node_ids, actor_pid = placed.group(1, 2), int(placed.group(3))
        assert node_ids[0] != node_ids[1]
        assert set(node_ids) == {n["NodeID"] for n in ray.nodes() if n["Alive"]} if ray.is_initialized() else True
        assert complete_all(base_url, tiny_model_dir) == expected
        error = kill_rank_mid_stream(base_url, tiny_model_dir, actor_pid)
        assert "worker" in str(error).lower() or "unavailable" in str(error).lower(), error
        serves_again(base_url, tiny_model_dir, expected)
        assert node0.log().count("ray_ranks_placed") >= 2  # the restarted worker placed its rank anew
    finally:
        code = node0.stop()
        cluster.shutdown()
    assert code == 0, node0.log()[-3000:]
