"""The `lm` app serving a Hugging Face run's export from S3 (the moto server) on the session's
real Ray cluster, through the real `openai` client: a few DDP steps of the tiny Llama write
their checkpoints and the hf/ export to S3; the app serves that run's checkpoint; greedy
completions equal what transformers' own `generate` gives for the downloaded export, usage
counts the tokenizer's tokens, chat goes through the tokenizer's chat template, streaming joins
to the same text, concurrent prompts of different lengths decode in one batch with the same
answers, and the vLLM config points at the same export."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import BIN, run, summary_of
from tests.workloads.conftest import deploy_lm, serve_shutdown

pytestmark = pytest.mark.ray
MODEL = "tiny-llama"
PROMPT = "def main(self):"


@pytest.fixture(scope="module")
def trained(ray_cluster, aws_env, hf_model_dir, sft_data, checkpoint_bucket) -> dict:
    """A few DDP steps of the tiny Llama on the instruction rows, checkpoints in S3 (moto): the
    final checkpoint's hf/ export is what the app serves."""
    proc = run([str(BIN / "python"), "-m", "workloads.train", "--model", str(hf_model_dir),
                "--dataset", str(sft_data), "--max-steps", "4", "--checkpoint-every", "4",
                "--batch-size", "8", "--lr", "3e-3", "--name", "serve-hf",
                "--storage-path", f"s3://{checkpoint_bucket}/hf-runs"],
               env={**ray_cluster["env"], **aws_env}, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = summary_of(proc.stdout)
    assert summary["hf_export"] == summary["checkpoint"] + "/hf"
    assert summary["hf_export"].startswith(f"s3://{checkpoint_bucket}/hf-runs/serve-hf/")
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
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in
                                                                     out.iterdir()}
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


def test_llm_config_points_vllm_at_the_runs_s3_export(trained, hf_uri, aws_env, monkeypatch,
                                                      tmp_path):
    """The vLLM config for the same run, given its run folder in S3: a cloud mirror of the
    export, checked offline against the export's files and context."""
    import yaml

    from workloads.serve import llm_config

    for key, value in aws_env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "llm.yaml"
    run_folder = trained["run_path"]
    assert llm_config.main(["--model-id", "serve-hf", "--model-source", run_folder,
                            "--max-model-len", "256", "--output", str(out)]) == 0
    llm = yaml.safe_load(out.read_text())["applications"][0]["args"]["llm_configs"][0]
    assert llm["model_loading_config"]["model_source"] == {"bucket_uri": hf_uri}
    assert llm_config.main(["--model-id", "serve-hf", "--model-source", run_folder,
                            "--max-model-len", "4096", "--output", str(out)]) == 2


def test_greedy_completion_is_what_transformers_generates(client, local):
    tok, greedy = local
    ids = tok(PROMPT).input_ids
    text, n = greedy(ids, 16)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == text
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == n
    assert r.choices[0].finish_reason == ("length" if n == 16 else "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                            temperature=0, stream=True))
    assert len([c for c in chunks if c.choices[0].text]) > 2    # token by token
    assert "".join(c.choices[0].text for c in chunks) == text
    # Sampling with a seed: the stream joins to the same text as the plain answer.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=5)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=5,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text


def test_chat_uses_the_tokenizers_template(client, local):
    tok, greedy = local
    messages = [{"role": "user", "content": "Repeat the word echo twice."}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>\n")
    ids = tok(rendered, add_special_tokens=False).input_ids
    text, n = greedy(ids, 10)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                 max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_concurrent_prompts_of_different_lengths_batch_with_the_same_answers(client, local):
    tok, greedy = local
    prompts = ["x", "import os", "class Foo(Base):", "def main(argv):\n    return 0\n"] * 2
    expected = [greedy(tok(p).input_ids, 8)[0] for p in prompts]

    def one(p: str):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    assert [r.choices[0].text for r in results] == expected
    assert max(r.model_extra["rayfleet"]["batch_size"] for r in results) > 1


def test_too_long_a_prompt_is_an_openai_error(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 400, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and "256 tokens" in e.value.message
