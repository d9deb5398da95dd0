"""``pipepool serve``: the OpenAI-compatible embedding server (FastAPI + uvicorn).

Every flag can also come from ``PIPEPOOL_<FLAG>`` (e.g. ``PIPEPOOL_API_KEY``), parsed as the flag
is, the command line winning. The model is checked first (its folder, config, tokenizer, the
names and shapes of its weights; a hub id is fetched), so that a bad one fails, naming the
problem, before the server listens. Then the server listens at once and loads the weights in
the background (``/health`` says 503 until it is ready). Several models (``--model`` repeated,
``--models-file``) are served side by side, each in processes of its own with its own queue,
in a memory plan made before any loads (``replicas/memory_plan.py``); requests go to the model
they name (``server/models.py``). On SIGTERM or Ctrl-C it stops
accepting connections, lets the requests in flight finish (up to ``--shutdown-timeout``, then
answers what is left 503), then stops the pipeline stages. If the engine fails for good (a
stage died more often than it may be restarted), the server stops too and exits non-zero, so
that an orchestrator restarts it (of several models, the others go on serving). Batches of
the Batch API run in this process (``server/batch_runner.py``), below online requests; a
server started again on the same ``--state-dir`` resumes those a stop or a kill left
unfinished.
"""

from __future__ import annotations

import argparse
import logging
import logging.config
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..loading.model_folder import BUNDLED_MODEL_ID
from ..runtime import switch_interval
from ..runtime.collector import QuietCollections, freeze_startup_objects
from ..server.api_servers import (
    CORES_PER_API_SERVER,
    MAX_AUTO_API_SERVERS,
    MIN_CORES_FOR_MORE,
    auto_api_server_count,
)
from .common import add_engine_args, add_env_argument
from .media_args import add_media_args, media_settings
from .serve_models import ModelSpec, model_specs

if TYPE_CHECKING:
    from ..server.settings import ServerSettings


def add_parser(sub, help: str) -> None:
    from ..server.settings import ServerSettings as S  # each default's one source
    from ..server.turns import FAIR_SHARES

    p = sub.add_parser("serve", help=help, description=help)
    g = p.add_argument_group("server")
    add_env_argument(
        g,
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server to the network)",
    )
    add_env_argument(g, "--port", type=int, default=8000, help="port to listen on (default 8000)")
    add_env_argument(
        g,
        "--api-key",
        help="require 'Authorization: Bearer KEY' on the API routes (/health, /metrics, /docs "
        "stay open)",
    )
    g.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]PATH",
        help="a model folder or hub id to serve, NAME the name clients send as 'model' "
        "(default: the folder's or hub id's names); repeat for several models, each in its "
        "own processes and with its own queue (default: the bundled all-MiniLM-L6-v2) "
        "[env: PIPEPOOL_MODEL]",
    )
    add_env_argument(
        g,
        "--models-file",
        metavar="FILE.toml",
        help="models to serve with options of their own: one [models.NAME] table each "
        "(model = PATH, aliases, tasks, max_queued_requests, engine options by name); the "
        "engine flags given here apply to all of them",
    )
    add_env_argument(
        g,
        "--served-model-name",
        help="more names clients may send as 'model', comma-separated; the first is the one "
        "responses carry (always accepted too: the hub id, its short name, the folder name)",
    )
    add_env_argument(
        g,
        "--allow-token-ids",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accept token-id inputs (read as ids of this model's tokenizer; off by default: "
        "clients such as LangChain send ids of OpenAI's tokenizer, which would give wrong "
        "vectors)",
    )
    add_env_argument(
        g,
        "--max-inputs-per-request",
        type=int,
        default=S.max_inputs_per_request,
        help="more inputs in one request are answered 400 (default 2048)",
    )
    add_env_argument(
        g,
        "--max-tokens-per-request",
        type=int,
        default=S.max_tokens_per_request,
        help="more tokens in one request (all its inputs together, after truncation) are "
        "answered 400 (default 300000, OpenAI's own limit); /tokenize and /detokenize count "
        "theirs too",
    )
    add_env_argument(
        g,
        "--max-chunked-tokens",
        type=int,
        default=S.max_chunked_tokens,
        help="the most tokens of one input embedded with long_inputs=chunk (a request cannot "
        "raise it); longer inputs are answered 400, and /tokenize counts texts up to it "
        "(default 32768)",
    )
    add_env_argument(
        g,
        "--max-body-bytes",
        type=int,
        default=S.max_body_bytes,
        help="larger request bodies are answered 413 (default 32 MiB)",
    )
    add_env_argument(
        g,
        "--max-queued-requests",
        type=int,
        default=S.max_queued_requests,
        help="inputs in progress over all clients, per model (and per front-end process with "
        "--api-server-count); a request that would exceed its model's waits --queue-wait for "
        "room, then gets 429 (default 16384)",
    )
    add_env_argument(
        g,
        "--queue-wait",
        type=float,
        default=S.queue_wait_s,
        help="seconds a request that finds its model's queue full waits for room before its "
        "429; holds clients that retry at once after a 429 to a request per wait on each "
        "connection (default 1; 0: refused at once)",
    )
    add_env_argument(
        g,
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds to let requests in flight finish after SIGTERM; those still running then "
        "are answered 503 (default 30)",
    )
    add_env_argument(
        g,
        "--timeout-keep-alive",
        type=float,
        default=75.0,
        help="seconds an idle keep-alive connection stays open (default 75: longer than "
        "common clients' and load balancers' idle expiry, so none sends on a connection the "
        "server is closing)",
    )
    add_env_argument(
        g,
        "--backlog",
        type=int,
        default=2048,
        help="connections the kernel queues while the server is busy accepting (default 2048)",
    )
    add_env_argument(
        g,
        "--header-timeout",
        type=float,
        default=S.header_timeout_s,
        help="seconds a request's headers may take from its first byte (a new connection's "
        "first request: from the connection's opening); slower ones are answered 408 and the "
        "connection closed (default 10). Idle keep-alive connections: --timeout-keep-alive",
    )
    add_env_argument(
        g,
        "--body-timeout",
        type=float,
        default=S.body_timeout_s,
        help="seconds the server waits for the next part of a request body; the whole body "
        "must also arrive within this plus 1 s per 16 KiB. Slower bodies are answered 408 and "
        "the connection closed (default 30)",
    )
    add_media_args(g)
    add_env_argument(
        g,
        "--max-connections-per-client",
        type=int,
        default=S.max_connections_per_client,
        help="open connections one client address may hold (per API server process); more "
        "are answered 429 and closed at once. 0: no cap, for a server behind a proxy, where "
        "every client has the proxy's address (default 512)",
    )
    add_env_argument(
        g,
        "--fair-share",
        default=S.fair_share,
        choices=FAIR_SHARES,
        help="whose turns the scheduler takes: client (each client address one turn, however "
        "many requests it sends) or request (each request its own: behind a proxy, where "
        "every client has the proxy's address) (default client)",
    )
    add_env_argument(
        g,
        "--api-server-count",
        type=api_server_count,
        default="auto",
        help="HTTP front-end processes sharing the port and the replicas, or auto: one per "
        f"{CORES_PER_API_SERVER} cores this server may run on, 1 to {MAX_AUTO_API_SERVERS} (1 "
        f"below {MIN_CORES_FOR_MORE} cores, with --trace or under torchrun) (default auto). "
        "Each parses, tokenises, routes and "
        "serialises requests with a core of its own: raise it when one process is the limit "
        "(small models, many short requests; /metrics shows the process's own CPU). Above 1 "
        "the pipeline runs in replica processes even at --dp 1",
    )
    add_env_argument(
        g,
        "--state-dir",
        help="where the Batch API keeps its files and batches (SQLite and the files' bytes); "
        "a server started again on it resumes the batches left unfinished (default: "
        "$XDG_DATA_HOME/pipepool, else ~/.local/share/pipepool)",
    )
    add_env_argument(
        g,
        "--max-batch-requests",
        type=int,
        default=S.max_batch_requests,
        help="a batch input file with more requests fails validation (default 50000, OpenAI's "
        "own limit)",
    )
    add_env_argument(
        g,
        "--max-batch-file-bytes",
        type=int,
        default=S.max_batch_file_bytes,
        help="larger uploads to /v1/files are answered 413 (default 200 MiB, OpenAI's own "
        "limit); --max-body-bytes does not apply to them",
    )
    add_env_argument(
        g,
        "--max-concurrent-uploads",
        type=int,
        default=S.max_concurrent_uploads,
        help="uploads to /v1/files one front-end process receives at once; one more waits "
        f"--queue-wait for a slot, then is answered 429 (default {S.max_concurrent_uploads})",
    )
    add_env_argument(
        g,
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="what the log shows (default info)",
    )
    add_env_argument(
        g,
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text (timestamped lines) or json (one object per line) (default text)",
    )
    add_env_argument(
        g,
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log every request (default: on)",
    )
    add_engine_args(p, skip=("model",))


def run(args: argparse.Namespace) -> int:
    # The server extras are imported here only: the rest of pipepool must work without them
    # (cli.py turns their absence into one line naming the extra); torch only now, so that
    # `--help` is quick.
    from ..parallel.launch import deployment_for
    from ..parallel.multiproc import run_torchrun_worker
    from ..parallel.rendezvous import torchrun_env
    from ..server.api_servers import ApiServers
    from ..server.batch_store import close_open_stores
    from ..server.batch_thread import BatchThread
    from ..server.logs import log_config
    from ..server.online_gate import GATE
    from ..server.settings import ServerSettings
    from ..server.uvicorn_server import ANSWER_GRACE_S, build_server

    specs = model_specs(args)  # checked now: a bad flag fails before anything starts
    env_ranks = torchrun_env()
    if len(specs) > 1:
        _check_several(specs, under_torchrun=env_ranks is not None)
    config = specs[0].config
    front_ends = _front_ends(args.api_server_count, config, under_torchrun=env_ranks is not None)
    if env_ranks is not None and env_ranks.rank > 0:
        # Under torchrun every rank runs this command; only rank 0 serves HTTP, the others
        # are pipeline stages until rank 0 shuts the pipeline down.
        return run_torchrun_worker(deployment_for(config))
    for spec in specs:  # a bad model fails here, before any line says the server runs
        check_model(spec.config)
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        allow_token_ids=args.allow_token_ids,
        max_inputs_per_request=args.max_inputs_per_request,
        max_tokens_per_request=args.max_tokens_per_request,
        max_chunked_tokens=args.max_chunked_tokens,
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
        queue_wait_s=args.queue_wait,
        shutdown_timeout_s=args.shutdown_timeout,
        timeout_keep_alive_s=args.timeout_keep_alive,
        backlog=args.backlog,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections_per_client=args.max_connections_per_client,
        fair_share=args.fair_share,
        log_level=args.log_level,
        log_format=args.log_format,
        access_log=args.access_log,
        api_server_count=front_ends,
        state_dir=args.state_dir,
        max_batch_requests=args.max_batch_requests,
        max_batch_file_bytes=args.max_batch_file_bytes,
        max_concurrent_uploads=args.max_concurrent_uploads,
        **media_settings(args),
    )
    _check_queues(specs, settings)
    # A damaged Batch store refuses the start, naming the file and the recovery command.
    from ..server.store_check import open_checked

    open_checked(settings.batch_state_dir)
    logs = log_config(settings.log_level, settings.log_format)
    logging.config.dictConfig(logs)
    if args.api_server_count == "auto":
        log.info("--api-server-count auto: %d front-end process(es)", front_ends)
    if len(specs) > 1:
        specs = _planned(specs)
    url = f"http://{settings.host}:{settings.port}"
    for spec in specs:
        log.info(
            "loading %s; it will be served as %s",
            spec.config.model or f"{BUNDLED_MODEL_ID} (bundled)",
            spec.name,
        )
    # Once every model serves, this process's full collections wait for a second without an
    # online request in flight (``QuietCollections``, ``OnlineGate.settled``).
    collections = QuietCollections(quiet=GATE.settled)
    announce = _Announcer(
        _ready_line(specs, url), [spec.name for spec in specs], on_ready=collections.start
    )

    # With more API server processes, the replicas listen for them in a directory only this
    # user can enter, and the port is bound now, so that they can share its socket.
    api_servers = sockets = socket_dir = None
    if settings.api_server_count > 1:
        socket_dir = tempfile.mkdtemp(prefix="pipepool-")
    models = _served_models(specs, socket_dir, settings)

    def started() -> None:  # on the server's event loop, once it listens
        announce.server_started()
        batches.start()

    interval = switch_interval.for_configs([spec.config.switch_interval_ms for spec in specs])
    server = build_server(settings, models, logs, on_started=started, switch_interval_s=interval)
    # Only this process runs batches (the other front-end processes serve their routes), in a
    # thread of its own: its lines never queue in the loop that answers online requests.
    batches = BatchThread(settings, models, stopping=lambda: server.should_exit)
    if socket_dir is not None:
        try:
            sockets = [server.config.bind_socket()]  # exits naming the error if it cannot
        except BaseException:
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        api_servers = ApiServers(
            settings, _api_models(specs, socket_dir), sockets[0], announce.api_ready
        )
        server.on_shutdown = api_servers.begin_stop
        announce.wait_for_api_servers(settings.api_server_count - 1)

    def stop_serving(_exc: BaseException) -> None:
        server.should_exit = True  # uvicorn's loop checks this flag on every tick

    # uvicorn re-raises SIGTERM once it has drained, with the handler it found installed;
    # this one lets run() go on to stop the stages and exit 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    for model in models:
        owner = model.front.owner
        owner.start(
            on_failure=_on_failure(owner, stop_serving, alone=len(models) == 1),
            on_ready=lambda _engine, name=model.name: announce.engine_ready(name),
        )
    try:
        if api_servers is not None:
            api_servers.start()
        server.run(sockets=sockets)
    finally:
        if api_servers is not None:  # they drain their own requests on the replicas first
            api_servers.wait(settings.shutdown_timeout_s + ANSWER_GRACE_S)
            assert socket_dir is not None, "made for the API servers"
            shutil.rmtree(socket_dir, ignore_errors=True)
        batches.join(ANSWER_GRACE_S)
        # Checkpointed: the database file alone is then a complete copy of the records.
        close_open_stores()
        collections.stop()
        for model in models:
            model.front.close()
        for model in models:
            model.front.owner.close()
        signal.signal(signal.SIGTERM, previous)
    for model in models:
        if model.front.owner.error is not None:
            raise model.front.owner.error
    if not server.started:
        print("pipepool serve: the server did not start (see the log above)", file=sys.stderr)
        return 1
    return 0


def _served_models(specs: list[ModelSpec], socket_dir: str | None, settings: ServerSettings):
    """Each model's engine owner and front end (its own queue). Several models run each in
    processes of its own (replicas, at --dp 1 too): one dying restarts without the others; each
    has a tokenizer helper process for its large batches in each front-end process
    (``settings.api_server_count``). With ``socket_dir`` (more API server processes) model i's
    replicas listen in ``model_socket_dir(socket_dir, i)``."""
    from ..api.engine import Engine
    from ..replicas.pipeline import ReplicaPipeline
    from ..server.api_servers import model_socket_dir
    from ..server.front import AsyncEngine
    from ..server.models import ModelNames, ServedModel, ServedModels
    from ..server.owner import EngineOwner, model_engine

    several = len(specs) > 1

    def builder(config, where: str | None) -> Callable[[], Engine]:
        if not several and socket_dir is None:
            return lambda: Engine.from_config(config)
        return lambda: model_engine(
            config, ReplicaPipeline, where, beside_others=several,
            front_ends=settings.api_server_count,
        )  # fmt: skip

    out = []
    for i, spec in enumerate(specs):
        where = None if socket_dir is None else model_socket_dir(socket_dir, i)
        build = builder(spec.config, where)
        front = AsyncEngine(
            EngineOwner(build), max_queued=spec.max_queued_requests,
            queue_wait=settings.queue_wait_s,
        )  # fmt: skip
        out.append(ServedModel(ModelNames(spec.names, spec.tasks), front))
    return ServedModels(out)


def _api_models(specs: list[ModelSpec], socket_dir: str):
    """What the other front-end processes serve: each model, and where its replicas listen."""
    from ..server.api_servers import ApiModel, model_socket_dir

    return [
        ApiModel(s.names, s.tasks, s.config, s.max_queued_requests, model_socket_dir(socket_dir, i))
        for i, s in enumerate(specs)
    ]


def _on_failure(owner, stop_serving, *, alone: bool):
    """What a model's engine failing means: a model that failed to load stops the server (it
    exits non-zero, naming why); one that fails for good later stops it too when it is the
    only model, while the others of a server of several go on (``/health`` says ``failed``
    for it, and its requests are answered 503)."""

    def failed(cause: BaseException) -> None:
        if alone or owner.engine is None:
            stop_serving(cause)

    return failed


def _planned(specs: list[ModelSpec]) -> list[ModelSpec]:
    """The models with their memory plan's configs (``replicas.memory_plan``), the plan logged;
    refused, with its numbers, when they do not fit."""
    from dataclasses import replace

    from ..core.dual_encoders import DUAL_ENCODERS
    from ..loading.model_folder import read_model_folder
    from ..replicas.memory_plan import plan_memory

    # A dual encoder's vision tower runs in replicas of its own (server/owner.py): planned
    # beside its text tower, so that the text tower's KV cache leaves it room.
    towers = [
        (f"{spec.name}:vision", spec.config.replace(tower="vision"))
        for spec in specs
        if read_model_folder(spec.config.model).architecture in DUAL_ENCODERS
    ]
    plan = plan_memory([*((spec.name, spec.config) for spec in specs), *towers])
    log.info("%s", plan.describe())
    planned = plan.models[: len(specs)]
    return [replace(spec, config=m.config) for spec, m in zip(specs, planned, strict=True)]


def _ready_line(specs: list[ModelSpec], url: str) -> str:
    where = f"at {url}/v1 (OpenAI base_url; TEI routes /embed, /info at {url})"
    if len(specs) == 1:
        names = specs[0].names
        also = ", ".join(names[1:]) or "no other name"
        return f"ready: model {names[0]} (also accepted: {also}) {where}"
    return f"ready: models {', '.join(spec.name for spec in specs)} {where}"


def _check_several(specs: list[ModelSpec], *, under_torchrun: bool) -> None:
    from ..errors import InvalidInputError

    if under_torchrun:
        raise InvalidInputError(
            "several models run each in processes of its own on this host; under torchrun "
            "serve one model", param="model",
        )  # fmt: skip
    for spec in specs:
        if spec.config.trace:
            raise InvalidInputError(
                "--trace follows one pipeline in the server's own process: serve one model "
                "to trace it", param="trace",
            )  # fmt: skip


def _check_queues(specs: list[ModelSpec], settings) -> None:
    from ..errors import InvalidInputError

    for spec in specs:
        n = spec.max_queued_requests
        if not isinstance(n, int) or isinstance(n, bool) or n < settings.max_inputs_per_request:
            raise InvalidInputError(
                f"model {spec.name}: max_queued_requests={n!r} must be an integer of at least "
                f"max_inputs_per_request={settings.max_inputs_per_request}: a full-size "
                "request could never be queued",
                param="max_queued_requests",
            )


log = logging.getLogger("pipepool.server")


def check_model(config) -> None:
    """Fails, naming the problem, on a model the engine would refuse: the folder (or the hub
    id, fetched now), its config, architecture, every weight's name and shape, the options
    that depend on it (max_model_len, the layer split), as the engine's deployment plan checks
    them, and its tokenizer, as the engine loads it. Planned for the CPU: this process must not
    take GPU memory that replicas and stages will count as theirs; no weight is read."""
    from ..intake.inputs import InputPreparer
    from ..loading.deployment import plan_deployment, resolve_device_kind

    resolve_device_kind(config.device)  # "cuda" asked for on a host without it
    InputPreparer(plan_deployment(config.replace(device="cpu")))


def api_server_count(text: str) -> int | str:
    """``--api-server-count``'s value: a whole number of processes, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a whole number of processes or auto"
        ) from None


def _front_ends(asked: int | str, config, *, under_torchrun: bool) -> int:
    """The server's front-end processes: ``asked``, or for ``auto`` as many as the host's cores
    make (``auto_api_server_count``), one where more cannot run (``--trace``, torchrun)."""
    if asked == "auto":
        return 1 if under_torchrun or config.trace else auto_api_server_count()
    assert isinstance(asked, int), "api_server_count parses to a number or auto"
    if asked > 1:
        _check_api_servers(config, under_torchrun=under_torchrun)
    return asked


def _check_api_servers(config, *, under_torchrun: bool) -> None:
    from ..errors import InvalidInputError

    if under_torchrun:
        raise InvalidInputError(
            "--api-server-count > 1 runs the pipeline in replica processes on this host; under "
            "torchrun run one API server (rank 0)", param="api_server_count",
        )  # fmt: skip
    if config.trace:
        raise InvalidInputError(
            "--trace follows one pipeline in the server's own process: use it with "
            "--api-server-count 1", param="api_server_count",
        )  # fmt: skip


class _Announcer:
    """Logs ``message`` once the port is bound, every model is loaded and (with
    ``--api-server-count``) the other front-end processes serve, whichever comes last; never
    if one of them fails (a port in use must not be followed by a "ready" line). Then freezes
    what start-up made and calls ``on_ready``."""

    def __init__(self, message: str, models: list[str], on_ready: Callable[[], None]) -> None:
        self.message = message
        self.on_ready = on_ready
        self._lock = threading.Lock()
        self._waiting = {"port", *(f"model {name}" for name in models)}

    def wait_for_api_servers(self, count: int) -> None:
        with self._lock:
            self._waiting.add("api servers")
            self.message += f" with {count + 1} API server processes"

    def server_started(self) -> None:
        self._done("port")

    def engine_ready(self, name: str) -> None:
        self._done(f"model {name}")

    def api_ready(self) -> None:
        self._done("api servers")

    def _done(self, what: str) -> None:
        with self._lock:
            if what not in self._waiting:
                return
            self._waiting.discard(what)
            if not self._waiting:
                log.info(self.message)
                freeze_startup_objects()  # what exists now lives as long as the server
                self.on_ready()
