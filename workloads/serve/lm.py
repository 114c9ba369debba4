"""`lm`: an OpenAI-compatible API over a checkpoint written by workloads.train (the kit's byte
GPT, or the Hugging Face export in a final checkpoint's `hf/`), or over any Hugging Face causal
LM folder (config.json + safetensors + tokenizer; local or s3://). Engines: engines.py.

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
# to read them from the body (as strings, through serve.ingress, they become query params).
import asyncio
import collections
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from ray import serve

from rayfleet.errors import CheckpointError, ConfigError, RayfleetError
from workloads.serve.engines import Engine, GenRequest, HFEngine

DEFAULT_MODEL_NAME = "rayfleet-lm"
MAX_BODY_BYTES = 1 << 20      # a request body over 1 MiB is refused before it is parsed
MAX_NEW_TOKENS = 1024
BATCH_SIZES_KEPT = 1000


# --------------------------------------------------------------------------- errors

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


# --------------------------------------------------------------------------- checkpoint

def _split_s3(uri: str):
    from workloads.common.storage import resolve

    storage = resolve(uri, check_writable=False)
    return storage.fs, storage.path


def _location(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) of a local folder or an s3:// prefix."""
    if path.startswith("s3://"):
        return _split_s3(path)
    return pafs.LocalFileSystem(), str(Path(path).expanduser().resolve())


def check_checkpoint(path: str) -> dict:
    """Validate what `checkpoint` names (local folder or s3://) without loading weights: the
    builder calls this so `serve run`/`serve deploy` fail with one line, not a crashing replica.

    - a workloads.train final checkpoint: its marker and files; served from its `hf/`
      Hugging Face export when it has one, else the byte GPT's model.pt;
    - a Hugging Face model folder (config.json + weights + tokenizer, as save_pretrained
      writes it).
    Returns the marker (if any) plus `engine` ("byte" or "hf") and `source`, the folder the
    replica loads."""
    from workloads.common import hf
    from workloads.train import checkpoint as ckpt

    if not path:
        raise ConfigError("checkpoint", "no checkpoint given; pass args.checkpoint "
                          "(a folder or s3:// path written by workloads.train, or a Hugging "
                          "Face model folder)")
    fs, inner = _location(path)
    listing = ckpt.list_files(fs, inner)
    if not listing:
        raise CheckpointError(f"checkpoint {path} does not exist")
    if ckpt.MARKER in listing:
        marker = ckpt.validate_on(fs, inner, path, listing=listing)
        if any(k.startswith("hf/") for k in listing):
            source = path.rstrip("/") + "/hf"
            return {**marker, "engine": "hf", "source": source,
                    **hf.check_model_folder(source, "args.checkpoint")}
        if "model.pt" not in listing or "model_config.json" not in listing:
            raise CheckpointError(f"checkpoint {path} holds no full weights (model.pt) and no "
                                  "hf/ export; serve the run's final checkpoint")
        if "hf" in json.loads(ckpt.read_file(fs, f"{inner}/model_config.json") or b"{}"):
            # A Hugging Face run's intermediate checkpoint: its export is written at the end.
            raise CheckpointError(f"checkpoint {path} is an intermediate checkpoint of a "
                                  "Hugging Face run (no hf/ export); serve the run's final "
                                  "checkpoint")
        return {**marker, "engine": "byte", "source": path}
    if "config.json" in listing or any(k.endswith(hf.MODEL_WEIGHTS) and "/" not in k
                                       for k in listing):
        return {"engine": "hf", "source": path,
                **hf.check_model_folder(path, "args.checkpoint")}
    if "model.pt" in listing or any(k.startswith("dcp/") for k in listing):
        ckpt.parse_marker(path, None)   # a workloads.train checkpoint never finished
    raise CheckpointError(f"checkpoint {path} holds no model: neither a workloads.train "
                          f"checkpoint ({ckpt.MARKER}) nor a Hugging Face model folder "
                          "(config.json + *.safetensors + tokenizer)")


def hf_source(path: str) -> str | None:
    """The Hugging Face folder a replica loads for `path` (itself, or a run checkpoint's
    `hf/` export), or None for a byte GPT checkpoint. Cheap: no validation."""
    fs, inner = _location(path)
    for folder, at in ((path, inner), (path.rstrip("/") + "/hf", f"{inner}/hf")):
        if fs.get_file_info(f"{at}/config.json").type == pafs.FileType.File:
            return folder
    return None


LATEST = "latest"


def app_path(args: dict, key: str, default: str) -> str:
    """An app argument naming a folder or s3:// prefix. Replicas run in Ray's own folders, not
    in the one `serve deploy` was typed in, so a relative path is refused in one line."""
    value = str(args.get(key) or default).strip()
    if value.startswith("s3://") or value == LATEST:
        return value
    if not Path(value.removeprefix("file://")).expanduser().is_absolute():
        raise ConfigError(f"args.{key}", f"{value} is a relative path, and Serve replicas do not "
                                         "run in your folder: give an absolute path or "
                                         "s3://bucket/prefix")
    return str(Path(value.removeprefix("file://")).expanduser())


def resolve_checkpoint(args: dict) -> str:
    """args.checkpoint, or `latest` (the default): the final checkpoint of the newest finished
    run under the cluster's default storage, where workloads.train writes without
    --storage-path ($RAYFLEET_STORAGE, else ~/rayfleet-runs)."""
    from workloads.common.storage import default_root, resolve
    from workloads.train.runinfo import latest_finished_checkpoint

    value = app_path(args, "checkpoint", LATEST)
    if value != LATEST:
        return value
    root = default_root()
    try:
        found = latest_finished_checkpoint(resolve(root, check_writable=False, create=False))
    except RayfleetError:
        found = None
    if found is None:
        raise ConfigError("args.checkpoint", f"'latest': no finished workloads.train run under "
                                             f"{root} (the default storage); train one first or "
                                             "set args.checkpoint to a run's final checkpoint")
    return found


def builder_errors(app: str):
    """App builders raise one line: Serve shows a RayServeException's message as it is in
    `serve status`, where any other exception becomes a whole traceback."""
    import functools

    from ray.serve.exceptions import RayServeException

    def wrap(fn):
        @functools.wraps(fn)
        def inner(args):
            try:
                return fn(args)
            except RayfleetError as e:
                raise RayServeException(f"{app} app: {e}") from None
        return inner
    return wrap


def load_checkpoint(path: str) -> tuple[dict, dict]:
    """(model_config, state_dict); an s3:// checkpoint is copied to a temp folder first."""
    from workloads.train.checkpoint import load_full_weights

    if not path.startswith("s3://"):
        return load_full_weights(Path(path).expanduser())
    import pyarrow.fs as pafs

    fs, inner = _split_s3(path)
    local = Path(tempfile.mkdtemp(prefix="rayfleet-serve-"))
    try:
        pafs.copy_files(inner, str(local), source_filesystem=fs,
                        destination_filesystem=pafs.LocalFileSystem())
        return load_full_weights(local)
    finally:
        shutil.rmtree(local, ignore_errors=True)   # the weights are in memory now


def load_engine(checkpoint: str) -> Engine | HFEngine:
    """The engine for what check_checkpoint accepted: a Hugging Face model (a folder, or a run
    checkpoint's `hf/` export) or the byte GPT of a workloads.train checkpoint."""
    folder = hf_source(checkpoint)
    if folder is not None:
        return HFEngine.load(folder)
    return Engine(*load_checkpoint(checkpoint))


# --------------------------------------------------------------------------- API schema

class SamplingRequest(BaseModel):
    """What completions and chat requests share: the model and how to sample."""
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None


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


def chat_prompt(messages: list[ChatMessage]) -> str:
    # The model learned Python source, so the conversation is laid out as comments.
    return "".join(f"# {m.role}: {m.content}\n" for m in messages) + "# assistant:"


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
        return JSONResponse(error_body(
            f"request body of {size} bytes is over the {MAX_BODY_BYTES}-byte limit",
            "invalid_request_error", None, "request_too_large"), status_code=400)
    return await call_next(request)


def openai_app(title: str) -> FastAPI:
    """A FastAPI app whose errors are OpenAI error bodies (shared by lm and rag)."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.middleware("http")(_limit_body)
    return app


api = openai_app("rayfleet lm")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class LMCore:
    """The model and its batcher, without HTTP: LMServer adds the OpenAI routes on top, and
    LMGenerator serves it to other deployments through a DeploymentHandle (an application
    may hold only one FastAPI ingress)."""

    def __init__(self, checkpoint: str, model_name: str = DEFAULT_MODEL_NAME,
                 max_batch_size: int = 8, batch_wait_timeout_s: float = 0.05,
                 num_threads: int = 1):
        import torch

        torch.set_num_threads(num_threads)
        self.engine = load_engine(checkpoint)
        self.model_name = model_name
        self.checkpoint = checkpoint
        self.created = int(time.time())
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=BATCH_SIZES_KEPT)
        self._generate.set_max_batch_size(max_batch_size)
        self._generate.set_batch_wait_timeout_s(batch_wait_timeout_s)

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
        if body.model != self.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server has "
                           f"'{self.model_name}' (GET /v1/models)", param="model",
                           code="model_not_found")
        data = self.engine.encode(prompt, special) if prompt else []
        if not data:
            raise APIError(400, f"{param}: the prompt is empty", param=param,
                           code="invalid_request")
        if len(data) > self.engine.max_prompt:
            raise APIError(400, f"This model's maximum context length is "
                           f"{self.engine.context} tokens, but the prompt is {len(data)} "
                           f"{self.engine.unit}; shorten it", param=param,
                           code="context_length_exceeded")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return GenRequest(data, max_tokens, body.temperature, body.top_k, body.seed, stop)

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
        p = sum(len(r.prompt) for r in reqs)
        c = sum(self.engine.completion_tokens(r, t) for r, t in zip(reqs, texts, strict=True))
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


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
                "pid": os.getpid()}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "rayfleet", "context_length": self.engine.context,
            "checkpoint": self.checkpoint, "engine": self.engine.kind}]}

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt")
        reqs = [self._gen_request(p, "prompt", body.max_tokens, body) for p in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(index: int, text: str, finish: str | None, batch: int) -> dict:
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": self.model_name, "rayfleet": {"batch_size": batch},
                    "choices": [{"index": index, "text": text, "logprobs": None,
                                 "finish_reason": finish}]}

        if body.stream:
            async def events():
                for index, req in enumerate(reqs):
                    async for delta, finish, batch in self._run(req):
                        yield _sse(chunk(index, delta, finish, batch))
                yield "data: [DONE]\n\n"
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
        max_tokens = body.max_completion_tokens or body.max_tokens or 64
        text, special = self._chat_text(body.messages)
        req = self._gen_request(text, "messages", max_tokens, body, special)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            async def events():
                first = True
                async for delta, finish, batch in self._run(req):
                    d = {"role": "assistant", "content": delta} if first else (
                        {"content": delta} if delta else {})
                    first = False
                    yield _sse({"id": rid, "object": "chat.completion.chunk",
                                "created": created, "model": self.model_name,
                                "rayfleet": {"batch_size": batch},
                                "choices": [{"index": 0, "delta": d, "logprobs": None,
                                             "finish_reason": finish}]})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        text, finish, batch = await self._collect(req)
        return {"id": rid, "object": "chat.completion", "created": created,
                "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish}],
                "usage": self._usage([req], [text]), "rayfleet": {"batch_size": batch}}



def _number(args: dict, key: str, default, kind, minimum):
    """A numeric app argument, or one line naming it (not a ValueError in `serve deploy`)."""
    raw = args.get(key, default)
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"args.{key}", f"must be a number, got {raw!r}") from None
    if not value >= minimum:   # also refuses NaN
        raise ConfigError(f"args.{key}", f"must be at least {minimum}, got {raw!r}")
    return value


def check_args(args: dict | None) -> dict:
    """The app's arguments checked, with the checkpoint resolved and validated.
    One line (RayfleetError) on anything wrong; `rayfleet serve-config` calls it before a
    deploy, the builder when Serve builds the app."""
    args = dict(args or {})
    known = {"checkpoint", "model_name", "max_batch_size", "batch_wait_timeout_s", "num_threads"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(f"args.{unknown[0]}", "unknown argument for the lm app", sorted(known),
                          unknown[0])
    # What the replicas load: the checkpoint, or its hf/ export when it has one.
    checkpoint = check_checkpoint(resolve_checkpoint(args))["source"]
    return {"checkpoint": checkpoint,
            "model_name": str(args.get("model_name", DEFAULT_MODEL_NAME)),
            "max_batch_size": _number(args, "max_batch_size", 8, int, 1),
            "batch_wait_timeout_s": _number(args, "batch_wait_timeout_s", 0.05, float, 0),
            "num_threads": _number(args, "num_threads", 1, int, 1)}


@builder_errors("lm")
def app_builder(args: dict) -> serve.Application:
    """Serve config entry point (`import_path: workloads.serve.lm:app_builder`).

    args: checkpoint (a folder or s3:// path: a finished workloads.train checkpoint, served
    from its hf/ export when it has one, or a Hugging Face model folder; default `latest`,
    see resolve_checkpoint and check_checkpoint), model_name, max_batch_size,
    batch_wait_timeout_s, num_threads.
    """
    kwargs = check_args(args)
    return LMServer.bind(kwargs.pop("checkpoint"), **kwargs)
