"""Each client's requests take one turn in the scheduler (``core.priority.client_turns``).

Calls take turns step by step; a client that sends a hundred requests at once would otherwise
get a hundred turns to another client's one. Keyed by the client's address (``--fair-share
client``, the default: ``front_door.FrontDoor`` makes each request's calls as its client's).
Behind a proxy every request has the proxy's address, so there ``--fair-share request`` gives
every request its own turn instead.
"""

from __future__ import annotations

FAIR_SHARES = ("client", "request")
