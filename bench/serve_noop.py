"""Serve's floor: a deployment with `lm`'s route shape (FastAPI ingress, `POST
/v1/completions` with the same pydantic request body, `GET /health`) that answers at once
with a fixed completion. Deployed under Serve and run on bare uvicorn by
`bench.serve_latency`, its p50 gap is what Serve itself costs per request on this machine;
`lm`'s gap minus this one is what the `lm` app adds."""

import time

from fastapi import FastAPI
from ray import serve

from workloads.serve.openai_api import CompletionRequest

api = FastAPI()
ANSWER = {"id": "cmpl-noop", "object": "text_completion", "model": "noop",
          "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}],
          "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}


class NoOpCore:
    """The handler, outside Serve's decorators so the bare side runs the same code."""

    async def completions(self, body: CompletionRequest) -> dict:
        return {**ANSWER, "created": int(time.time())}

    async def health(self) -> dict:
        return {"status": "ok", "model": "noop"}


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=32)
@serve.ingress(api)
class NoOp(NoOpCore):
    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> dict:
        return await super().completions(body)

    @api.get("/health")
    async def health(self) -> dict:
        return await super().health()


app = NoOp.bind()


def bare_app(prefix: str) -> FastAPI:
    """The same handler on a plain FastAPI app, routes under `prefix` as on Serve."""
    bare, core = FastAPI(), NoOpCore()

    @bare.post(f"{prefix}/v1/completions")
    async def completions(body: CompletionRequest) -> dict:
        return await core.completions(body)

    @bare.get(f"{prefix}/health")
    async def health() -> dict:
        return await core.health()

    return bare
