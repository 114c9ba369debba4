"""The OpenAI-compatible HTTP API the kit's Serve apps share (`lm`, `rag`): request models,
OpenAI's error body, and a FastAPI app that answers every error with it, so the `openai`
client raises its usual BadRequestError / NotFoundError.

Errors use `{"error": {"message", "type", "param", "code"}}`: 400 for malformed, oversized or
too-long requests, 404 for an unknown model.
"""

# No `from __future__ import annotations`: FastAPI must see the request models as classes
# to read them from the body (as strings, through serve.ingress, they become query params).
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

MAX_BODY_BYTES = 1 << 20      # a request body over 1 MiB is refused before it is parsed
# An over-limit body up to this size is read and dropped before the refusal is sent: a client
# still sending it would otherwise meet a closed connection (a broken pipe, not the 400).
DRAIN_BYTES = 16 << 20
MAX_NEW_TOKENS = 1024


class APIError(Exception):
    """An expected request error, rendered as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def check_model(requested: str, served: str) -> None:
    """404 unless the request names the model this app serves."""
    if requested != served:
        raise APIError(404, f"The model '{requested}' does not exist; this server has "
                       f"'{served}' (GET /v1/models)", param="model", code="model_not_found")


# --------------------------------------------------------------------------- requests

class StreamOptions(BaseModel):
    # Clients that count tokens while streaming (LangChain, LiteLLM) ask for a last chunk
    # carrying `usage` (and `choices: []`), as OpenAI sends it.
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What completions and chat requests share: the model and how to sample."""
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def wants_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS)


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)

    def answer_tokens(self, default: int = 64) -> int:
        return self.max_completion_tokens or self.max_tokens or default


# --------------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_completion(model: str, text: str, finish: str, usage: dict, rayfleet: dict) -> dict:
    """A non-streaming `chat.completion` body; `rayfleet` carries the kit's extensions."""
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": usage, "rayfleet": rayfleet}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# --------------------------------------------------------------------------- the app

async def _api_error(_: Request, e: APIError):
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


async def _validation_error(_: Request, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        msg, param = "the request body is not valid JSON", None
    return JSONResponse(error_body(f"{param}: {msg}" if param else msg, "invalid_request_error",
                                   param, "invalid_request"), status_code=400)


async def _limit_body(request: Request, call_next):
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        if int(size) <= DRAIN_BYTES:
            async for _ in request.stream():  # never kept: at most one chunk in memory
                pass
        return JSONResponse(error_body(
            f"request body of {size} bytes is over the {MAX_BODY_BYTES}-byte limit",
            "invalid_request_error", None, "request_too_large"), status_code=400)
    return await call_next(request)


def add_error_handlers(app: FastAPI) -> FastAPI:
    """APIError and malformed requests answered with OpenAI's error body (status 400/404)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    return app


def openai_app(title: str) -> FastAPI:
    """A FastAPI app whose errors are OpenAI error bodies, bodies over MAX_BODY_BYTES refused."""
    app = add_error_handlers(FastAPI(title=title, docs_url=None, redoc_url=None))
    app.middleware("http")(_limit_body)
    return app
