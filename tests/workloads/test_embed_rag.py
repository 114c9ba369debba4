"""workloads.embed on the session's real Ray cluster (actor pool, packaged all-MiniLM-L6-v2,
Parquet ids + vectors), then the `rag` Serve app over those vectors and the session's trained
checkpoint, deployed with `serve deploy` and asked through the real `openai` client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import BIN, REPO, free_port, run, summary_of
from tests.workloads.conftest import serve_shutdown, wait_healthy

pytestmark = pytest.mark.ray
DOCS = 80   # stdlib module docstrings: __future__ ... email.*, csv and bz2 among them


def _embed(ray_cluster, *args: str, timeout: float = 400):
    return run([str(BIN / "python"), "-m", "workloads.embed", *args], env=ray_cluster["env"],
               timeout=timeout)


@pytest.fixture(scope="module")
def embeddings(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("embed") / "vectors"
    proc = _embed(ray_cluster, "--smoke-test", "--max-docs", str(DOCS), "--batch-size", "32",
                  "--output", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, summary_of(proc.stdout)


def _table(out):
    return pq.read_table(sorted(out.glob("*.parquet")))


def test_one_unit_vector_per_document_with_its_id(embeddings):
    from workloads.embed.pipeline import stdlib_docs

    out, summary = embeddings
    t = _table(out)
    assert summary["rows"] == t.num_rows == DOCS and summary["dim"] == 384
    assert t.schema.field("embedding").type.list_size == 384
    # Same documents, same order as the source (preserve_order), ids intact.
    assert t["id"].to_pylist() == [d["id"] for d in stdlib_docs(DOCS)]
    vecs = np.array(t["embedding"].to_pylist(), dtype=np.float32)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    assert json.loads((out / "_manifest.json").read_text())["model"] == "all-MiniLM-L6-v2"


def test_vectors_are_what_the_model_gives_here(embeddings):
    """Deterministic and correct: the cluster's actors, batching 32 at a time, agree with
    the same packaged model run once in this process, one document at a time."""
    from workloads.embed.pipeline import encode, load_encoder, model_path

    t = _table(embeddings[0])
    enc = load_encoder(model_path("all-MiniLM-L6-v2"))
    for i in (0, 17, DOCS - 1):
        mine = encode(enc, [t["text"][i].as_py()], 1)[0]
        assert np.abs(mine - np.array(t["embedding"][i].as_py())).max() < 1e-5


def test_bad_inputs_are_one_line_and_write_nothing(ray_cluster, tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"doc": "a document long enough", "key": 1}\n')
    cases = [
        (["--model", str(tmp_path / "no-model")], "--model"),
        (["--input", str(tmp_path / "missing")], "does not exist"),
        (["--input", str(tmp_path / "docs.jsonl"), "--column", "doc"], "no column 'id'"),
        (["--batch-size", "0"], "--batch-size: must be at least 1"),
    ]
    for args, expected in cases:
        out = tmp_path / "out"
        proc = _embed(ray_cluster, *args, "--output", str(out), timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert len(lines) == 1 and expected in lines[0], (args, proc.stderr[-2000:])
        assert not out.exists()


# --------------------------------------------------------------------------- rag

@pytest.fixture(scope="module")
def rag_url(ray_cluster, embeddings, lm_checkpoint, tmp_path_factory):
    port = free_port()
    cfg = yaml.safe_load((REPO / "cluster-configs" / "serve" / "rag.yaml").read_text())
    cfg["http_options"]["port"] = port
    cfg["applications"][0]["args"].update(embeddings=str(embeddings[0]),
                                          checkpoint=lm_checkpoint)
    path = tmp_path_factory.mktemp("rag") / "rag.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run([str(BIN / "serve"), "deploy", str(path)], env=ray_cluster["env"], check=True,
        timeout=120)
    url = wait_healthy(ray_cluster, f"http://127.0.0.1:{port}", "rag")
    yield url
    serve_shutdown(ray_cluster)


def _post(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_retriever_finds_the_document_that_answers(rag_url):
    status, body = _post(rag_url + "/v1/retrieve",
                         {"query": "How do I read and write CSV files?", "k": 3})
    assert status == 200
    hits = body["data"]
    assert [h["id"] for h in hits][0] == "csv"
    assert hits[0]["score"] > hits[1]["score"] >= hits[2]["score"]


def test_rag_answers_through_the_openai_client_with_its_sources(rag_url):
    import openai

    client = openai.OpenAI(base_url=rag_url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    assert [m.id for m in client.models.list().data] == ["rayfleet-rag"]
    r = client.chat.completions.create(
        model="rayfleet-rag", max_tokens=12, seed=1,
        messages=[{"role": "user", "content": "bzip2 compression?"}])
    assert r.choices[0].message.content and r.usage.completion_tokens >= 1
    extra = r.model_extra["rayfleet"]
    assert extra["sources"][0]["id"] == "bz2" and extra["generator"] == "rayfleet-lm"
    # The generator saw the retrieved document (trimmed to its short context).
    assert extra["prompt"].startswith("# bz2:") and extra["prompt"].endswith("# answer:")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                 "content": "hi"}])


def test_rag_refuses_bad_requests_and_a_missing_index(rag_url, tmp_path):
    from rayfleet.errors import CheckpointError
    from workloads.serve.rag import check_index

    status, body = _post(rag_url + "/v1/retrieve", {"query": "", "k": 3})
    assert status == 400 and body["error"]["param"] == "query"
    status, body = _post(rag_url + "/v1/chat/completions",
                         {"model": "rayfleet-rag", "k": 500,
                          "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and body["error"]["param"] == "k"
    with pytest.raises(CheckpointError, match="_manifest.json"):
        check_index(str(tmp_path))
