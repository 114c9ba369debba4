"""`rag`: retrieval-augmented generation composed from three deployments.

    serve deploy cluster-configs/serve/rag.yaml
    serve run workloads.serve.rag:app_builder embeddings=runs/emb checkpoint=runs/.../checkpoint_x

    RAGServer (FastAPI ingress, OpenAI API)
      ├── Retriever   embeddings Parquet from workloads.embed + the same sentence-transformers
      │               model for the question; exact nearest neighbours (dot product of
      │               normalised vectors = cosine), k per request
      └── LMGenerator the `lm` model and batcher (workloads.serve.lm), called through its handle

Routes: GET /v1/models, POST /v1/chat/completions (the last user message is the question;
the answer carries `rayfleet.sources`: id, score and text of each retrieved document),
POST /v1/retrieve ({"query", "k"} -> documents), GET /health. The kit's generator is a small
byte-level model with a short context: the question and as much of the best documents as fit
go into its prompt.

`generator: llm` puts vLLM in LMGenerator's place: the answer is written by the engine of the
cluster's `llm` app (`generator_app`), called through Serve's handle (workloads/serve/
rag_llm.py), streamed as vLLM streams it; the GPU clusters' choice.
"""

# No `from __future__ import annotations`: FastAPI reads the request models as classes, and
# Serve the builder's args model.
import asyncio
import os
import time
from typing import ClassVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from ray import serve
from ray.serve.handle import DeploymentHandle

from rayfleet.errors import CheckpointError, ConfigError, RayfleetError
from workloads.common.encoder import encode, encoder_dim, load_encoder, model_path
from workloads.common.shards import MANIFEST
from workloads.common.storage import default_root, resolve
from workloads.serve.app_args import LATEST, AppArgs, app_path, builder_errors, resolve_checkpoint
from workloads.serve.lm import DEFAULT_MODEL_NAME as GENERATOR_MODEL_NAME
from workloads.serve.lm import LMGenerator
from workloads.serve.model_source import check_served
from workloads.serve.openai_api import (
    APIError,
    ChatRequest,
    chat_completion,
    check_model,
    openai_app,
    usage,
)
from workloads.serve.rag_llm import (
    GENERATORS,
    TEMPLATE_RESERVE,
    VLLMGenerator,
    as_answer,
    as_stream,
    check_generator_deployed,
    check_generator_in,
    pack_sources,
    rag_messages,
)

DEFAULT_MODEL_NAME = "rayfleet-rag"
MAX_K = 20


# --------------------------------------------------------------------------- index

def check_index(uri: str):
    """(storage, manifest, parquet files) of a finished workloads.embed output, cheaply: the
    builder calls this so a missing or unfinished index fails `serve deploy` with one line."""
    import json

    import pyarrow.fs as pafs

    storage = resolve(uri, check_writable=False, create=False)
    try:
        manifest = json.loads(storage.read_bytes(storage.join(MANIFEST)))
    except (FileNotFoundError, OSError, ValueError) as e:
        raise CheckpointError(f"embeddings {uri}: no readable {MANIFEST} (run "
                              "`python -m workloads.embed --output ...` to the end first)") from e
    files = sorted(i.path for i in storage.fs.get_file_info(
        pafs.FileSelector(storage.path, allow_not_found=True))
        if i.type == pafs.FileType.File and i.base_name.endswith(".parquet"))
    if not files:
        raise CheckpointError(f"embeddings {uri}: no Parquet files next to {MANIFEST}")
    check_encoder(uri, manifest, storage.fs, files[0])
    return storage, manifest, files


def check_encoder(uri: str, manifest: dict, fs, first: str) -> None:
    """The questions are encoded by the model the index names: it must be here, and make
    vectors of the size the index's own are (its first file's schema, not a claim)."""
    import pyarrow.parquet as pq

    try:
        path = model_path(str(manifest.get("model")))
    except RayfleetError as e:
        raise CheckpointError(f"embeddings {uri}: its encoder {manifest.get('model')!r} cannot "
                              f"be loaded here ({e})") from None
    schema = pq.read_schema(fs.open_input_file(first))
    field = schema.field("embedding") if "embedding" in schema.names else None
    size = getattr(field.type, "list_size", None) if field is not None else None
    if size is None:
        raise CheckpointError(f"embeddings {uri}: {first} has no fixed-size `embedding` column "
                              "(not workloads.embed output)")
    dim = encoder_dim(path)
    if dim is not None and dim != size:
        raise CheckpointError(f"embeddings {uri}: made with {size}-dim vectors, but its "
                              f"encoder {manifest.get('model')} makes {dim}-dim ones (the model "
                              "folder changed since: embed again)")


def load_index(uri: str):
    """(ids, texts, matrix) from workloads.embed output (local folder or s3://)."""
    import numpy as np
    import pyarrow.parquet as pq

    storage, manifest, files = check_index(uri)
    fs = storage.fs
    tables = [pq.read_table(fs.open_input_file(f)) for f in files]
    ids, texts, vecs = [], [], []
    for t in tables:
        if "text" not in t.schema.names:
            raise CheckpointError(f"embeddings {uri}: written with --no-text; rag needs the "
                                  "document text")
        ids += t["id"].to_pylist()
        texts += t["text"].to_pylist()
        emb = t["embedding"].combine_chunks()
        vecs.append(emb.values.to_numpy(zero_copy_only=False).reshape(len(emb),
                                                                       emb.type.list_size))
    matrix = np.concatenate(vecs).astype(np.float32)
    if len(ids) != manifest.get("rows"):
        raise CheckpointError(f"embeddings {uri}: {len(ids)} rows but the manifest says "
                              f"{manifest.get('rows')} (a partial write?)")
    return ids, texts, matrix, manifest


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32,
                  health_check_period_s=10)
class Retriever:
    def __init__(self, embeddings: str):
        import torch

        torch.set_num_threads(1)
        self.ids, self.texts, self.matrix, manifest = load_index(embeddings)
        self.encoder = load_encoder(model_path(manifest["model"]))

    def check_health(self) -> None:
        if not len(self.ids):
            raise RuntimeError("empty index")

    async def search(self, query: str, k: int) -> list[dict]:
        return await asyncio.to_thread(self._search, query, k)

    def _search(self, query: str, k: int) -> list[dict]:
        import numpy as np

        q = encode(self.encoder, [query], 1)[0]
        scores = self.matrix @ q
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [{"id": self.ids[i], "score": round(float(scores[i]), 4),
                 "text": self.texts[i]} for i in top]


# --------------------------------------------------------------------------- API

class RAGChatRequest(ChatRequest):
    """lm's chat request plus `k`, the documents to retrieve (a rayfleet extension)."""
    k: int = Field(3, ge=1, le=MAX_K)


class RetrieveRequest(BaseModel):
    query: str = Field(min_length=1)
    k: int = Field(3, ge=1, le=MAX_K)


def rag_prompt(question: str, sources: list[dict], budget: int) -> str:
    """Documents first, the question last (the model continues from the end), all within
    `budget` bytes: documents are cut to what fits, and dropped when not even a document's
    name and a few words would; a question longer than the budget keeps its end."""
    tail = f"# question: {question}\n# answer:".encode("utf-8")
    if len(tail) >= budget:
        return tail[-budget:].decode("utf-8", errors="ignore")
    return pack_sources(sources, budget - len(tail)) + tail.decode("utf-8")


api = openai_app("rayfleet rag")


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32)
@serve.ingress(api)
class RAGServer:
    def __init__(self, retriever: DeploymentHandle, generator: DeploymentHandle | None,
                 model_name: str = DEFAULT_MODEL_NAME, generator_app: str = ""):
        self.retriever, self.generator = retriever, generator
        # generator None: the `llm` app named generator_app writes the answers.
        self.vllm = VLLMGenerator(generator_app) if generator is None else None
        self.model_name = model_name
        self.created = int(time.time())

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "model": self.model_name}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "rayfleet"}]}

    @api.post("/v1/retrieve")
    async def retrieve(self, body: RetrieveRequest) -> dict:
        return {"object": "list", "data": await self.retriever.search.remote(body.query, body.k)}

    @api.post("/v1/chat/completions")
    async def chat(self, body: RAGChatRequest, request: Request):
        check_model(body.model, self.model_name)
        if body.stream and self.vllm is None:
            raise APIError(400, "stream: the rag app over `lm` answers in one response; drop "
                           "`stream` (`generator: llm` streams)", param="stream",
                           code="invalid_request")
        question = next((m.content for m in reversed(body.messages) if m.role == "user"), "")
        if not question.strip():
            raise APIError(400, "messages: no user message with content to answer",
                           param="messages", code="invalid_request")
        if self.vllm is not None:
            return await self._chat_vllm(body, await request.json(), question)
        # Both sub-calls go through handles: Serve routes, queues and load-balances them.
        info_ref = self.generator.info.remote()
        sources = await self.retriever.search.remote(question, body.k)
        info = await info_ref
        prompt = rag_prompt(question, sources, info["context_length"])
        out = await self.generator.generate.remote(prompt, body.answer_tokens(),
                                                   body.temperature, body.seed,
                                                   body.stop_list(), body.top_k)
        return chat_completion(self.model_name, out["text"], out["finish_reason"],
                               usage(out["prompt_tokens"], out["completion_tokens"]),
                               {"sources": sources, "generator": info["model"],
                                "prompt": prompt})

    async def _chat_vllm(self, body: RAGChatRequest, raw: dict, question: str):
        """The client's request as vLLM takes it (every OpenAI field it knows passes), with
        the generator's model and the documents in the last user message."""
        sources, (_, model, max_len) = await asyncio.gather(
            self.retriever.search.remote(question, body.k), self.vllm.engine())
        answer = body.answer_tokens(min(512, max(16, max_len // 4)))
        messages = rag_messages([m.model_dump() for m in body.messages], sources,
                                max_len - answer - TEMPLATE_RESERVE)
        raw = {key: value for key, value in raw.items() if key != "k"}
        raw.update(model=model, messages=messages, max_tokens=answer)
        raw.pop("max_completion_tokens", None)
        first, stream = await self.vllm.chat(raw)
        extra = {"sources": sources, "generator": model, "messages": messages}
        if not body.stream:
            return as_answer(first, self.model_name, extra)
        return StreamingResponse(as_stream(first, stream, self.model_name, extra),
                                 media_type="text/event-stream")


class RAGArgs(AppArgs):
    """`args` of the rag app (cluster-configs/serve/rag.yaml): embeddings (workloads.embed
    output, folder or s3://; default the embed job's default output), generator (`lm`, the
    default: the kit's model in this app; `llm`: the engine of the `llm` app named
    generator_app, default `llm`), and for `lm`: checkpoint (its workloads.train checkpoint or
    Hugging Face folder; default `latest`), adapter (a LoRA adapter on it, as lm's),
    generator_model_name; model_name (what rag answers as)."""

    APP: ClassVar[str] = "rag"
    embeddings: str = ""
    generator: str = "lm"
    generator_app: str = "llm"
    checkpoint: str = LATEST
    adapter: str = ""
    model_name: str = DEFAULT_MODEL_NAME
    generator_model_name: str = GENERATOR_MODEL_NAME


# What only `generator: lm` reads: with `llm`, the llm app's config names the model.
LM_ONLY = ("checkpoint", "adapter", "generator_model_name")


def check_args(args: "dict | RAGArgs | None") -> dict:
    """The app's arguments checked, paths resolved; or one line (RayfleetError)."""
    a = RAGArgs.parse(args)
    if a.generator not in GENERATORS:
        raise ConfigError("args.generator", f"{a.generator!r} is not a generator rag knows",
                          list(GENERATORS), a.generator)
    # Defaults: where workloads.embed and workloads.train write when given no path.
    embeddings = app_path(a.embeddings or os.path.join(default_root(), "embeddings"),
                          "embeddings")
    out = {**a.model_dump(), "embeddings": embeddings}
    if a.generator == "llm":
        given = sorted(set(LM_ONLY) & a.model_fields_set)
        if given:
            raise ConfigError(f"args.{given[0]}", "only for `generator: lm`; with "
                              f"`generator: llm` the app '{a.generator_app}' names the model")
        check_index(embeddings)
        return {k: v for k, v in out.items() if k not in LM_ONLY}
    out.pop("generator_app")
    # The generator: a workloads.train checkpoint (its hf/ export if any, a LoRA run's base and
    # adapter) or a HF model folder.
    found = check_served(resolve_checkpoint(a.checkpoint), a.adapter and app_path(a.adapter,
                                                                                 "adapter"))
    check_index(embeddings)  # a missing or unfinished index fails the deploy, not a replica
    return {**out, "checkpoint": found["source"], "adapter": found["adapter"]}


def check_apps(args: dict, apps: list[dict]) -> None:
    """`rayfleet serve-config`, given the whole config: the generator app is in it."""
    if args.get("generator") == "llm":
        check_generator_in(args.get("generator_app") or "llm", apps)


@builder_errors("rag")
def app_builder(args: RAGArgs) -> serve.Application:
    """Serve config entry point (`import_path: workloads.serve.rag:app_builder`)."""
    a = check_args(args)
    retriever = Retriever.bind(a["embeddings"])
    if a["generator"] == "llm":
        check_generator_deployed(a["generator_app"])
        return RAGServer.bind(retriever, None, model_name=a["model_name"],
                              generator_app=a["generator_app"])
    generator = LMGenerator.bind(a["checkpoint"], model_name=a["generator_model_name"],
                                 adapter=a["adapter"])
    return RAGServer.bind(retriever, generator, model_name=a["model_name"])
