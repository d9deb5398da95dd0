"""The OpenAI-compatible HTTP server (``pipepool serve``).

Needs the ``server`` extras (fastapi, uvicorn, pydantic). Nothing outside this package and
``commands/serve.py``'s ``run()`` imports it, so the engine works without them.

Modules, in the order a request meets them: ``settings`` (limits and names), ``guards`` (API
key and body size, before any parsing), ``protocol`` (request and response bodies), ``app``
(the routes), ``front`` (the engine seen from the event loop), ``owner`` (the thread that
builds and closes the engine), ``errors`` (OpenAI-style error bodies), ``metrics``
(Prometheus text).
"""
