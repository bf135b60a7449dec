"""The disaggregated peer's front for bench/pd.py: vLLM's own two-server disaggregation (a prefill `vllm serve` and a
decode `vllm serve`, each with a KV connector) needs a proxy that runs vLLM's KV-transfer protocol, as vLLM's
examples do (their proxy is not in the vLLM wheel; this one follows the same protocol):

1. POST the request to the prefill server with `max_tokens: 1`, no stream and
   `kv_transfer_params: {do_remote_decode: true, ...}`;
2. POST it to the decode server with the prefill answer's `kv_transfer_params`, and stream that answer back.

    python bench/pd_proxy.py --port P --prefill http://127.0.0.1:A --decode http://127.0.0.1:B
"""

from __future__ import annotations

import argparse

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def make_app(prefill_url: str, decode_url: str) -> Starlette:
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))

    async def completions(request: Request) -> Response:
        payload = await request.json()
        first = {k: v for k, v in payload.items() if k not in ("stream", "stream_options", "n")}
        first.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PARAMS))
        r = await client.post(prefill_url + request.url.path, json=first)
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type="application/json")
        params = r.json().get("kv_transfer_params")
        body = {**payload, **({"kv_transfer_params": params} if params else {})}
        decode = client.build_request("POST", decode_url + request.url.path, json=body)
        upstream = await client.send(decode, stream=True)

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(
            relay(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type", "application/json"),
        )

    async def models(request: Request) -> Response:
        r = await client.get(decode_url + "/v1/models")
        return Response(r.content, r.status_code, media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    ns = p.parse_args()
    uvicorn.run(make_app(ns.prefill, ns.decode), host="127.0.0.1", port=ns.port, log_level="warning")


if __name__ == "__main__":
    main()
