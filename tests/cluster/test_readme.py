"""The examples of README and docs/, run as written, in order, against the session's cluster.

Every fenced ```bash block in README.md and the docs/ pages is preceded by a marker:
    <!-- readme-test expect="REGEX" [expect="REGEX" ...] -->   run it; it must exit 0 and
                                                                 print every REGEX
    <!-- readme-test skip: why -->                              not runnable here, and why
The blocks are read from the pages themselves (scripts/readme_blocks.py: README first, then
the docs pages in its PAGES order), so an example cannot drift from what is tested; `make
demo-hf` runs one section's blocks the same way. They run in a copy of the repository's files
(so `$PWD/runs/...` and `cluster-configs/generated/` land there), with the session cluster's
client environment (what `eval "$(rayfleet local env)"` exports) and the venv's bin first on
PATH (what `source .venv/bin/activate` does). The one change made to them: the committed Serve
configs' port 8000 becomes a free port.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from scripts.readme_blocks import FENCE, PAGES, all_examples, examples, find_section
from tests.conftest import BIN, REPO, free_port, run
from tests.workloads.conftest import post_json, serve_shutdown

def _copy_of_repo(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if files.returncode == 0:
        for rel in filter(None, files.stdout.decode().split("\0")):
            src = REPO / rel
            if src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:   # not a git checkout: everything but what .gitignore keeps out of a job's upload
        shutil.copytree(REPO, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".venv", ".git", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"))
    return dest


def _runnable() -> list[tuple[str, str, list[str]]]:
    return [(where, body, expects) for where, body, expects in all_examples(REPO)
            if expects is not None]


def _split() -> int:
    """Blocks up to the one that deploys `rag` run first (the rag tests need it deployed);
    the rest (a later `serve deploy` replaces it) run after those tests."""
    blocks = _runnable()
    return next(i for i, (_, body, _) in enumerate(blocks) if "serve/rag.yaml" in body) + 1


def _run_blocks(blocks, work: Path, env: dict, port: int) -> None:
    for where, body, expects in blocks:
        body = body.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        proc = run(["bash", "-e", "-o", "pipefail", "-c", body], env=env, cwd=work,
                   timeout=420)
        out = proc.stdout + proc.stderr
        where = f"{where}: exit {proc.returncode}\n{out[-4000:]}"
        assert proc.returncode == 0, where
        for pattern in expects:
            assert re.search(pattern, out), f"{where}\nexpected: {pattern}"


@pytest.fixture(scope="module")
def readme(ray_cluster, tmp_path_factory):
    """The runnable blocks up to the `rag` deploy, in the pages' order; what they leave (files,
    and the `rag` app) is what the tests below look at."""
    work = _copy_of_repo(tmp_path_factory.mktemp("readme") / "checkout")
    port = free_port()
    for cfg in (work / "cluster-configs" / "serve").glob("*.yaml"):
        cfg.write_text(cfg.read_text().replace("port: 8000", f"port: {port}"))
    env = {**ray_cluster["env"], "PATH": f"{BIN}:{ray_cluster['env'].get('PATH', '')}"}
    serve_shutdown(ray_cluster)   # Serve's HTTP port is fixed by the first deploy
    try:
        _run_blocks(_runnable()[:_split()], work, env, port)
        yield {"work": work, "storage": ray_cluster["storage"], "env": env, "port": port,
               "rag_url": f"http://127.0.0.1:{port}"}
    except BaseException:
        serve_shutdown(ray_cluster)
        raise


@pytest.fixture(scope="module")
def readme_rest(readme, ray_cluster):
    """The blocks after the `rag` deploy (the Hugging Face line, the llm config, the cloud
    steps), once the rag tests are done, in the same checkout and shell state."""
    try:
        _run_blocks(_runnable()[_split():], readme["work"], readme["env"], readme["port"])
        yield readme
    finally:
        serve_shutdown(ray_cluster)


def test_demo_hf_runs_the_hugging_face_sections_blocks():
    page, text = find_section("Your own Hugging Face model", REPO)
    assert page == "docs/workloads.md"
    blocks = [b for _, b, e in examples(text, page) if e]
    assert len(blocks) == 4 and "workloads.train --model" in blocks[0]
    assert "serve deploy cluster-configs/generated/llm-sft-cpu.yaml" in blocks[2]
    proc = run([str(BIN / "python"), str(REPO / "scripts" / "readme_blocks.py"),
                "Your own Hugging Face model"], check=True)
    assert proc.stdout.strip() == "\n".join(blocks)
    assert "readme_blocks.py \"Your own Hugging Face model\"" in \
        (REPO / "scripts" / "demo_hf.sh").read_text()
    bad = run([str(BIN / "python"), str(REPO / "scripts" / "readme_blocks.py"), "Nope"])
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "readme_blocks: README has no section '## Nope'"


def test_every_bash_example_in_readme_is_marked():
    # Every page of docs/ is one the examples are read from, so none of its blocks is skipped.
    assert {p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")} <= set(PAGES)
    found = []
    for page in PAGES:
        text = (REPO / page).read_text()
        on_page = examples(text, page)
        assert len(on_page) == len(FENCE.findall(text)), \
            f"{page}: a ```bash block without a readme-test marker"
        found += on_page
    assert sum(e is not None for _, _, e in found) >= 6


@pytest.mark.ray
@pytest.mark.slow
def test_readme_examples_run_as_written(readme):
    # What the examples' text says they leave: outputs where the user asked for them.
    work, storage = readme["work"], readme["storage"]
    assert (work / "runs" / "data" / "smoke-seq64" / "_manifest.json").is_file()
    assert (storage / "smoke-ddp" / "loss.png").is_file()
    assert (storage / "smoke-streaming" / "metrics.csv").is_file()
    assert (storage / "embeddings" / "_manifest.json").is_file()


# ------------------------------------------------- the rag app README's example left deployed

@pytest.mark.ray
@pytest.mark.slow
def test_retriever_finds_the_document_that_answers(readme):
    status, body = post_json(readme["rag_url"] + "/v1/retrieve",
                         {"query": "How do I read and write CSV files?", "k": 3})
    assert status == 200
    hits = body["data"]
    assert [h["id"] for h in hits][0] == "csv"
    assert hits[0]["score"] > hits[1]["score"] >= hits[2]["score"]


@pytest.mark.ray
@pytest.mark.slow
def test_rag_answers_through_the_openai_client_with_its_sources(readme):
    import openai

    client = openai.OpenAI(base_url=readme["rag_url"] + "/v1", api_key="unused",
                           max_retries=0, timeout=60)
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


@pytest.mark.ray
@pytest.mark.slow
def test_rag_refuses_bad_requests(readme):
    status, body = post_json(readme["rag_url"] + "/v1/retrieve", {"query": "", "k": 3})
    assert status == 400 and body["error"]["param"] == "query"
    status, body = post_json(readme["rag_url"] + "/v1/chat/completions",
                         {"model": "rayfleet-rag", "k": 500,
                          "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and body["error"]["param"] == "k"


def test_rag_refuses_a_missing_index_before_deploying(tmp_path):
    from rayfleet.errors import CheckpointError
    from workloads.serve.rag import check_index

    with pytest.raises(CheckpointError, match="_manifest.json"):
        check_index(str(tmp_path))


# ------------------------------------------- after rag: the Hugging Face line and the cloud steps

@pytest.mark.ray
@pytest.mark.slow
def test_readme_hugging_face_line_and_cloud_steps(readme_rest):
    work, storage = readme_rest["work"], readme_rest["storage"]
    assert (work / "llm.yaml").is_file()
    assert (work / "cluster-configs" / "generated" / "dev.yaml").is_file()
    # The instruction rows README's data job wrote, checked row by row.
    from transformers import AutoTokenizer

    from tests.workloads.test_data_hf import check_instruction_output

    model = work / "runs" / "tiny-llama"
    records = [json.loads(line) for line in (work / "runs" / "sft.jsonl").read_text()
               .splitlines()]
    check_instruction_output(work / "runs" / "data" / "sft", records,
                             AutoTokenizer.from_pretrained(str(model)), str(model), 48)
    run_dir = storage / "sft-tiny-llama"
    exports = list(run_dir.glob("checkpoint_*/hf/model.safetensors"))
    assert len(exports) == 1
    import yaml

    llm = yaml.safe_load((work / "cluster-configs" / "generated" / "llm-sft.yaml").read_text())
    source = llm["applications"][0]["args"]["llm_configs"][0]["model_loading_config"]
    assert source["model_source"] == str(exports[0].parent)
