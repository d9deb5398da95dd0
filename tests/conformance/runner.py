"""schemathesis over one peer's OpenAPI document against a running ``pipepool serve``: every
check, the claimed operations only, a bounded number of examples each, a fixed seed (the same
code gives the same findings, so the deviations list can be exact).

Beyond schemathesis's checks, ``answered_2xx``: each claimed operation answered at least one
request with a 2xx (a route that is missing, or refuses everything, passes most checks, since a
404 is an acceptable answer to one valid request).

A request's ``model`` field is set to the served model's name: which names a server answers to
is deployment data, as its base URL is, and the peers' own servers refuse unknown names too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events

SEED = 20261205


@dataclass(frozen=True)
class Finding:
    """One failed check on one operation, with a request that shows it."""

    peer: str
    operation: str  # "POST /embed", the peer document's path
    check: str  # schemathesis's check name (not_a_server_error, ...)
    title: str
    message: str
    curl: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.peer, self.operation, self.check)

    @property
    def status(self) -> int | None:
        """The response status whose schema a response_schema_conformance finding is about."""
        found = re.search(r"schema for status code (\d+)", self.message)
        return int(found.group(1)) if found else None

    def describe(self) -> str:
        message = " ".join(self.message.split())[:400]
        return (
            f"[{self.peer}] {self.operation}: {self.check} ({self.title}): {message}\n  {self.curl}"
        )


def _config(
    base_url: str, max_examples: int, api_key: str, auth_scheme: str | None
) -> SchemathesisConfig:
    auth: dict = {}
    headers: dict = {}
    if auth_scheme is None:
        headers = {"Authorization": f"Bearer {api_key}"}
    else:
        auth = {"auth": {"openapi": {auth_scheme: {"bearer": api_key}}}}
    return SchemathesisConfig.from_dict(
        {
            **auth,
            "headers": headers,
            "seed": SEED,
            "base-url": base_url,
            "request-timeout": 60,
            "continue-on-failure": True,
            "generation": {
                "max-examples": max_examples,
                "deterministic": True,
                "mode": "all",
                "database": "none",
            },
            "checks": {"enabled": True},
            "phases": {"stateful": {"enabled": False}},
            "warnings": False,
            # The requests in findings are shown whole (its default masks "token"-like fields).
            "output": {"sanitization": {"enabled": False}},
        }
    )


def run_peer(
    peer: str,
    spec: Path,
    base_url: str,
    operations: dict[str, tuple[str, ...]],
    *,
    model: str,
    seeds: dict[str, tuple[dict, ...]],
    api_key: str,
    auth_scheme: str | None,
    max_examples: int,
) -> tuple[list[Finding], int]:
    """The findings of schemathesis on ``operations`` (path -> methods) of ``spec``, and how
    many requests it sent; ``seeds``: bodies (path -> bodies) sent besides the generated."""
    config = _config(base_url, max_examples, api_key, auth_scheme)
    schema = schemathesis.openapi.from_path(spec, config=config)
    claimed = {(m.upper(), p) for p, methods in operations.items() for m in methods}
    schema = schema.include(
        lambda ctx: (ctx.operation.method.upper(), ctx.operation.path) in claimed
    )

    @schema.hook
    def map_body(context, body):  # schemathesis calls hooks by signature
        if isinstance(body, dict) and "model" in body:
            return {**body, "model": model}
        return body

    @schema.hook
    def before_add_examples(context, examples):  # schemathesis calls hooks by signature
        for case in examples:
            case.body = map_body(context, case.body)
        operation = context.operation
        for body in seeds.get(operation.path, ()):
            seed = operation.Case(
                body=map_body(context, body),
                media_type="application/json",
                headers={"Authorization": f"Bearer {api_key}"},  # as the generated cases get it
            )
            # The key is the configured one, as schemathesis marks a case its auth provider
            # filled (else ignored_auth takes a 200 to it for a guessed key being accepted).
            seed._has_explicit_auth = True
            examples.append(seed)

    findings: dict[tuple, Finding] = {}
    statuses: dict[str, set[int]] = {f"{m.upper()} {p}": set() for m, p in sorted(claimed)}
    sent = 0
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.FatalError):
            raise RuntimeError(f"schemathesis could not run on {spec}: {event.exception!r}")
        if isinstance(event, events.NonFatalError):
            raise RuntimeError(f"schemathesis error on {event.label}: {event.info.message}")
        if not isinstance(event, events.ScenarioFinished):
            continue
        sent += len(event.recorder.interactions)
        for interaction in event.recorder.interactions.values():
            if interaction.response is not None:
                statuses.setdefault(event.recorder.label, set()).add(
                    interaction.response.status_code
                )
        for checks in event.recorder.checks.values():
            for node in checks:
                info = node.failure_info
                if info is None:
                    continue
                label = event.recorder.label
                finding = Finding(
                    peer=peer,
                    operation=label,
                    check=node.name,
                    title=info.failure.title,
                    message=info.failure.message,
                    curl=info.code_sample,
                )
                # One finding per check, title and response status: a wrong error body and
                # a wrong success body on one operation are two findings.
                findings.setdefault((finding.key, finding.title, finding.status), finding)
    for operation, seen in statuses.items():
        if not any(200 <= status < 300 for status in seen):
            finding = Finding(
                peer=peer,
                operation=operation,
                check="answered_2xx",
                title="No request answered with a 2xx",
                message=f"statuses seen: {sorted(seen)}",
                curl="",
            )
            findings[(finding.key, finding.title, None)] = finding
    return sorted(findings.values(), key=lambda f: (f.operation, f.check, f.title)), sent
