"""The `lm` app serving a Hugging Face run's export from S3 (the moto server) on the session's
real Ray cluster, through the real `openai` client: a few DDP steps of the tiny Llama write
their checkpoints and the hf/ export (in shards, with their index) to S3; lm serves that run's
checkpoint; its greedy completions equal what transformers' own `generate` gives for the
downloaded export, usage counts the tokenizer's tokens (also as the last streamed chunk when
`stream_options.include_usage` asks), chat goes through the tokenizer's chat template,
streaming joins to the same text, concurrent prompts of different lengths decode in one batch
with the same answers, and unknown models and too-long prompts are OpenAI errors. The `llm`
app's config generator refuses a context longer than the S3 export's.

LoRA is trained and served under Ray Train by docs/workloads.md's LoRA line
(tests/cluster/test_readme.py); its resume on the adapter, the optimizer's moments and the
data position is tests/unit/test_lora.py's, a restarted worker group's resume fault 1's.

The same API through the `llm` app (real vLLM, its CPU build, several LoRA adapters of one
base) is asked the same questions on the fake cloud, where its replica downloads the export
and the adapters from the bucket (tests/fakecloud/llm_checks.py); docs/workloads.md's
Hugging Face line serves this kind of run with vLLM on the session's cluster
(tests/cluster/test_readme.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import BIN, run, summary_of
from tests.workloads.conftest import deploy_lm, serve_shutdown

pytestmark = pytest.mark.ray
MODEL = "tiny-llama"
PROMPT = "def main(self):"


@pytest.fixture(scope="module")
def trained(ray_cluster, aws_env, hf_model_dir, sft_data, checkpoint_bucket, s3_client) -> dict:
    """A few DDP steps of the tiny Llama on the instruction rows, checkpoints in S3 (moto): the
    final checkpoint's hf/ export is what the app serves."""
    proc = run([str(BIN / "python"), "-m", "workloads.train", "--model", str(hf_model_dir),
                "--dataset", str(sft_data), "--max-steps", "4", "--checkpoint-every", "4",
                "--batch-size", "8", "--lr", "3e-3", "--name", "serve-hf",
                "--storage-path", f"s3://{checkpoint_bucket}/hf-runs",
                # The 0.56 MB model in several safetensors files and their index, as a big
                # model's export is: what lm and vLLM load below.
                "--hf-shard-size", "200KB"],
               env={**ray_cluster["env"], **aws_env}, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = summary_of(proc.stdout)
    assert summary["hf_export"] == summary["checkpoint"] + "/hf"
    assert summary["hf_export"].startswith(f"s3://{checkpoint_bucket}/hf-runs/serve-hf/")
    prefix = summary["hf_export"].removeprefix(f"s3://{checkpoint_bucket}/") + "/"
    keys = [o["Key"].removeprefix(prefix) for o in s3_client.list_objects_v2(
        Bucket=checkpoint_bucket, Prefix=prefix)["Contents"]]
    shards = [k for k in keys if k.endswith(".safetensors")]
    assert "model.safetensors.index.json" in keys and len(shards) >= 3, keys
    return summary


@pytest.fixture(scope="module")
def hf_uri(trained) -> str:
    return trained["hf_export"]


@pytest.fixture(scope="module")
def lm_url(ray_cluster, aws_env, trained, tmp_path_factory):
    # The run's checkpoint, as README's serve-config example gives it: served from its hf/.
    url = deploy_lm(ray_cluster, trained["checkpoint"], tmp_path_factory.mktemp("serve-hf"),
                    env_vars=aws_env, model_name=MODEL, batch_wait_timeout_s=0.3)
    yield url
    serve_shutdown(ray_cluster)


@pytest.fixture(scope="module")
def export_dir(hf_uri, s3_client, checkpoint_bucket, tmp_path_factory):
    """The export downloaded from S3 with boto3, for transformers to load on its own."""
    bucket, _, prefix = hf_uri[len("s3://"):].partition("/")
    out = tmp_path_factory.mktemp("export")
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket,
                                                        Prefix=prefix + "/")["Contents"]]
    for key in (k for k in keys if not k.endswith("/")):   # pyarrow's folder markers: skip
        s3_client.download_file(bucket, key, str(out / key.rsplit("/", 1)[1]))
    # The export in shards (--hf-shard-size above) and their index, as save_pretrained writes.
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    return out


@pytest.fixture(scope="module")
def client(lm_url):
    import openai

    return openai.OpenAI(base_url=lm_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(export_dir):
    """The same exported model through transformers' own generate (greedy), for reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(export_dir))
    model = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32)

    def greedy(ids: list[int], n: int) -> tuple[str, int]:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=n, do_sample=False)
        new = out[0, len(ids):].tolist()
        return tok.decode(new, skip_special_tokens=True,
                          clean_up_tokenization_spaces=False), len(new)
    return tok, greedy


def test_models_reports_the_models_context(client, lm_url, hf_uri):
    import json
    import urllib.request

    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(lm_url + "/v1/models", timeout=30) as r:
        data = json.loads(r.read())["data"][0]
    assert data["context_length"] == 256 and data["engine"] == "hf"
    assert data["checkpoint"] == hf_uri


def test_llm_config_refuses_a_context_longer_than_the_s3_exports(trained, aws_env,
                                                                 monkeypatch, capsys):
    """Checked in S3 from the run folder, before anything is deployed."""
    from workloads.serve import llm_config

    for key, value in aws_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert llm_config.main(["--device", "cpu", "--model-id", "serve-hf", "--model-source",
                            trained["run_path"], "--max-model-len", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("is more than the model's max_position_embeddings 256 "
                        f"({trained['hf_export']})") and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def api(client):
    """The app's client, with the model name clients give it."""
    return client, MODEL


def test_greedy_completion_is_what_transformers_generates(api, local):
    client, model = api
    tok, greedy = local
    ids = tok(PROMPT).input_ids
    text, n = greedy(ids, 16)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == text
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == n
    assert r.choices[0].finish_reason == ("length" if n == 16 else "stop")
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 2  # token by token
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    # OpenAI's usage chunk: the last, with no choices, counting what the plain answer counts.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), n)
    assert all(c.usage is None for c in chunks[:-1])
    # Sampling with a seed: the stream joins to the same text as the plain answer.
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, seed=5)
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, seed=5,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text


def test_chat_uses_the_tokenizers_template(api, local):
    client, model = api
    tok, greedy = local
    messages = [{"role": "user", "content": "Repeat the word echo twice."}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>\n")
    ids = tok(rendered, add_special_tokens=False).input_ids
    text, n = greedy(ids, 10)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), n)


def test_an_unknown_model_and_too_long_a_prompt_are_openai_errors(api):
    import openai

    client, model = api
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="word " * 400, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and "256 tokens" in e.value.message


def test_concurrent_prompts_of_different_lengths_batch_with_the_same_answers(client, local):
    tok, greedy = local
    prompts = ["x", "import os", "class Foo(Base):", "def main(argv):\n    return 0\n"] * 2
    expected = [greedy(tok(p).input_ids, 8)[0] for p in prompts]

    def one(p: str):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)

    # Whether 8 concurrent requests land in one 0.3 s batch window is the machine's scheduling,
    # not the app's: up to three tries for a batch of more than one, every answer checked.
    sizes = []
    for _ in range(3):
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, prompts))
        assert [r.choices[0].text for r in results] == expected
        sizes.append(max(r.model_extra["rayfleet"]["batch_size"] for r in results))
        if sizes[-1] > 1:
            break
    assert sizes[-1] > 1, f"no batch formed in {len(sizes)} tries: {sizes}"
