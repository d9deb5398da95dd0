"""Data parallelism: N replicas of the whole pipeline behind one front end.

Each replica is a process of its own (``worker``) running an ordinary ``Engine`` — its own
scheduler, its own stage processes, its own GIL. The front end (``engine.ReplicatedEngine``,
what ``Engine(data_parallel_size=N)`` returns) tokenises once, routes token batches to the
replica with the fewest outstanding tokens (``routing``), and writes the results that stream
back into the caller's ``Submission``. A replica that dies loses nothing: its unfinished rows
run again on the others, and it is started again in the background. With several HTTP
front-end processes (``pipepool serve --api-server-count``), the main one owns the replicas and
the others link to them (``shared``).
"""
