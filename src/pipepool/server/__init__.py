"""The OpenAI-compatible HTTP server (``pipepool serve``).

Needs the ``server`` extras (fastapi, uvicorn, pydantic). Nothing outside this package and
``commands/serve.py``'s ``run()`` imports it, so the engine works without them.

Modules, in the order a request meets them: ``settings`` (limits and names), ``metrics``
(counts and access-logs every request; Prometheus text), ``guards`` (API key, body size and
lone surrogates, before any parsing), ``protocol`` (request and response bodies), ``app`` (the
routes, in ``routes/``), ``limits`` (inputs and tokens per request, chunked tokens), ``front``
(the engine seen from the event loop), ``owner`` (the thread that builds and closes the
engine), ``errors`` (OpenAI-style error bodies).
"""
