"""Each client's requests take one turn in the scheduler (``core.priority.client_turns``).

Calls take turns step by step; a client that sends a hundred requests at once would otherwise
get a hundred turns to another client's one. Keyed by the client's address (``--fair-share
client``, the default). Behind a proxy every request has the proxy's address, so there
``--fair-share request`` gives every request its own turn instead.
"""

from __future__ import annotations

from ..core.priority import client_turns

FAIR_SHARES = ("client", "request")


class ClientTurns:
    """ASGI middleware: the app's engine calls for a request are made as its client's (its
    address), so that they share that client's turn."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        client = scope.get("client")
        if scope["type"] != "http" or not client:
            await self.app(scope, receive, send)
            return
        # The route's task runs in this context; AsyncEngine copies it to its threads.
        with client_turns(f"address:{client[0]}"):
            await self.app(scope, receive, send)
