"""The `lm` app serving a Hugging Face causal LM from S3 (the moto server) on the session's
real Ray cluster, through the real `openai` client: greedy completions equal what
transformers' own `generate` gives for the same model, usage counts the tokenizer's tokens,
chat goes through the tokenizer's chat template, streaming joins to the same text, and
concurrent prompts of different lengths decode in one batch with the same answers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.workloads.conftest import deploy_lm, serve_shutdown

pytestmark = pytest.mark.ray
MODEL = "tiny-llama"
PROMPT = "def main(self):"


@pytest.fixture(scope="module")
def hf_uri(hf_model_dir, s3_client, checkpoint_bucket) -> str:
    prefix = "models/tiny-llama"
    for f in sorted(hf_model_dir.iterdir()):
        s3_client.upload_file(str(f), checkpoint_bucket, f"{prefix}/{f.name}")
    return f"s3://{checkpoint_bucket}/{prefix}"


@pytest.fixture(scope="module")
def lm_url(ray_cluster, aws_env, hf_uri, tmp_path_factory):
    url = deploy_lm(ray_cluster, hf_uri, tmp_path_factory.mktemp("serve-hf"),
                    env_vars=aws_env, model_name=MODEL, batch_wait_timeout_s=0.3)
    yield url
    serve_shutdown(ray_cluster)


@pytest.fixture(scope="module")
def client(lm_url):
    import openai

    return openai.OpenAI(base_url=lm_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(hf_model_dir):
    """The same model through transformers' own generate (greedy), for reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_model_dir), dtype=torch.float32)

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
