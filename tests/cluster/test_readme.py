"""The examples of README and docs/, run as written, in order, against the session's cluster.

Every fenced ```bash block in README.md and the docs/ pages is preceded by a marker:
    <!-- readme-test expect="REGEX" [expect="REGEX" ...] -->   run it; it must exit 0, print
                                                                 every REGEX and no traceback
    <!-- readme-test skip: why -->                              not runnable here, and why
The blocks are read from the pages themselves (scripts/readme_blocks.py: README first, then
the docs pages in its PAGES order), so an example cannot drift from what is tested; `make
demo-hf` runs one section's blocks the same way. They run in a copy of the repository's files
(so `$PWD/runs/...` and `cluster-configs/generated/` land there), each page's blocks in one
bash of its own, one after another, as a reader's terminal: what a block exports, `eval`s or
`cd`s carries over to the page's next block, and nothing else is preset. The shell starts with
the venv's bin first on PATH (what `source .venv/bin/activate` does), RAYFLEET_HOME naming the
session's cluster (so `rayfleet local up` finds it up, and `rayfleet local env` prints its
client environment) and a HOME of its own whose `rayfleet-runs` (the default storage) is the
session cluster's storage folder; no RAY_* variable and no RAYFLEET_STORAGE: a block that
forgot `eval "$(rayfleet local env)"` fails. The one change made to the blocks: the committed
Serve configs' port 8000 becomes a free port.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from scripts.readme_blocks import FENCE, PAGES, all_examples, examples, find_section
from tests.blockshell import PageShell, check_block
from tests.conftest import BIN, CLOCK, REPO, copy_of_checkout, free_port, run
from tests.workloads.conftest import post_json, serve_shutdown

def _runnable() -> list[tuple[str, str, list[str]]]:
    return [(where, body, expects) for where, body, expects in all_examples(REPO)
            if expects is not None]


def _split() -> int:
    """Blocks up to the one that deploys `rag` run first (the rag tests need it deployed);
    the rest (a later `serve deploy` replaces it) run after those tests."""
    blocks = _runnable()
    return next(i for i, (_, body, _) in enumerate(blocks) if "serve/rag.yaml" in body) + 1


def _split_hf() -> int:
    """...then the Hugging Face line up to `rag` over its vLLM engine (the rag-over-vLLM tests
    need both apps deployed), then the rest (the LoRA line's `serve deploy` replaces them)."""
    blocks = _runnable()
    return next(i for i, (_, body, _) in enumerate(blocks) if "serve/rag-llm.yaml" in body) + 1


def _reader_env(ray_cluster, home: Path) -> dict:
    """What a reader's fresh terminal has, plus the venv on PATH (see the module docstring)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("RAYFLEET_STORAGE", "RAYFLEET_HOME")}
    home.mkdir(parents=True, exist_ok=True)
    (home / "rayfleet-runs").symlink_to(ray_cluster["storage"], target_is_directory=True)
    env.update(HOME=str(home), RAYFLEET_HOME=str(ray_cluster["home"]),
               PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    return env


def _run_blocks(blocks, shells: dict, open_shell, port: int, outputs: list) -> None:
    """Run `blocks` in their pages' shells; (where, body, output) of each goes to `outputs`."""
    for where, body, expects in blocks:
        page = where.split(" line ")[0]
        if page not in shells:
            shells[page] = open_shell(page)
        body = body.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        t0, c0 = time.monotonic(), CLOCK.seconds()
        status, out = shells[page].run(body, timeout=600)
        c1 = CLOCK.seconds()
        cpu = f", {c1 - c0:.1f} CPU-s" if c0 is not None and c1 is not None else ""
        print(f"readme: {where}: {time.monotonic() - t0:.1f} s{cpu}", flush=True)
        outputs.append((where, body, out))
        check_block(where, status, out, expects)


@pytest.fixture(scope="module")
def readme(ray_cluster, tmp_path_factory):
    """The runnable blocks up to the `rag` deploy, in the pages' order; what they leave (files,
    and the `rag` app) is what the tests below look at."""
    root = tmp_path_factory.mktemp("readme")
    work = copy_of_checkout(root / "checkout")
    port = free_port()
    for cfg in (work / "cluster-configs" / "serve").glob("*.yaml"):
        cfg.write_text(cfg.read_text().replace("port: 8000", f"port: {port}"))
    env = _reader_env(ray_cluster, root / "home")
    (root / "logs").mkdir()
    shells: dict[str, PageShell] = {}
    outputs: list[tuple[str, str, str]] = []
    serve_shutdown(ray_cluster)   # Serve's HTTP port is fixed by the first deploy
    try:
        _run_blocks(_runnable()[:_split()], shells,
                    lambda page: PageShell(page, work, env, root / "logs"), port, outputs)
        yield {"work": work, "storage": ray_cluster["storage"], "port": port,
               "shells": shells, "open_shell": lambda page: PageShell(page, work, env,
                                                                        root / "logs"),
               "rag_url": f"http://127.0.0.1:{port}", "outputs": outputs}
    except BaseException:
        serve_shutdown(ray_cluster)
        raise
    finally:
        for shell in shells.values():
            shell.close()


def _run_after(readme, ray_cluster, start: int, stop: int | None):
    try:
        _run_blocks(_runnable()[start:stop], readme["shells"], readme["open_shell"],
                    readme["port"], readme["outputs"])
    except BaseException:
        serve_shutdown(ray_cluster)
        raise


@pytest.fixture(scope="module")
def readme_hf(readme, ray_cluster):
    """The blocks after the `rag` deploy up to `rag` over vLLM (the Hugging Face line: a
    fine-tune, `lm`, vLLM's engine start, rag on it), once the rag tests are done, in the same
    checkout and the same page shells."""
    _run_after(readme, ray_cluster, _split(), _split_hf())
    return {**readme, "llm_url": f"http://127.0.0.1:{readme['port']}",
            "rag_llm_url": f"http://127.0.0.1:{readme['port']}/rag"}


@pytest.fixture(scope="module")
def readme_rest(readme_hf, ray_cluster):
    """The blocks after that (the A100 config, the LoRA line, the cloud steps), once the
    rag-over-vLLM tests are done."""
    try:
        _run_after(readme_hf, ray_cluster, _split_hf(), None)
        yield readme_hf
    finally:
        serve_shutdown(ray_cluster)


def test_demo_hf_runs_the_hugging_face_sections_blocks():
    page, text = find_section("Your own Hugging Face model", REPO)
    assert page == "docs/workloads.md"
    blocks = [b for _, b, e in examples(text, page) if e]
    assert len(blocks) == 5 and "workloads.train --model" in blocks[0]
    assert "serve deploy cluster-configs/generated/llm-sft-cpu.yaml" in blocks[2]
    assert "cluster-configs/serve/rag-llm.yaml" in blocks[3]
    proc = run([str(BIN / "python"), str(REPO / "scripts" / "readme_blocks.py"),
                "Your own Hugging Face model"], check=True)
    assert proc.stdout.strip() == "\n".join(blocks)
    assert "readme_blocks.py \"Your own Hugging Face model\"" in \
        (REPO / "scripts" / "demo_hf.sh").read_text()
    bad = run([str(BIN / "python"), str(REPO / "scripts" / "readme_blocks.py"), "Nope"])
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "readme_blocks: README has no section '## Nope'"


def _indented_code(text: str) -> list[int]:
    """Line numbers of Markdown's indented code blocks (4+ spaces after a blank line, not a
    list item's continuation), outside fences: commands there would escape the markers."""
    lines, found, fenced = text.split("\n"), [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or not re.match(r"( {4,}|\t)\S", line) or i == 0 or lines[i - 1].strip():
            continue
        before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        if not re.match(r"\s|[-*+] |\d+\. ", before):
            found.append(i + 1)
    return found


def test_an_indented_code_block_is_found():
    text = ("Run this:\n\n    make setup\n\n- a list item\n\n    its second paragraph\n\n"
            "```bash\n    indented inside a fence\n```\n")
    assert _indented_code(text) == [3]


def test_every_bash_example_in_readme_is_marked():
    # Every page of docs/ is one the examples are read from, so none of its blocks is skipped.
    assert {p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")} <= set(PAGES)
    found = []
    for page in PAGES:
        text = (REPO / page).read_text()
        on_page = examples(text, page)
        assert len(on_page) == len(FENCE.findall(text)), \
            f"{page}: a ```bash block without a readme-test marker"
        # Commands in an indented block (or an indented fence) escape the markers: fence them.
        assert _indented_code(text) == [], f"{page}: indented code at lines " \
            f"{_indented_code(text)}; use a fenced ```bash block with a marker (or ```text)"
        assert not re.search(r"^[ \t]+```", text, re.M), f"{page}: an indented fence"
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


# ------------------------------------------- after rag: the Hugging Face line, rag over its vLLM

def _chat(base: str, model: str, messages: list, **kw):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    return client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                          temperature=0, **kw)


@pytest.mark.ray
@pytest.mark.slow
# Its fixture runs the Hugging Face line's blocks to rag over vLLM (a fine-tune, `lm`, vLLM's
# engine start, rag): 5 to 8 min beside the rehearsal on 2 cores, over the suite's 600 s per
# test (each block still has its own 600 s).
@pytest.mark.timeout(1200)
def test_rag_over_vllm_answers_with_sources_as_its_engine_would(readme_hf):
    """docs/workloads.md's rag-over-vLLM block left both apps deployed: retrieval finds the
    document that answers; the answer is the `llm` app's own greedy answer to the messages
    rag built (the documents in the chat template's user turn); streamed, with
    `include_usage`, it is the same answer, the same usage and the same sources."""
    question = [{"role": "user", "content": "How do I read and write CSV files?"}]
    r = _chat(readme_hf["rag_llm_url"], "rayfleet-rag", question)
    extra = r.model_extra["rayfleet"]
    assert extra["sources"][0]["id"] == "csv" and len(extra["sources"]) == 3
    assert extra["generator"] == "sft-tiny-llama" and r.model == "rayfleet-rag"
    sent = extra["messages"]
    assert sent[-1]["content"].startswith("Answer the question using these documents.\n\n# csv:")
    assert sent[-1]["content"].endswith("Question: How do I read and write CSV files?")
    direct = _chat(readme_hf["llm_url"], "sft-tiny-llama", sent)
    assert r.choices[0].message.content == direct.choices[0].message.content
    assert r.usage.prompt_tokens == direct.usage.prompt_tokens
    assert r.usage.completion_tokens == direct.usage.completion_tokens >= 1

    chunks = list(_chat(readme_hf["rag_llm_url"], "rayfleet-rag", question, stream=True,
                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        r.usage.completion_tokens
    assert chunks[0].model_extra["rayfleet"]["sources"] == extra["sources"]
    assert {c.model for c in chunks} == {"rayfleet-rag"}


@pytest.mark.ray
@pytest.mark.slow
def test_rag_without_its_generator_app_is_one_line(readme_hf, ray_cluster):
    """rag deployed without the `llm` app (`serve deploy` of a file without it removes it):
    its next answer is a 503 naming the app, and a rag whose build sees no such app fails in
    `serve status` on one line; `serve-config` refuses that file before any deploy."""
    import yaml

    from workloads.serve.rag_llm import RECHECK_S

    work = readme_hf["work"]
    both = yaml.safe_load((work / "cluster-configs" / "generated" / "rag-llm-sft.yaml")
                          .read_text())
    alone = work / "rag-alone.yaml"
    refused = run([str(BIN / "rayfleet"), "serve-config", "cluster-configs/serve/rag-llm.yaml",
                   "-o", str(alone)], cwd=work, env=ray_cluster["env"], timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and \
        "args.generator_app: app 'llm' is not in this Serve config" in refused.stderr
    assert not alone.exists()

    def deploy(apps: list) -> None:
        alone.write_text(yaml.safe_dump({**both, "applications": apps}))
        run([str(BIN / "serve"), "deploy", str(alone)], env=ray_cluster["env"], check=True,
            timeout=120)

    rag = next(a for a in both["applications"] if a["name"] == "rag")
    deploy([rag])   # rag as it was (not rebuilt); the llm app removed
    time.sleep(RECHECK_S + 1)   # what rag found before is asked about again
    status, body = post_json(readme_hf["rag_llm_url"] + "/v1/chat/completions",
                             {"model": "rayfleet-rag",
                              "messages": [{"role": "user", "content": "csv?"}]})
    assert status == 503 and body["error"]["message"].startswith(
        "the generator app 'llm' is not running on this cluster"), body
    deploy([{**rag, "args": {**rag["args"], "model_name": "rebuilt"}}])   # a new build
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        out = run([str(BIN / "serve"), "status"], env=ray_cluster["env"], timeout=60).stdout
        app = (yaml.safe_load(out).get("applications") or {}).get("rag") or {}
        if app.get("status") == "DEPLOY_FAILED":
            break
        time.sleep(2)
    assert app.get("status") == "DEPLOY_FAILED", out
    assert app["message"].splitlines()[-1] == (
        "rag app: args.generator_app: app 'llm' is not on this cluster; deploy the `llm` app "
        "with rag (one Serve config: `rayfleet serve-config <llm config> <rag config>`)")


# ------------------------------------------- then the LoRA line and the cloud steps

@pytest.mark.ray
@pytest.mark.slow
# Its fixture runs the Hugging Face line's blocks (a fine-tune, then vLLM's engine start, then
# the LoRA run and lm serving it): 7 to over 10 min beside the rehearsal on 2 cores (12.4 min
# at a load average of 8 to 10, the LoRA blocks 3.7 min of it), so the suite's 600 s per test
# cannot hold it (each block still has its own 600 s).
@pytest.mark.timeout(1200)
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


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(1200)   # its fixture is the test's above (the same run of the blocks)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_readme_lora_line_serves_base_and_adapter_as_peft_answers(readme_rest):
    """docs/workloads.md's LoRA line: the run left an adapter (and no merged hf/: no
    --lora-merge), and what `lm`, deployed by `serve deploy` with `checkpoint: latest` on that
    run, answered through the openai client is PEFT's greedy answer for the base with that
    adapter, not the base's own."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work, storage = readme_rest["work"], readme_rest["storage"]
    adapters = list((storage / "lora-tiny-llama").glob("checkpoint_*/adapter"))
    assert len(adapters) == 1 and not (adapters[0].parent / "hf").exists(), adapters
    served = [out for _, body, out in readme_rest["outputs"]
              if "serve deploy cluster-configs/serve/lm.yaml" in body and "lora-tiny-llama" in body]
    assert len(served) == 1, "docs/workloads.md: no (or more than one) LoRA serve block"
    answers = [ln for ln in served[0].splitlines() if ln.startswith("A: ")]
    assert len(answers) == 1, served[0][-2000:]

    base = work / "runs" / "tiny-llama"
    tok = AutoTokenizer.from_pretrained(str(base))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat the word golf twice."}],
                                     tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(prompt, add_special_tokens=False).input_ids])

    def greedy(model) -> str:   # the block's request: max_tokens 16, temperature 0
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=16, do_sample=False)
        return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True,
                          clean_up_tokenization_spaces=False)

    with torch.no_grad():
        own = greedy(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32))
        peft = greedy(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
            str(base), dtype=torch.float32), str(adapters[0])))
    assert answers[0] == f"A: {peft}" and peft != own, (answers[0], peft, own)
