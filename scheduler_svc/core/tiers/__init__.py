"""Where prefix blocks live beyond the device pool's LRU: the host tier (host_tier.py: evicted
cached blocks copied to host memory and back on a hit) and session leases (sessions.py: a
conversation's blocks pinned between its turns, demoted to the LRU and the host tier under pressure)."""
