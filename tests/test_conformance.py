"""The peers' own OpenAPI documents against a real ``pipepool serve`` (issue 56 item 6):
schemathesis with every check over the operations pipepool claims for TEI, OpenAI and Cohere
(tests/conformance/peers.py), a fixed seed, a bounded number of examples per operation. Every
finding must be in the reviewed deviations list (tests/conformance/deviations.py), and every
entry there must still be found: the list says exactly where pipepool differs from each
document, and why.

Three servers, each serving one model as the peers do: the bundled all-MiniLM-L6-v2 (embedding
routes), a tiny cross-encoder (rerank routes) and a tiny SPLADE model (/embed_sparse), all with
an API key, so that the documents' security schemes are exercised too; besides the generated
requests, each operation gets its peer's documented example (peers.SEEDS).
PIPEPOOL_CONFORMANCE_EXAMPLES raises the examples per operation for a deeper run;
PIPEPOOL_CONFORMANCE_REPORT=DIR writes every finding of each peer, deviation or not, with a
request that shows it, to DIR/<peer>.txt (for reviewing the list).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import tiny_retrieval
from test_server import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent / "conformance"))
import deviations
import peers
import runner

pytestmark = pytest.mark.slow

API_KEY = "conformance-key"
EMBEDDER = "all-MiniLM-L6-v2"
EXAMPLES = int(os.environ.get("PIPEPOOL_CONFORMANCE_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, cross_encoder_path):
    """peers.SERVERS name -> (server, the name its model answers to)."""
    logs = tmp_path_factory.mktemp("conformance-logs")
    splade = tiny_retrieval.build_splade(tmp_path_factory.mktemp("conformance-models") / "splade")
    models = {"embedder": None, "reranker": cross_encoder_path, "sparse": splade}
    started = {}
    try:
        for name, folder in models.items():
            # Token ids are inputs TEI's and OpenAI's documents define; a state folder of its
            # own, so that files other tests upload do not change what the list routes answer.
            args = ["--api-key", API_KEY, "--allow-token-ids"]
            args += ["--state-dir", str(tmp_path_factory.mktemp(f"{name}-state"))]
            args += ["--model", str(folder)] if folder is not None else []
            started[name] = ServerProcess(args, logs / f"{name}.log")
        yield {
            name: (server.wait_ready(), EMBEDDER if models[name] is None else models[name].name)
            for name, server in started.items()
        }
    finally:
        for server in started.values():
            server.stop()


@pytest.mark.skipif(
    bool(peers.specs_missing()),
    reason=f"the peers' API documents ({', '.join(peers.specs_missing())}) are not in "
    "shared/conformance/specs/ nor tests/conformance/specs/: they are fetched, not committed "
    "(tests/conformance/SOURCES.md says how to make them)",
)
@pytest.mark.parametrize("peer", sorted(peers.CLAIMED))
def test_peer_document_conformance(servers, peer):
    spec = peers.spec_path(peer)
    findings: list[runner.Finding] = []
    sent = 0
    for name, (server, model) in servers.items():
        operations = peers.claimed_for(peer, name)
        if not operations:
            continue
        found, count = runner.run_peer(
            peer,
            spec,
            server.url + peers.BASE_PATHS[peer],
            operations,
            model=model,
            seeds={path: bodies for (p, path), bodies in peers.SEEDS.items() if p == peer},
            api_key=API_KEY,
            auth_scheme=peers.AUTH_SCHEMES[peer],
            max_examples=EXAMPLES,
        )
        findings += found
        sent += count
        assert "Traceback" not in server.log(), server.log()
    assert sent > 0
    report_dir = os.environ.get("PIPEPOOL_CONFORMANCE_REPORT")
    if report_dir:
        Path(report_dir).mkdir(parents=True, exist_ok=True)
        text = "\n\n".join(f.describe() for f in findings)
        (Path(report_dir) / f"{peer}.txt").write_text(f"{sent} requests\n\n{text}\n")
    unexpected, stale = deviations.compare(peer, findings)
    report = []
    if unexpected:
        report.append("findings not in tests/conformance/deviations.py:")
        report += [f.describe() for f in unexpected]
    if stale:
        report.append("deviations no longer found (remove them):")
        report += [f"{d.operation}: {d.check} ({d.reason})" for d in stale]
    assert not report, "\n".join(report)
