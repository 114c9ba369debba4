"""The `llm` app's replica as its own ingress (`api: vllm`, what the kit ships): Ray Serve LLM's
`LLMServer` serving vLLM's own OpenAI server (its FastAPI app, in the replica, beside the
engine), as Ray 2.60's direct streaming builds it. No OpenAI ingress deployment in front, so
no handle call and no pickled chunk per streamed token between two replicas: that hop was most
of Serve's CPU per request (docs/benchmarks.md, "Where Serve LLM's CPU went").

What Ray's OpenAI ingress did that vLLM's app does not, done here in the replica:

- LoRA by model id. A request for `<model>:<adapter>` loads that adapter from the app's
  `lora_config` (Ray's own loader: the replica's cache of `max_num_adapters_per_replica`) and
  hands it to vLLM before vLLM reads the request. Ray does this in an ingress request router
  (`LLMRouter`) that needs HAProxy's Lua, which the kit's HAProxy guard refuses.
- `/v1/models` lists the adapters the bucket holds, with Ray's model cards, as before.

Imported only by Serve, by name, after workloads.serve.llm has checked that vLLM imports (Ray
Serve LLM's server needs it). tests/fakecloud/llm_checks.py and the README's Hugging Face line
(tests/cluster/test_readme.py) fail when Ray moves what this uses.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import HTTPException
from fastapi.routing import APIRoute
from ray.llm._internal.common.utils.lora_utils import get_lora_model_ids
from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard, ModelList, \
    to_model_metadata
from ray.llm._internal.serve.core.server.llm_server import LLMServer, \
    _add_middleware_to_built_app
from ray.llm._internal.serve.utils.lora_serve_utils import get_lora_model_metadata
from ray.llm._internal.serve.utils.server_utils import get_response_for_error, \
    get_serve_request_id
from starlette.responses import JSONResponse

# A request body larger than this is vLLM's to refuse: it is passed on unread.
MAX_PEEK_BYTES = 64 << 20


class EngineIngress(LLMServer):
    """LLMServer whose ASGI app (vLLM's) also serves LoRA adapters by model id."""

    async def __serve_build_asgi_app__(self):
        app = await super().__serve_build_asgi_app__()
        _list_models(app, self._llm_config)
        if self._llm_config.lora_config is not None:
            _add_middleware_to_built_app(app, AdapterByModelId, server=self)
        return app


class AdapterByModelId:
    """ASGI middleware: before vLLM reads a POST body naming `<base>:<adapter>`, that adapter
    is loaded (once per replica) and registered with the engine under that name; an adapter
    the bucket lacks is OpenAI's 404, as Ray's ingress answered it."""

    def __init__(self, app, *, server: EngineIngress) -> None:
        self.app = app
        self.server = server
        self.prefix = server._llm_config.model_id + ":"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more and size <= MAX_PEEK_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        body = b"".join(chunks)   # joined once: a large body arrives in many small messages
        model = _model_of(body)
        if model and model.startswith(self.prefix):
            try:
                await self.server.engine.resolve_lora(await self.server._load_model(model))
            except HTTPException as e:
                error = get_response_for_error(e, get_serve_request_id())
                await JSONResponse(error.model_dump(), status_code=e.status_code)(
                    scope, receive, send)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": more}

        await self.app(scope, replay, send)


def _model_of(body: bytes) -> str | None:
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) else None


def _list_models(app, llm_config) -> None:
    """GET /v1/models as Ray's OpenAI ingress answers it: the model's card, then one per
    adapter folder under the lora_config's path (an adapter whose config cannot be read is
    left out, as Ray leaves it out)."""
    app.router.routes[:] = [r for r in app.router.routes if not (
        isinstance(r, APIRoute) and r.path == "/v1/models" and "GET" in r.methods)]
    base = llm_config.model_id
    card = to_model_metadata(base, llm_config)
    path = llm_config.lora_config.dynamic_lora_loading_path if llm_config.lora_config else None

    @app.get("/v1/models", response_model=ModelList)
    async def _models():
        cards = [card]
        # A bucket listing: off the event loop that streams every answer.
        for model_id in await asyncio.to_thread(get_lora_model_ids, path, base) if path else ():
            try:
                overrides = await get_lora_model_metadata(model_id, path)
            except HTTPException:
                continue
            cards.append(ModelCard(id=model_id, object="model", owned_by=card.owned_by,
                                   permission=list(card.permission),
                                   metadata={**card.metadata, **overrides}))
        return ModelList(data=cards)
