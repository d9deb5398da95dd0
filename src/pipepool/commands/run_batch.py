"""``pipepool run-batch -i BATCH.jsonl -o RESULTS.jsonl``: a file of OpenAI batch requests
answered offline, a drop-in for ``vllm run-batch``.

Each input line ``{"custom_id", "method": "POST", "url", "body"}`` is answered by the
server's own app, built in this process over a local engine (the routes of ``pipepool
serve``: the same validation, limits, errors and status codes), and its output line
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` is
appended to the output file as soon as it is answered; lines that failed are in the same file,
with their error status and body (or ``error``), as vLLM writes them.

Resumable: run the same command again after an interruption (Ctrl-C, a kill) and the lines
in the output file stay (a torn last line is dropped); only the requests not in it are run.
The input is read as it goes and each output line written at once: memory stays flat.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from .common import add_engine_args, add_env_argument, engine_config
from .line_progress import LineProgress
from .media_args import add_media_args, media_settings

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..jobs.batch_lines import LineResult, WrittenLines
    from ..server.settings import ServerSettings


def add_parser(sub, help: str) -> None:
    p = sub.add_parser("run-batch", help=help, description=help)
    p.add_argument(
        "-i",
        "--input-file",
        type=Path,
        required=True,
        help="the batch file: one request per line, {custom_id, method: POST, url, body}, url "
        "one of /v1/embeddings, /v1/rerank, /v1/score, /v1/classify, /v1/embed, /v2/embed",
    )
    p.add_argument(
        "-o",
        "--output-file",
        type=Path,
        required=True,
        help="where each request's output line is appended ({id, custom_id, response: "
        "{status_code, request_id, body}, error}); if it holds lines of an interrupted run, "
        "those stay and only the other requests run",
    )
    add_env_argument(
        p,
        "--served-model-name",
        help="more names the lines' 'model' may give, comma-separated (always accepted: the "
        "hub id, its short name, the folder name)",
    )
    add_media_args(p)
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    # The server's modules (its extras) and torch are imported now only: `--help` stays quick.
    from ..jobs.batch_lines import WrittenLines
    from ..server.batch_runner import EngineFailedError
    from ..server.models import served_model_names
    from ..server.settings import ServerSettings

    source, output = args.input_file, args.output_file
    if not source.is_file():
        raise InvalidInputError(f"no input file {source}", param="input_file")
    if output.resolve() == source.resolve():
        raise InvalidInputError("the output file is the input file", param="output_file")
    written = WrittenLines.of_output(output) if output.exists() else WrittenLines()
    if written.count:
        print(f"resuming: {output} holds {written.count} lines already", file=sys.stderr)
    config = engine_config(args)
    settings = ServerSettings(access_log=False, **media_settings(args))
    names = served_model_names(args.model, args.served_model_name)
    try:
        answered, failed = _run(settings, config, names, source, output, written)
    except KeyboardInterrupt:
        print(
            f"pipepool run-batch: interrupted; {output} keeps the lines answered so far: run "
            "the same command again to answer the rest",
            file=sys.stderr,
        )
        raise
    except EngineFailedError as exc:
        print(f"pipepool run-batch: {exc}; run the same command again to resume", file=sys.stderr)
        return 1
    total = written.count + answered + failed
    print(
        f"{total} lines in {output}: this run answered {answered + failed} "
        f"({failed} of them failed; each failed line holds its error)",
        file=sys.stderr,
    )
    return 0


def _run(
    settings: ServerSettings,
    config: EngineConfig,
    names: tuple[str, ...],
    source: Path,
    output: Path,
    written: WrittenLines,
) -> tuple[int, int]:
    """Load the engine, answer the lines ``written`` does not hold, with the model named by
    any of ``names``; (answered 2xx, failed)."""
    from ..api.engine import Engine
    from ..jobs.batch_lines import LineChecker, numbered_lines, read_lines
    from ..server.app import build_app
    from ..server.batch_runner import Dispatcher, run_lines
    from ..server.batch_thread import window_for
    from ..server.front import AsyncEngine
    from ..server.models import ServedModels
    from ..server.owner import EngineOwner

    print(f"run-batch: loading {names[0]}", file=sys.stderr, flush=True)
    owner = EngineOwner(lambda: Engine.from_config(config))
    front = AsyncEngine(owner, max_queued=settings.max_queued_requests)
    owner.start(on_failure=lambda _exc: None)  # its error is read below, and by the lines
    try:
        owner.loaded.wait()
        if owner.error is not None:
            raise owner.error
        app = build_app(settings, ServedModels.one(front, names))
        with open(source, "rb") as lines:
            total = sum(1 for _ in numbered_lines(lines))
        progress = LineProgress("run-batch", total, done=written.count)
        print(
            f"run-batch: model loaded; {total - written.count:,} of {total:,} lines to answer",
            file=sys.stderr,
            flush=True,
        )

        async def answer_all() -> None:
            dispatcher = Dispatcher(
                app, api_key=None, engine_failed=lambda: owner.error is not None
            )
            with open(output, "ab") as out:

                def write(results: list[LineResult]) -> None:
                    out.write(b"".join(r.text for r in results))
                    out.flush()  # each line in the file as soon as it is answered
                    ok = sum(r.ok for r in results)
                    progress.add(ok, len(results) - ok)

                items = read_lines(source, LineChecker(), written.skip)
                try:
                    await run_lines(items, dispatcher, write, window_inputs=window_for(settings))
                finally:
                    await dispatcher.aclose()

        asyncio.run(answer_all())
        progress.finish()
        return progress.answered, progress.failed
    finally:
        front.close()
        owner.close()
