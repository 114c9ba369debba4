"""`rag` over vLLM (`generator: llm`) without a cluster: the prompt it sends, what `rayfleet
serve-config` refuses before a deploy (the generator app not in the file, not the kit's
`api: vllm` app, a setting only `generator: lm` reads, an index whose encoder does not match),
and the GPU form (the A100 `llm` config with rag over it) rendered and placed. The deployed
app, on the session cluster's CPU vLLM, is tests/cluster/test_readme.py's."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import BIN, REPO, run

RAG_LLM = REPO / "cluster-configs" / "serve" / "rag-llm.yaml"
A100_LLM = REPO / "cluster-configs" / "serve" / "llm.yaml"


def test_documents_go_into_the_last_user_message_within_the_budget():
    from workloads.serve.rag_llm import rag_messages

    sources = [{"id": "csv", "text": "CSV  files\nare read " + "x" * 300},
               {"id": "bz2", "text": "bzip2 compression"}]
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "first question"},
               {"role": "assistant", "content": "first answer"},
               {"role": "user", "content": "How do I read CSV?"}]
    out = rag_messages(history, sources, 400)
    assert out[:3] == history[:3] and history[3]["content"] == "How do I read CSV?"
    last = out[3]["content"]
    assert last.startswith("Answer the question using these documents.\n\n# csv: CSV files "
                           "are read xxx") and last.endswith("\nQuestion: How do I read CSV?")
    # Everything sent fits the budget in bytes (tokens can only be fewer).
    assert sum(len(m["content"].encode()) for m in out) <= 400
    assert "# bz2" not in last   # no room left after the first document
    roomy = rag_messages(history, sources, 4000)[3]["content"]
    assert "# bz2: bzip2 compression\n" in roomy and "x" * 300 in roomy
    # No room at all: the question alone, never a cut question.
    assert rag_messages(history, sources, 10)[3]["content"].endswith(
        "\nQuestion: How do I read CSV?")


def _index(path, dim: int = 384, model: str = "all-MiniLM-L6-v2"):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir()
    vecs = np.zeros((2, dim), dtype=np.float32)
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["alpha", "beta"],
                             "embedding": pa.FixedSizeListArray.from_arrays(
                                 pa.array(vecs.ravel()), dim)}), path / "shard-00000.parquet")
    (path / "_manifest.json").write_text(json.dumps({"model": model, "dim": dim, "rows": 2}))
    return path


def _serve_config(*args):
    return run([str(BIN / "rayfleet"), "serve-config", *map(str, args)], cwd=REPO, timeout=120)


def test_serve_config_writes_rag_with_its_llm_app_and_refuses_what_cannot_run(tmp_path):
    emb = _index(tmp_path / "emb")
    out = tmp_path / "both.yaml"
    ok = _serve_config(A100_LLM, RAG_LLM, "--arg", f"rag.embeddings={emb}", "-o", out)
    assert ok.returncode == 0, ok.stderr
    cfg = yaml.safe_load(out.read_text())
    assert [a["name"] for a in cfg["applications"]] == ["llm", "rag"]
    # The llm app as its file has it (a changed config would restart its engine).
    assert cfg["applications"][0] == yaml.safe_load(A100_LLM.read_text())["applications"][0]
    assert cfg["applications"][1]["args"] == {"embeddings": str(emb), "generator": "llm",
                                              "generator_app": "llm",
                                              "model_name": "rayfleet-rag"}
    ray_api = tmp_path / "llm-ray.yaml"
    ray_api.write_text(A100_LLM.read_text().replace("api: vllm", "api: ray"))
    other = tmp_path / "other-dim"
    _index(other, dim=128)
    bad = [
        ([RAG_LLM, "--arg", f"embeddings={emb}"],
         "app rag: args.generator_app: app 'llm' is not in this Serve config"),
        ([ray_api, RAG_LLM, "--arg", f"rag.embeddings={emb}"], "has api: 'ray'"),
        ([A100_LLM, RAG_LLM, "--arg", f"embeddings={emb}"],
         "--arg: embeddings=...: this config has the apps llm, rag; name one"),
        ([A100_LLM, RAG_LLM, "--arg", f"rag.embeddings={emb}", "--arg", "rag.checkpoint=/c"],
         "args.checkpoint: only for `generator: lm`"),
        ([A100_LLM, RAG_LLM, "--arg", f"rag.embeddings={emb}", "--arg", "rag.generator=vllm"],
         "args.generator: 'vllm' is not a generator rag knows"),
        ([A100_LLM, RAG_LLM, "--arg", f"rag.embeddings={other}"],
         "made with 128-dim vectors, but its encoder all-MiniLM-L6-v2 makes 384-dim ones"),
        ([A100_LLM, RAG_LLM, "--arg", f"rag.embeddings={tmp_path / 'none'}"],
         "none: does not exist"),
        ([A100_LLM, A100_LLM], "app 'llm' has the name 'llm' of an app listed before it"),
    ]
    from rayfleet.commands import serve_config
    from rayfleet.errors import RayfleetError

    for args, needle in bad:   # in this process: the CLI's one line is RayfleetError's text
        configs = [str(a) for a in args if not str(a).startswith(("--", "rag.", "emb"))]
        pairs = [a for a in args[len(configs):] if a != "--arg"]
        with pytest.raises(RayfleetError) as e:
            serve_config.checked_config(configs, pairs, str(tmp_path / "refused.yaml"))
        assert needle in str(e.value) and "\n" not in str(e.value), (args, str(e.value))
        assert not (tmp_path / "refused.yaml").exists()
    proc = _serve_config(*bad[0][0], "-o", tmp_path / "refused.yaml")
    assert proc.returncode == 2 and proc.stderr.startswith("rayfleet: error: ") and \
        proc.stderr.count("\n") == 1 and bad[0][1] in proc.stderr, proc.stderr


def test_on_gpu_nodes_rag_places_on_cpus_beside_the_gpu_engine(tmp_path):
    """The A100 form, packaged as for a remote cluster: Serve's schema takes the file, the
    engine keeps its GPU placement, and rag's two deployments ask for CPUs only (the head or
    any worker runs them; the GPUs stay the engine's)."""
    from ray.serve.schema import ServeDeploySchema

    out = tmp_path / "remote.yaml"
    proc = _serve_config(A100_LLM, RAG_LLM, "--package-to", f"file://{tmp_path}/pkgs",
                         "--arg", "rag.embeddings=s3://bucket/rayfleet/runs/embeddings",
                         "-o", out)
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(out.read_text())
    ServeDeploySchema.model_validate(cfg)
    llm, rag = cfg["applications"]
    engine = llm["args"]["llm_configs"][0]
    assert engine["accelerator_type"] == "A100"
    assert engine["placement_group_config"]["bundle_per_worker"]["GPU"] == 1
    assert rag["route_prefix"] == "/rag" and llm["route_prefix"] == "/"
    assert all(set(d["ray_actor_options"]) == {"num_cpus"} for d in rag["deployments"])
    assert rag["runtime_env"]["working_dir"] == llm["runtime_env"]["working_dir"]
    # A relative path would resolve on no node, in either app.
    rel = _serve_config(A100_LLM, RAG_LLM, "--package-to", f"file://{tmp_path}/pkgs",
                        "--arg", "rag.embeddings=runs/emb", "-o", tmp_path / "x.yaml")
    assert rel.returncode == 2 and "rag.args.embeddings: 'runs/emb' is relative" in rel.stderr


def test_builder_refuses_a_generator_app_the_cluster_does_not_run(monkeypatch):
    from rayfleet.errors import ConfigError
    from workloads.serve import rag_llm

    llm_app = yaml.safe_load(A100_LLM.read_text())["applications"][0]
    apps = {"llm": {"status": "RUNNING", "deployed_app_config": llm_app},
            "gone": {"status": "DELETING", "deployed_app_config": llm_app},
            "other": {"status": "RUNNING", "deployed_app_config": {
                "import_path": "workloads.serve.lm:app_builder"}}}

    class Client:
        def get_serve_details(self):
            return {"applications": apps}

    import ray.serve.context

    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda: Client())
    rag_llm.check_generator_deployed("llm")
    for name, needle in [("missing", "app 'missing' is not on this cluster"),
                         ("gone", "app 'gone' is not on this cluster"),
                         ("other", "is 'workloads.serve.lm:app_builder', not the kit's")]:
        with pytest.raises(ConfigError, match=needle):
            rag_llm.check_generator_deployed(name)


def test_the_stream_is_vllms_events_under_rags_name_the_sources_on_the_first():
    import asyncio

    from workloads.serve.rag_llm import as_stream

    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    first = [event({"id": "c1", "model": "tiny", "choices": [{"delta": {"role": "assistant"}}]}),
             event({"id": "c1", "model": "tiny", "choices": [{"delta": {"content": "a"}}]})]

    async def rest():
        yield [event({"id": "c1", "model": "tiny", "choices": [], "usage": {
            "prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}),
               event({"error": {"message": "engine died", "code": 500}})]
        yield ["data: [DONE]\n\n"]

    async def collect():
        return [e async for e in as_stream(first, rest(), "rayfleet-rag", {"sources": ["s"]})]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert [c.get("model") for c in chunks] == ["rayfleet-rag"] * 3 + [None]
    assert chunks[0]["rayfleet"] == {"sources": ["s"]}
    assert not any("rayfleet" in c for c in chunks[1:])
    assert chunks[2]["usage"]["completion_tokens"] == 1 and chunks[2]["choices"] == []
    assert chunks[3] == {"error": {"message": "engine died", "code": 500}}
