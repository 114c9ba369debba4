"""What the rehearsal asks of the `llm` app (real vLLM, its CPU build, on the fake A100 worker,
its model and LoRA adapters downloaded from the bucket by the node's own role): the OpenAI API
as the `openai` client uses it, each answer checked against transformers' and PEFT's own greedy
`generate` on the same export, downloaded here.

- completions: greedy text, usage (also as the last streamed chunk when
  `stream_options.include_usage` asks), streamed token by token to the same text;
- chat: through the tokenizer's chat template, streamed with the assistant's role first;
- errors as OpenAI bodies: an unknown model 404, a prompt past the context 400;
- LoRA: several adapters of one base in one replica (Ray's lora_config, fetched from S3),
  `<model>:<adapter>` picking one and the base model id none, each answering what PEFT gives
  for it; an adapter the bucket does not hold is a 404.

The adapters are made here, as a user's fine-tune would leave them (PEFT's save_pretrained),
with weights drawn at random rather than trained (training LoRA under Ray Train, a killed
worker and its resume, is tests/workloads/test_serve_hf.py's), and a second one with its B
matrices negated, so that the three models answer three ways."""

from __future__ import annotations

from pathlib import Path

import pytest

PROMPT = "def main(self):"
# The modules the adapters adapt: every linear layer of the Llama, lm_head included.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "lm_head"]
LORA_RANK = 8


def download(s3, bucket: str, prefix: str, dest: Path) -> Path:
    """Every object under ``prefix``/ into ``dest`` (flat), pyarrow's folder markers skipped."""
    dest.mkdir(parents=True)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    for key in (o["Key"] for p in pages for o in p.get("Contents", [])):
        if not key.endswith("/"):
            s3.download_file(bucket, key, str(dest / key.rsplit("/", 1)[1]))
    return dest


def make_adapters(export_dir: Path, out: Path) -> dict[str, Path]:
    """Two LoRA adapters of the export, saved as PEFT saves them: {name: folder}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=LORA_RANK, lora_alpha=16,
                                            target_modules=LORA_TARGETS,
                                            init_lora_weights=False))
    one, neg = out / "one", out / "neg"
    model.save_pretrained(str(one))
    model.save_pretrained(str(neg))
    weights = load_file(str(neg / "adapter_model.safetensors"))
    save_file({k: -v if ".lora_B." in k else v for k, v in weights.items()},
              str(neg / "adapter_model.safetensors"))
    return {"one": one, "neg": neg}


def upload(s3, bucket: str, prefix: str, adapters: dict[str, Path]) -> None:
    for name, folder in adapters.items():
        for f in folder.iterdir():
            s3.upload_file(str(f), bucket, f"{prefix}/{name}/{f.name}")


class Reference:
    """transformers' greedy generate on the export, with or without a PEFT adapter."""

    def __init__(self, export_dir: Path):
        from transformers import AutoTokenizer

        self.export_dir = export_dir
        self.tok = AutoTokenizer.from_pretrained(str(export_dir))

    def greedy(self, ids: list[int], n: int, adapter: Path | None = None) -> tuple[str, int]:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.export_dir), dtype=torch.float32)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter))
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(
                1, len(ids), dtype=torch.long), max_new_tokens=n, do_sample=False)
        new = out[0, len(ids):].tolist()
        return self.tok.decode(new, skip_special_tokens=True,
                               clean_up_tokenization_spaces=False), len(new)


def check_completions(client, model: str, ref: Reference) -> None:
    ids = ref.tok(PROMPT).input_ids
    text, n = ref.greedy(ids, 16)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == text, (r.choices[0].text, text)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n), r.usage
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == text, texts
    assert len([t for t in texts if t]) > 1 or n < 3, texts   # token by token
    # OpenAI's usage chunk: the last, with no choices, counting what the plain answer counts.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), n)


def check_chat(client, model: str, ref: Reference) -> None:
    messages = [{"role": "user", "content": "Repeat the word echo twice."}]
    rendered = ref.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = ref.tok(rendered, add_special_tokens=False).input_ids
    text, n = ref.greedy(ids, 10)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text, (r.choices[0].message.content, text)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n), r.usage
    chunks = list(client.chat.completions.create(model=model, messages=messages,
                                                 max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def check_errors(client, model: str, context: int) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="word " * (context + 144), max_tokens=2)
    assert str(context) in e.value.message, e.value.message


def check_adapters(client, model: str, ref: Reference, adapters: dict[str, Path]) -> None:
    import openai

    ids = ref.tok(PROMPT).input_ids
    answers = {}
    for name, folder in [("", None), *adapters.items()]:
        want, _ = ref.greedy(ids, 12, adapter=folder)
        model_id = f"{model}:{name}" if name else model
        r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12,
                                      temperature=0)
        assert r.choices[0].text == want, (model_id, r.choices[0].text, want)
        answers[name] = want
    assert len(set(answers.values())) == 3, answers    # three models, three answers
    # Ray's LoRA loader finds no adapter_config.json there: an OpenAI 404, not a crash, a
    # timeout or a dropped connection.
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=f"{model}:no-such-adapter", prompt=PROMPT,
                                  max_tokens=2)
