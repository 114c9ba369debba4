"""`lm`: an OpenAI-compatible API over a checkpoint written by workloads.train (the kit's byte
GPT, the Hugging Face export in a final checkpoint's `hf/`, or a LoRA run's base + adapter), or
over any Hugging Face causal LM folder (config.json + safetensors + tokenizer; local or s3://),
with a PEFT LoRA adapter on top (`adapter`). The API's models and errors: openai_api.py; what a
replica loads: model_source.py; the engines: engines.py.

    serve run cluster-configs/serve/lm.yaml                       # foreground, local
    serve deploy cluster-configs/serve/lm.yaml                    # onto a running cluster
    serve run workloads.serve.lm:app_builder checkpoint=/path/to/checkpoint_000003
    serve run workloads.serve.lm:app_builder checkpoint=s3://bucket/models/my-llama

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events), GET /health, GET /v1/stats (batch sizes seen).

Every request goes through one `@serve.batch` generator: concurrent requests are decoded
together one token per step, and each request's tokens stream back as soon as they exist.
Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`, so the
`openai` client raises its usual BadRequestError / NotFoundError.
"""

# No `from __future__ import annotations`: FastAPI must see the request models as classes
# to read them from the body (as strings, through serve.ingress, they become query params),
# and Serve must see the builder's args model as a class.
import asyncio
import collections
import os
import time
from typing import Any, ClassVar

from fastapi.responses import StreamingResponse
from ray import serve

from workloads.serve.app_args import (
    LATEST,
    AppArgs,
    app_path,
    builder_errors,
    resolve_checkpoint,
)
from workloads.serve.engines import GenRequest
from workloads.serve.model_source import check_served, load_engine
from workloads.serve.openai_api import (
    MAX_NEW_TOKENS,
    SSE_DONE,
    APIError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    chat_completion,
    check_model,
    new_id,
    openai_app,
    sse,
    usage,
)

DEFAULT_MODEL_NAME = "rayfleet-lm"
BATCH_SIZES_KEPT = 1000


def chat_prompt(messages: list[ChatMessage]) -> str:
    # The model learned Python source, so the conversation is laid out as comments.
    return "".join(f"# {m.role}: {m.content}\n" for m in messages) + "# assistant:"


api = openai_app("rayfleet lm")


class LMCore:
    """The model and its batcher, without HTTP: LMServer adds the OpenAI routes on top, and
    LMGenerator serves it to other deployments through a DeploymentHandle (an application
    may hold only one FastAPI ingress)."""

    def __init__(self, checkpoint: str, model_name: str = DEFAULT_MODEL_NAME,
                 max_batch_size: int = 8, batch_wait_timeout_s: float = 0.05,
                 num_threads: int = 1, adapter: str = ""):
        import torch

        torch.set_num_threads(num_threads)
        self.engine = load_engine(checkpoint, adapter)
        self.model_name = model_name
        self.checkpoint = checkpoint
        self.adapter = adapter
        self.created = int(time.time())
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=BATCH_SIZES_KEPT)
        self._generate.set_max_batch_size(max_batch_size)
        self._generate.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.batch_wait_timeout_s = batch_wait_timeout_s

    def check_health(self) -> None:
        # Serve's health check: a replica whose model cannot run one step is replaced.
        self.engine.health_check()

    # ------------------------------------------------------------------ batching

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.05)
    async def _generate(self, reqs: list[GenRequest]):
        """Decode a batch together; yield, per step, one item per request: (token, n) while
        it runs, StopIteration once it is done (Serve's streaming-batch protocol). A request
        is done after max_tokens, at the engine's EOS, or when its context is full."""
        n = len(reqs)
        self.batch_sizes.append(n)
        seqs = [list(r.prompt) for r in reqs]
        gens = [self.engine.generator_for(r) for r in reqs]
        left = [r.max_tokens for r in reqs]
        done = [False] * n
        while not all(done):
            active = [i for i in range(n) if not done[i]]
            toks = await asyncio.to_thread(
                self.engine.step, [seqs[i] for i in active], [reqs[i] for i in active],
                [gens[i] for i in active])
            out: list[Any] = [StopIteration] * n
            for i, tok in zip(active, toks, strict=True):
                seqs[i].append(tok)
                left[i] -= 1
                out[i] = (tok, n)
                if left[i] <= 0 or self.engine.is_eos(tok) or self.engine.room(seqs[i]) <= 0:
                    done[i] = True
            yield out
        # Every request gets its StopIteration (those finishing on the last step too).
        yield [StopIteration] * n

    async def _run(self, req: GenRequest):
        """Async iterator of (text delta, finish_reason or None, batch size); counts the
        tokens it decodes in req.generated."""
        decoder = self.engine.decoder(req.prompt)
        text, emitted, batch, finish = "", 0, 1, "length"
        async for tok, batch in self._generate(req):
            req.generated += 1
            if self.engine.is_eos(tok):
                finish = "stop"
                continue
            text += decoder.push(tok)
            hit = next((s for s in req.stop if s and s in text), None)
            if hit is not None:
                text = text[: text.index(hit)]
                if len(text) > emitted:
                    yield text[emitted:], None, batch
                yield "", "stop", batch
                return
            # Hold back text that could be the start of a stop sequence.
            hold = max((len(s) - 1 for s in req.stop if s), default=0)
            upto = max(emitted, len(text) - hold)
            if upto > emitted:
                yield text[emitted:upto], None, batch
                emitted = upto
        text += decoder.flush()
        hit = next((s for s in req.stop if s and s in text), None)
        if hit is not None:
            text, finish = text[: text.index(hit)], "stop"
        if len(text) > emitted:
            yield text[emitted:], None, batch
        yield "", finish, batch

    def _gen_request(self, prompt: str, param: str, max_tokens: int, body,
                     special: bool = True) -> GenRequest:
        check_model(body.model, self.model_name)
        data = self.engine.encode(prompt, special) if prompt else []
        if not data:
            raise APIError(400, f"{param}: the prompt is empty", param=param,
                           code="invalid_request")
        if len(data) > self.engine.max_prompt:
            raise APIError(400, f"This model's maximum context length is "
                           f"{self.engine.context} tokens, but the prompt is {len(data)} "
                           f"{self.engine.unit}; shorten it", param=param,
                           code="context_length_exceeded")
        return GenRequest(data, max_tokens, body.temperature, body.top_k, body.seed,
                          body.stop_list())

    def _chat_text(self, messages: list[ChatMessage]) -> tuple[str, bool]:
        """(prompt text, whether encoding adds special tokens): the tokenizer's chat template
        when the model has one (it places its own), else `chat_prompt`."""
        try:
            templated = self.engine.chat_text([m.model_dump() for m in messages])
        except Exception as e:   # a template may refuse a conversation (roles, order)
            raise APIError(400, f"messages: the model's chat template refused them: "
                           f"{str(e).splitlines()[0][:200]}", param="messages",
                           code="invalid_request") from None
        return templated or (chat_prompt(messages), True)

    # ------------------------------------------------------------------ handle API

    async def info(self) -> dict:
        """For composing apps through a DeploymentHandle (e.g. workloads.serve.rag)."""
        return {"model": self.model_name, "context_length": self.engine.context}

    async def generate(self, prompt: str, max_tokens: int = 64, temperature: float = 1.0,
                       seed: int | None = None, stop: list[str] | None = None,
                       top_k: int | None = None) -> dict:
        """Complete `prompt` (its last context-length tokens) through the same batcher the
        HTTP routes use; called by other deployments via a DeploymentHandle."""
        e = self.engine
        data = e.encode(prompt)[-e.max_prompt:] or e.encode("\n")
        req = GenRequest(data, max(1, min(int(max_tokens), MAX_NEW_TOKENS)), temperature,
                         top_k, seed, list(stop or []))
        text, finish, batch = await self._collect(req)
        return {"text": text, "finish_reason": finish, "prompt_tokens": len(data),
                "completion_tokens": e.completion_tokens(req, text), "batch_size": batch}

    async def _collect(self, req: GenRequest) -> tuple[str, str, int]:
        parts, finish, batch = [], "length", 1
        async for delta, fin, b in self._run(req):
            parts.append(delta)
            batch = b
            finish = fin or finish
        return "".join(parts), finish, batch

    def _usage(self, reqs: list[GenRequest], texts: list[str]) -> dict:
        return usage(sum(len(r.prompt) for r in reqs),
                     sum(self.engine.completion_tokens(r, t)
                         for r, t in zip(reqs, texts, strict=True)))


_DEPLOYMENT = dict(
    # Light replicas: the local cluster has 4 logical CPUs on 2 cores, shared with training.
    ray_actor_options={"num_cpus": 0.5},
    # Several requests in flight per replica, so @serve.batch has something to batch.
    max_ongoing_requests=32,
    autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8},
    health_check_period_s=10,
)


@serve.deployment(**_DEPLOYMENT)
class LMGenerator(LMCore):
    """The generator for composed apps (rag): `info()` and `generate()` over a handle."""


@serve.deployment(**_DEPLOYMENT)
@serve.ingress(api)
class LMServer(LMCore):
    # ------------------------------------------------------------------ routes

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "model": self.model_name}

    @api.get("/v1/stats")
    async def stats(self) -> dict:
        sizes = list(self.batch_sizes)
        return {"model": self.model_name, "batches": len(sizes), "batch_sizes": sizes,
                "max_batch_size_seen": max(sizes, default=0),
                "replica": serve.get_replica_context().replica_id.unique_id,
                "pid": os.getpid(), "batch_wait_timeout_s": self.batch_wait_timeout_s}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "rayfleet", "context_length": self.engine.context,
            "checkpoint": self.checkpoint, "engine": self.engine.kind,
            **({"adapter": self.adapter} if self.adapter else {})}]}

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt")
        reqs = [self._gen_request(p, "prompt", body.max_tokens, body) for p in prompts]
        rid, created = new_id("cmpl"), int(time.time())

        def chunk(index: int, text: str, finish: str | None, batch: int) -> dict:
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": self.model_name, "rayfleet": {"batch_size": batch},
                    "choices": [{"index": index, "text": text, "logprobs": None,
                                 "finish_reason": finish}]}

        if body.stream:
            async def events():
                texts = []
                for index, req in enumerate(reqs):
                    parts = []
                    async for delta, finish, batch in self._run(req):
                        parts.append(delta)
                        yield sse(chunk(index, delta, finish, batch))
                    texts.append("".join(parts))
                if body.wants_usage_chunk():
                    yield sse({"id": rid, "object": "text_completion", "created": created,
                               "model": self.model_name, "choices": [],
                               "usage": self._usage(reqs, texts)})
                yield SSE_DONE
            return StreamingResponse(events(), media_type="text/event-stream")

        results = await asyncio.gather(*(self._collect(r) for r in reqs))
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                   for i, (t, f, _) in enumerate(results)]
        return {"id": rid, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": choices,
                "usage": self._usage(reqs, [t for t, _, _ in results]),
                "rayfleet": {"batch_size": max(b for _, _, b in results)}}

    @api.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest):
        text, special = self._chat_text(body.messages)
        req = self._gen_request(text, "messages", body.answer_tokens(), body, special)
        if body.stream:
            rid, created = new_id("chatcmpl"), int(time.time())

            async def events():
                first, parts = True, []
                async for delta, finish, batch in self._run(req):
                    d = {"role": "assistant", "content": delta} if first else (
                        {"content": delta} if delta else {})
                    first = False
                    parts.append(delta)
                    yield sse({"id": rid, "object": "chat.completion.chunk",
                                "created": created, "model": self.model_name,
                                "rayfleet": {"batch_size": batch},
                                "choices": [{"index": 0, "delta": d, "logprobs": None,
                                             "finish_reason": finish}]})
                if body.wants_usage_chunk():
                    yield sse({"id": rid, "object": "chat.completion.chunk",
                               "created": created, "model": self.model_name, "choices": [],
                               "usage": self._usage([req], ["".join(parts)])})
                yield SSE_DONE
            return StreamingResponse(events(), media_type="text/event-stream")
        text, finish, batch = await self._collect(req)
        return chat_completion(self.model_name, text, finish, self._usage([req], [text]),
                               {"batch_size": batch})


class LMArgs(AppArgs):
    """`args` of the lm app (cluster-configs/serve/lm.yaml): checkpoint (a folder or s3:// path:
    a finished workloads.train checkpoint, served from its hf/ export when it has one, or a
    Hugging Face model folder; default `latest`, see resolve_checkpoint and check_checkpoint),
    adapter (a PEFT LoRA adapter folder, or a LoRA run's final checkpoint, applied on top of a
    Hugging Face checkpoint; a LoRA run's own checkpoint brings its adapter itself),
    model_name, max_batch_size, batch_wait_timeout_s, num_threads."""

    APP: ClassVar[str] = "lm"
    MINIMUM: ClassVar[dict[str, float]] = {"max_batch_size": 1, "batch_wait_timeout_s": 0,
                                           "num_threads": 1}
    checkpoint: str = LATEST
    adapter: str = ""
    model_name: str = DEFAULT_MODEL_NAME
    max_batch_size: int = 8
    batch_wait_timeout_s: float = 0.05
    num_threads: int = 1


def check_args(args: "dict | LMArgs | None") -> dict:
    """The app's arguments checked, with the checkpoint resolved and validated.
    One line (RayfleetError) on anything wrong; `rayfleet serve-config` calls it before a
    deploy, the builder when Serve builds the app."""
    a = LMArgs.parse(args)
    # What the replicas load: the checkpoint, or its hf/ export when it has one, or a LoRA
    # run's base (and its adapter).
    found = check_served(resolve_checkpoint(a.checkpoint), a.adapter and app_path(a.adapter,
                                                                                 "adapter"))
    return {**a.model_dump(), "checkpoint": found["source"], "adapter": found["adapter"]}


@builder_errors("lm")
def app_builder(args: LMArgs) -> serve.Application:
    """Serve config entry point (`import_path: workloads.serve.lm:app_builder`)."""
    kwargs = check_args(args)
    return LMServer.bind(kwargs.pop("checkpoint"), **kwargs)
