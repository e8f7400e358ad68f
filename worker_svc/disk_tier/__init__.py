"""The prefix cache's disk tier on the worker (--kv-offload-dir): block files and the directory."""
