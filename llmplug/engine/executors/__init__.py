"""Executors run the workers: in this process (uniproc), in spawned processes or Ray actors."""
