"""KV-cache routing's ground truth on the installed vLLM, in-process (no Ray): the engine publishes its KV events on a
Unix socket, `KVEvents` indexes them by content, and the router's side — the model's tokenizer and chat template,
`kv_blocks.chain` — names the same blocks for the same request: every full block of a completion's and a chat's
prompt is found in the index (followed through the change log); a LoRA adapter's blocks are its own; removing
the engine's cached blocks (vLLM's reset_prefix_cache) empties the index.

Routing on these indexes with real replicas: `test_engine_features.py` (several models and LoRA adapters on the direct
path) and `test_disaggregation.py` (a prefill pool)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)


def test_an_engines_kv_events_name_the_blocks_the_router_computes(tmp_path):
    import asyncio

    from app.clusters.tiny_model import make_tiny_lora, make_tiny_model
    from deployments import engine as vllm_adapter
    from deployments.http.asgi import stream_asgi
    from deployments.http.protocol import HTTPRequest, ResponseStart
    from deployments.routing.kv_blocks import BlockView, chain
    from deployments.routing.kv_tokens import PromptTokens
    from deployments.server.kv_events import KVEvents, event_sockets

    model = make_tiny_model(tmp_path / "m")
    adapter = make_tiny_lora(model, tmp_path / "sql", seed=1)
    template = "serve_configs/templates/llama3.1-json-tools.jinja"
    sockets = event_sockets()
    kwargs = {
        "max_model_len": 2048,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "kv_cache_memory_bytes": 64 << 20,
        "enable_lora": True,
        "max_loras": 1,
        "max_lora_rank": 8,
        "kv_events_config": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": sockets[0],
            "replay_endpoint": sockets[1],
            "topic": "kv",
        },
    }
    text = " ".join(f"Paragraph {i} of the ridge report: the wind turned north at dawn." for i in range(40))

    async def post(app, path: str, body: dict) -> dict:
        out = b""
        request = HTTPRequest("POST", path, json.dumps(body).encode(), headers=[(b"content-type", b"application/json")])
        async for item in stream_asgi(app, request):
            if not isinstance(item, ResponseStart):
                out += item
        return json.loads(out)

    async def settled(feed: KVEvents, view: BlockView) -> BlockView:
        """The view once the feed had nothing new for a whole long poll (the engine publishes each step's events)."""
        for _ in range(60):
            reply = await feed.changes(view.epoch, view.seq, wait_s=1.0)
            view.update(reply)
            if not reply["reset"] and not reply["changes"]:
                return view
        raise AssertionError("the KV events never settled")

    async def run() -> None:
        feed = KVEvents(*sockets, None, 100_000)
        await feed.start()  # subscribed before the engine binds, as a replica starts them
        args = vllm_adapter.serve_namespace(str(model), "m", kwargs, {"chat_template": template})
        engine_app = await vllm_adapter.start_engine_app(args, metrics=False)
        try:
            block_size = vllm_adapter.kv_block_size(engine_app.engine)
            feed.set_block_size(block_size)
            assert await vllm_adapter.load_adapter(engine_app, "tiny-sql", str(adapter), "m") is None
            tokens = PromptTokens(str(model), str(Path(template).resolve()))
            view = BlockView()

            completion = {"model": "m", "prompt": text, "max_tokens": 2, "temperature": 0}
            answer = await post(engine_app.app, "/v1/completions", completion)
            assert answer["usage"]["prompt_tokens"] > 3 * block_size, answer["usage"]
            view = await settled(feed, view)
            ids, cut = await tokens.of(completion)
            assert not cut and len(ids) == answer["usage"]["prompt_tokens"]
            blocks = chain(ids, block_size)
            assert len(blocks) == answer["usage"]["prompt_tokens"] // block_size
            assert view.held(blocks) == len(blocks), "the router's names for the prompt's blocks are not the engine's"
            assert view.held(chain(ids, block_size, "tiny-sql")) == 0  # the base model's blocks are not the adapter's

            chat = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}
            answer = await post(engine_app.app, "/v1/chat/completions", chat)
            view = await settled(feed, view)
            ids, _ = await tokens.of(chat)
            assert len(ids) == answer["usage"]["prompt_tokens"]  # the template, as vLLM renders it
            chat_blocks = chain(ids, block_size)
            assert view.held(chat_blocks) == len(chat_blocks) >= 3

            on_adapter = {**completion, "model": "tiny-sql", "prompt": text + " Tell it in SQL."}
            answer = await post(engine_app.app, "/v1/completions", on_adapter)
            assert answer["model"] == "tiny-sql", answer
            view = await settled(feed, view)
            ids, _ = await tokens.of(on_adapter)
            adapter_blocks = chain(ids, block_size, "tiny-sql")
            assert view.held(adapter_blocks) == len(adapter_blocks) >= 3  # the adapter's blocks, under its name
            assert view.held(chain(ids, block_size))  # and the base model's of the shared text are still there
            assert set(adapter_blocks).isdisjoint(blocks)
            assert feed.stats()["gaps"] == 0 and feed.stats()["unchained"] == 0

            await engine_app.engine.reset_prefix_cache()
            # the engine publishes at its next step: a prompt shorter than a block, which caches nothing
            await post(engine_app.app, "/v1/completions", {**completion, "prompt": "Hi"})
            view = await settled(feed, view)
            assert len(view) == 0 and len(feed.blocks) == 0, feed.stats()
        finally:
            vllm_adapter.shutdown_engine(engine_app.engine)

    asyncio.run(run())
