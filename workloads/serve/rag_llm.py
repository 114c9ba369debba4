"""`rag` over vLLM (`generator: llm`): the retriever's answer is written by the engine of an
`llm` app on the same cluster, called through Serve's handle to that app's ingress deployment,
which (`api: vllm`, what the kit generates) is Ray Serve LLM's `LLMServer` itself
(workloads/serve/llm_server.py): no HTTP hop, and no second engine.

Why a handle to the `llm` app rather than an engine of rag's own: a second engine of the same
model holds a second copy of the weights and its own KV cache (on GPUs vLLM reserves
`gpu_memory_utilization` of the device, so a second engine needs a second GPU; here each CPU
engine reserves its `--kv-cache-gib` of RAM), where one engine serves `llm`'s clients and
rag's alike and batches them together. The price is coupling: rag answers only while the
`llm` app runs, so rag checks that app (in `rayfleet serve-config` and where Serve builds the
app) and, at run time, answers a 503 naming it when it is gone.

The prompt is the client's messages with the retrieved documents put into the last user
message; vLLM renders it with the served model's chat template. The documents are cut to what
fits the engine's `max_model_len` less the answer's tokens, counted in UTF-8 bytes: byte-level
BPE tokenizers never make more tokens than bytes, so what is sent fits.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from rayfleet.errors import ConfigError
from workloads.serve.openai_api import SSE_DONE, APIError, sse

GENERATORS = ("lm", "llm")
LLM_IMPORT_PATH = "workloads.serve.llm:app_builder"
# Tokens kept for the chat template's own (role headers, special tokens).
TEMPLATE_RESERVE = 64
# With no max_model_len in the generator's config: the documents' bytes.
DEFAULT_CONTEXT = 4096
# How long a found generator is trusted before the controller is asked again.
RECHECK_S = 10.0


# --------------------------------------------------------------------------- checks

def _generator_problem(name: str, app: dict | None, where: str) -> str | None:
    """Why the app `name` (its Serve config, as written or as deployed) cannot be rag's
    generator, or None."""
    if app is None:
        return (f"app '{name}' is not {where}; deploy the `llm` app with rag (one Serve config: "
                "`rayfleet serve-config <llm config> <rag config>`)")
    if app.get("import_path") != LLM_IMPORT_PATH:
        return (f"app '{name}' is {app.get('import_path')!r}, not the kit's `llm` app "
                f"({LLM_IMPORT_PATH})")
    args = app.get("args") or {}
    if args.get("api") != "vllm":
        return (f"app '{name}' has api: {args.get('api')!r}; rag calls the engine that is the "
                "app's ingress, which is `api: vllm` (what workloads.serve.llm_config writes)")
    configs = args.get("llm_configs") or []
    model = (configs[0].get("model_loading_config") or {}).get("model_id") if len(
        configs) == 1 and isinstance(configs[0], dict) else None
    if not model:
        return f"app '{name}' names no model (args.llm_configs[0].model_loading_config.model_id)"
    return None


def check_generator_in(name: str, apps: list[dict]) -> None:
    """`rayfleet serve-config`: the generator app is in the same config (`serve deploy`
    replaces every app on the cluster with the file's, so one outside it would be deleted)."""
    app = next((a for a in apps if a.get("name") == name), None)
    problem = _generator_problem(name, app, "in this Serve config (serve deploy removes every "
                                            "app the file does not list)")
    if problem:
        raise ConfigError("args.generator_app", problem)


def check_generator_deployed(name: str) -> None:
    """Where Serve builds rag: the generator app is one the controller is deploying or runs."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    app = (details.get("applications") or {}).get(name)
    if app is not None and _value(app.get("status")) == "DELETING":
        app = None
    config = (app.get("deployed_app_config") or {}) if app is not None else None
    problem = _generator_problem(name, config, "on this cluster")
    if problem:
        raise ConfigError("args.generator_app", problem)


def _value(status: Any) -> str:
    return str(getattr(status, "value", status))


# --------------------------------------------------------------------------- the prompt

def pack_sources(sources: list[dict], room: int) -> str:
    """`# id: text` lines of the best documents within `room` bytes: a document is cut to
    what fits, and dropped when not even its name and a few words would."""
    out = b""
    for s in sources:
        line = f"# {s['id']}: {' '.join(s['text'].split())}\n".encode("utf-8")
        if room - len(out) < len(s["id"]) + 16:
            break
        if len(line) > room - len(out):
            line = line[:room - len(out) - 1].rstrip() + b"\n"
        out += line
    return out.decode("utf-8", errors="ignore")


def rag_messages(messages: list[dict], sources: list[dict], budget: int) -> list[dict]:
    """The client's messages, the last user message's question preceded by the documents
    that fit in `budget` bytes (all messages counted)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    question = messages[last]["content"]
    frame = "Answer the question using these documents.\n\n{docs}\nQuestion: {question}"
    used = sum(len(m["content"].encode("utf-8")) for m in messages) + len(frame)
    docs = pack_sources(sources, max(0, budget - used))
    out = [dict(m) for m in messages]
    out[last]["content"] = frame.format(docs=docs, question=question)
    return out


# --------------------------------------------------------------------------- the engine

class VLLMGenerator:
    """The `llm` app's engine, through Serve's handle to its ingress (LLMServer.chat)."""

    def __init__(self, app: str):
        self.app = app
        self._found: tuple[Any, str, int] | None = None
        self._checked = 0.0

    async def engine(self) -> tuple[Any, str, int]:
        """(handle, model id, max_model_len) of the generator app, or a 503 naming it."""
        if self._found is None or time.monotonic() - self._checked > RECHECK_S:
            try:
                self._found = await asyncio.to_thread(self._find)
            except APIError:
                self._found = None
                raise
            self._checked = time.monotonic()
        return self._found

    def _find(self) -> tuple[Any, str, int]:
        from ray import serve

        status = serve.status().applications.get(self.app)
        state = _value(status.status) if status is not None else "not deployed"
        if state not in ("RUNNING", "DEPLOYING"):
            raise APIError(503, f"the generator app '{self.app}' is not running on this "
                           f"cluster ({state}; see "
                           "`serve status`)", type="service_unavailable",
                           code="generator_unavailable")
        if self._found is not None:
            return self._found
        try:
            handle = serve.get_app_handle(self.app)
            config = handle.llm_config.remote().result(timeout_s=60)
        except Exception as e:   # not built yet, or not an LLMServer: one line, not a trace
            raise APIError(503, f"the generator app '{self.app}' does not answer yet "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                           type="service_unavailable", code="generator_unavailable") from None
        max_len = (config.engine_kwargs or {}).get("max_model_len") or DEFAULT_CONTEXT
        return handle, config.model_id, int(max_len)

    async def chat(self, body: dict) -> Any:
        """The engine's first answer and the rest of its stream: (first, stream)."""
        from ray.llm._internal.serve.core.configs.openai_api_models import \
            ChatCompletionRequest
        from pydantic import ValidationError

        handle = (await self.engine())[0]
        try:
            request = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            raise APIError(400, f"{param}: {first.get('msg')}" if param else first.get("msg"),
                           param=param, code="invalid_request") from None
        stream = handle.options(stream=True).chat.remote(request)
        first = await stream.__anext__()
        error = first[0] if isinstance(first, list) and first else first
        if hasattr(error, "error") and not hasattr(error, "choices"):
            raise APIError(int(error.error.code or 500), error.error.message,
                           type=error.error.type or "invalid_request_error",
                           param=getattr(error.error, "param", None))
        return first, stream


def as_answer(response: Any, model: str, rayfleet: dict) -> dict:
    """A non-streaming ChatCompletionResponse as rag answers it."""
    body = response.model_dump(exclude_none=True)
    return {**body, "model": model, "rayfleet": rayfleet}


async def as_stream(first: list, rest: AsyncIterator, model: str,
                    rayfleet: dict) -> AsyncIterator[str]:
    """vLLM's server-sent events re-sent under rag's model name; the first carries
    `rayfleet` (the sources), the usage chunk and `[DONE]` pass as vLLM sent them."""
    extra = rayfleet

    async def batches():
        yield first
        async for batch in rest:
            yield batch

    async for batch in batches():
        for event in batch if isinstance(batch, list) else [batch]:
            if not isinstance(event, str):   # an error mid-stream: OpenAI's error event
                error = getattr(event, "error", None)
                yield sse({"error": {"message": getattr(error, "message", str(event)),
                                     "type": getattr(error, "type", "server_error"),
                                     "param": None, "code": getattr(error, "code", None)}})
                continue
            for line in event.splitlines():
                if not line.startswith("data: "):
                    continue
                if line.strip() == SSE_DONE.strip():
                    yield SSE_DONE
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:   # vLLM's own error event, as it sent it
                    yield sse(chunk)
                    continue
                chunk["model"] = model
                if extra is not None:
                    chunk["rayfleet"], extra = extra, None
                yield sse(chunk)
