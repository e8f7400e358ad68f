"""Ranks of one model instance: tensor parallel (distributed.py), pipeline stages (pipeline.py),
rank 0's driver (tp_worker.py), a follower rank (tp_rank.py), and where ranks run: processes on
one or several hosts (multinode.py) or Ray actors (ray_ranks.py)."""
