"""``/docs``: the API reference as one plain HTML page rendered here from the OpenAPI schema.

FastAPI's own page fetches Swagger UI from a CDN and is blank on a machine without internet;
this one needs nothing but the server. The machine-readable schema stays at /openapi.json.
"""

from __future__ import annotations

import html
import json

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

router = APIRouter()

_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
    "h2{border-top:1px solid #ccc;padding-top:1rem}code,pre{background:#f4f4f4}"
    "pre{padding:.5rem;overflow-x:auto;font-size:.85rem}.m{font-weight:bold;color:#063}"
)


@router.get("/docs", include_in_schema=False)
async def page(request: Request) -> HTMLResponse:
    return HTMLResponse(render(request.app.openapi()))


def render(schema: dict) -> str:
    info = schema.get("info", {})
    parts = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>{html.escape(info.get('title', 'API'))}</title><style>{_STYLE}</style>",
        f"<h1>{html.escape(info.get('title', ''))} {html.escape(info.get('version', ''))}</h1>",
        f"<p>{html.escape(info.get('description', ''))}</p>",
        "<p>Schema: <a href='/openapi.json'>/openapi.json</a></p>",
    ]
    components = schema.get("components", {}).get("schemas", {})
    for path, methods in schema.get("paths", {}).items():
        for method, op in methods.items():
            parts.append(
                f"<h2><span class='m'>{method.upper()}</span> <code>{html.escape(path)}</code>"
                f"</h2><p>{html.escape(op.get('summary', ''))}</p>"
            )
            if op.get("description"):
                parts.append(f"<p>{html.escape(op['description'])}</p>")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            ref = body.get("schema", {}).get("$ref", "")
            if ref:
                name = ref.rsplit("/", 1)[-1]
                fields = components.get(name, {}).get("properties", {})
                rows = "".join(
                    f"<tr><td><code>{html.escape(k)}</code></td>"
                    f"<td>{html.escape(v.get('description', ''))}</td></tr>"
                    for k, v in fields.items()
                )
                parts.append(f"<p>Request body <code>{name}</code>:</p><table>{rows}</table>")
                parts.append(
                    f"<pre>{html.escape(json.dumps(components.get(name), indent=1))}</pre>"
                )
    return "\n".join(parts)
