"""`python -m pagoda.entrypoints.launcher --model DIR` (what `make run` calls): the whole stack on 127.0.0.1.

Starts the worker, the scheduler and (when gateway/__main__.py exists) the gateway as separate
processes (with `--data-parallel-size N`: N worker + scheduler pairs, replica i on the port flags
+ 10·i, and one gateway routing over all N schedulers; each `--extra-model` adds one more pair
serving another model, the gateway's pool for that model name), waits until each answers grpc.health.v1, prints the addresses, restarts a child that
dies (the scheduler reconnects to a restarted worker and recomputes), and stops everything in
reverse order on Ctrl-C / SIGTERM / SIGHUP / SIGQUIT: the gateway drains first, then the
scheduler, then the worker.

No child outlives the launcher: each is stopped with SIGTERM, waited for, and SIGKILLed if it has
not exited in time; then what it started itself (its process group) is waited for and killed too.
A second Ctrl-C skips the drains (SIGKILL at once). Should the launcher itself die without
stopping them (SIGKILL), Linux sends each child SIGTERM (PR_SET_PDEATHSIG, which each service sets
itself when it finds PAGODA_LAUNCHER_PID: pagoda/runtime/shutdown.py).

Three parts, dependencies one way: `cli` (the flags; start in order, stop in reverse) uses
`topology` (which children, on which ports and devices), which uses `supervisor` (start,
probe, restart and stop one child process and what it started).
"""
