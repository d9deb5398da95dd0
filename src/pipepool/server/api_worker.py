"""One more HTTP front-end process of ``pipepool serve --api-server-count K`` (``api_servers``).

``python -m pipepool.server.api_worker SOCKET_FD READY_FD``, its ``ApiServerSpec`` pickled on
stdin. It links to every replica of every model (``replicas.shared.SharedReplicas``, waiting
until they serve; beside other models each has a tokenizer helper process here too, as in the
main process), and only then starts accepting connections on the inherited listening socket: a
process still loading never takes a connection the others could answer. It writes one byte to
READY_FD once it serves. SIGTERM or Ctrl-C: it drains its requests as the main process does,
then hangs up on the replicas (the main process stops them).
"""

from __future__ import annotations

import logging.config
import os
import pickle
import signal
import socket
import sys

from ..parallel.worker import _die_with_parent
from ..runtime.signal_mask import unblock_stop_signals


def main(argv: list[str] | None = None) -> None:
    """Serve until stopped; ends the process (``os._exit``) with 0, or 1 if it could not."""
    unblock_stop_signals()  # a restarted one is started from a watcher thread that blocks them
    _die_with_parent()
    sock_fd, ready_fd = (int(x) for x in (argv if argv is not None else sys.argv[1:])[:2])
    spec = pickle.loads(sys.stdin.buffer.read())
    settings = spec.settings
    # Until it serves, SIGTERM and Ctrl-C end it at once (nothing to drain yet).
    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    from ..replicas.shared import SharedReplicas
    from ..runtime import switch_interval
    from ..runtime.collector import QuietCollections, freeze_startup_objects
    from .batch_store import close_open_stores
    from .front import AsyncEngine
    from .logs import log_config
    from .models import ModelNames, ServedModel, ServedModels
    from .online_gate import GATE
    from .owner import EngineOwner, model_engine
    from .uvicorn_server import build_server

    logs = log_config(settings.log_level, settings.log_format)
    logging.config.dictConfig(logs)
    several = len(spec.models) > 1
    models = []
    for m in spec.models:
        build = lambda m=m: model_engine(  # noqa: E731
            m.config,
            SharedReplicas,
            m.socket_dir,
            beside_others=several,
            front_ends=settings.api_server_count,
        )
        front = AsyncEngine(
            EngineOwner(build), max_queued=m.max_queued_requests,
            queue_wait=settings.queue_wait_s,
        )  # fmt: skip
        models.append(ServedModel(ModelNames(m.names, m.tasks), front))
    served = ServedModels(models)

    def serving() -> None:
        os.write(ready_fd, b"r")
        os.close(ready_fd)
        # As the main front end does (``commands/serve.py``): start-up objects frozen, full
        # collections after a second without a request in flight.
        freeze_startup_objects()
        QuietCollections(quiet=GATE.settled).start()

    interval = switch_interval.for_configs([m.config.switch_interval_ms for m in spec.models])
    server = build_server(settings, served, logs, on_started=serving, switch_interval_s=interval)

    def stop_serving(_exc: BaseException) -> None:
        server.should_exit = True

    for model in served:
        model.front.owner.start(on_failure=stop_serving)
    for model in served:
        owner = model.front.owner
        owner.loaded.wait()
        if owner.error is not None:
            logging.getLogger("pipepool.server").error(
                "API server %d could not link to the replicas of %s: %s",
                settings.api_server_index, model.name, owner.error,
            )  # fmt: skip
            os._exit(1)
    # uvicorn installs its own SIGINT/SIGTERM handlers (drain, then return) in run(), and
    # re-raises the signal afterwards with the handler it found: that one must do nothing.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    try:
        server.run(sockets=[socket.socket(fileno=sock_fd)])
    finally:
        for model in served:
            model.front.close()
        for model in served:
            model.front.owner.close()
        close_open_stores()  # checkpointed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if server.started else 1)


if __name__ == "__main__":
    main()
