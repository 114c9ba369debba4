"""The `lm` app's Hugging Face path without a Ray cluster: what `checkpoint` accepts and refuses
in one line (checked without loading weights), the HF engine's batching and incremental
detokenization, and the `llm` config generator given a run's Hugging Face export (local and
s3:// on the moto server)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import yaml

from rayfleet.errors import RayfleetError
from workloads.serve import llm_build, llm_config

MULTIBYTE = "naïve café → 日本語 🚀 ok"


def _checkpoint_with_export(root: Path, hf_model_dir: Path, name: str = "run") -> Path:
    """A final workloads.train checkpoint holding an hf/ export, its marker written by the
    trainer's own writer (every file listed), and the bookkeeping `latest` reads."""
    from workloads.common.runs import write_marker
    from workloads.common.runs import SNAPSHOT

    ckpt = root / name / "checkpoint_000003"
    shutil.copytree(hf_model_dir, ckpt / "hf")
    write_marker(ckpt, step=3, strategy="ddp", world_size=1, final=True)
    (root / name / SNAPSHOT).write_text(json.dumps(
        {"latest_checkpoint_result": {"checkpoint_dir_name": ckpt.name}}))
    return ckpt


def _refusal(args: dict) -> str:
    from workloads.serve.lm import check_args

    with pytest.raises(RayfleetError) as e:
        check_args(args)
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 2
    return msg


# --------------------------------------------------------------------------- checkpoint

def test_hf_folder_is_accepted_as_it_is(hf_model_dir):
    from workloads.serve.lm import check_args
    from workloads.serve.model_source import check_checkpoint

    args = check_args({"checkpoint": str(hf_model_dir)})
    assert args["checkpoint"] == str(hf_model_dir)
    info = check_checkpoint(str(hf_model_dir))
    assert info["engine"] == "hf" and info["model_type"] == "llama"
    assert info["vocab_size"] == info["tokenizer_size"] == 512
    assert info["max_position_embeddings"] == 256 and info["chat_template"] is True


def test_run_checkpoint_serves_its_hf_export_also_as_latest(tmp_path, hf_model_dir, monkeypatch):
    from workloads.serve.lm import check_args
    from workloads.serve.model_source import check_checkpoint

    ckpt = _checkpoint_with_export(tmp_path / "runs", hf_model_dir)
    info = check_checkpoint(str(ckpt))
    assert info["step"] == 3 and info["engine"] == "hf" and info["source"] == f"{ckpt}/hf"
    assert check_args({"checkpoint": str(ckpt)})["checkpoint"] == f"{ckpt}/hf"
    monkeypatch.setenv("RAYFLEET_STORAGE", str(tmp_path / "runs"))
    assert check_args({})["checkpoint"] == f"{ckpt}/hf"          # `latest`
    # The export is checked against the marker like every other file of the checkpoint.
    weights = ckpt / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert "is corrupt: hf/model.safetensors is" in _refusal({"checkpoint": str(ckpt)})


def test_folder_without_a_model_is_one_line(tmp_path, hf_model_dir):
    empty = tmp_path / "notes"
    empty.mkdir()
    (empty / "README.md").write_text("no model here\n")
    assert _refusal({"checkpoint": str(empty)}) == (
        f"checkpoint {empty} holds no model: neither a workloads.train checkpoint "
        "(rayfleet_checkpoint.json) nor a Hugging Face model folder (config.json + "
        "*.safetensors + tokenizer)")
    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    shutil.copy(hf_model_dir / "config.json", no_weights)
    assert "holds a config.json but no weights" in _refusal({"checkpoint": str(no_weights)})
    no_config = tmp_path / "weights-only"
    no_config.mkdir()
    shutil.copy(hf_model_dir / "model.safetensors", no_config)
    assert "holds no Hugging Face model (no config.json" in _refusal(
        {"checkpoint": str(no_config)})


def test_model_without_tokenizer_is_one_line(tmp_path, hf_model_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(hf_model_dir / name, bare)
    msg = _refusal({"checkpoint": str(bare)})
    assert msg.startswith(f"args.checkpoint: {bare} holds a model but no tokenizer"), msg


def test_tokenizer_larger_than_the_models_vocabulary_is_one_line(tmp_path, hf_model_dir):
    from ray.serve.exceptions import RayServeException

    from tests.hf_fixtures import make_model
    from workloads.serve.lm import app_builder

    small = tmp_path / "small-vocab"
    make_model(small, 300)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (hf_model_dir / name).exists():
            shutil.copy(hf_model_dir / name, small)
    msg = _refusal({"checkpoint": str(small)})
    assert "the tokenizer has 512 tokens but the model's vocab_size is 300" in msg, msg
    with pytest.raises(RayServeException, match="^lm app: args.checkpoint: .*vocab_size is 300"):
        app_builder({"checkpoint": str(small)})


# --------------------------------------------------------------------------- engine

def test_incremental_detokenization_of_multibyte_text(hf_model_dir):
    from transformers import AutoTokenizer

    from workloads.serve.engines import HFDecoder

    tok = AutoTokenizer.from_pretrained(str(hf_model_dir))
    ids = tok(MULTIBYTE, add_special_tokens=False).input_ids
    # Byte-level BPE splits the rarer characters over several tokens: each alone is no text.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    dec = HFDecoder(tok, tok("say: ").input_ids)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]        # some tokens ended mid-character and were held back
    assert len([p for p in pieces if p]) > 5   # and the rest streamed as it came


@pytest.fixture(scope="module")
def core(hf_model_dir):
    """LMCore (the replica's model and @serve.batch loop) outside Serve. Serve's batch queue
    only warns when max_batch_size exceeds the replica's max_ongoing_requests, reading the
    replica context that does not exist here; that check is all that is switched off.
    The batch queue lives on one event loop, as in a replica: every call runs on `core.loop`."""
    from ray.serve import batching

    from workloads.serve.lm import LMCore

    saved = batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests
    batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda s: None
    loop = asyncio.new_event_loop()
    try:
        c = LMCore(str(hf_model_dir), max_batch_size=4, batch_wait_timeout_s=0.2)
        c.loop = loop
        yield c
    finally:
        batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = saved
        loop.close()


def _run(core, coro, timeout: float = 60):
    return core.loop.run_until_complete(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def reference(hf_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_model_dir), dtype=torch.float32)

    def greedy(prompt: str, n: int) -> tuple[list[int], list[int]]:
        ids = tok(prompt).input_ids
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=n, do_sample=False)
        return ids, out[0, len(ids):].tolist()
    return tok, greedy


def test_prompts_of_different_lengths_decode_together_as_they_would_alone(core, reference):
    tok, greedy = reference
    prompts = ["x", "import os\n", "def main(self, argv):\n    return"]

    async def run():
        return await asyncio.gather(*(core.generate(p, max_tokens=8, temperature=0)
                                      for p in prompts))
    results = _run(core, run())
    assert max(r["batch_size"] for r in results) == 3       # one left-padded batch
    for p, r in zip(prompts, results, strict=True):
        ids, new = greedy(p, 8)
        assert r["prompt_tokens"] == len(ids) and r["completion_tokens"] == len(new)
        assert r["text"] == tok.decode(new, skip_special_tokens=True,
                                       clean_up_tokenization_spaces=False), p


def test_eos_and_stop_sequences_end_with_stop(core, reference):
    tok, greedy = reference
    _, new = greedy("def main(self):", 12)
    # The model is random: make the token it greedily emits fourth this engine's EOS.
    eos = new[3]
    core.engine.eos.add(eos)
    try:
        r = _run(core, core.generate("def main(self):", max_tokens=12, temperature=0))
    finally:
        core.engine.eos.discard(eos)
    assert r["finish_reason"] == "stop" and r["completion_tokens"] == new.index(eos) + 1
    assert r["text"] == tok.decode(new[:new.index(eos)], skip_special_tokens=True)
    full = tok.decode(new, skip_special_tokens=True)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    r = _run(core, core.generate("def main(self):", max_tokens=12, temperature=0,
                                 stop=[stop]))
    assert r["finish_reason"] == "stop" and r["text"] == full[: full.index(stop)]


# --------------------------------------------------------------------------- llm config

def _llm(tmp_path, *args: str) -> tuple[int, dict | None]:
    out = tmp_path / "llm.yaml"
    out.unlink(missing_ok=True)
    rc = llm_config.main(["--model-id", "my-sft", *args, "--output", str(out)])
    return rc, (yaml.safe_load(out.read_text()) if out.exists() else None)


def _source(cfg: dict):
    llm = cfg["applications"][0]["args"]["llm_configs"][0]
    return llm["model_loading_config"]["model_source"], llm["engine_kwargs"]


def test_llm_config_from_a_local_export(tmp_path, hf_model_dir):
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    ckpt = _checkpoint_with_export(tmp_path / "runs", hf_model_dir)
    rc, cfg = _llm(tmp_path, "--model-source", str(ckpt), "--max-model-len", "256")
    assert rc == 0
    source, engine = _source(cfg)
    assert source == f"{ckpt}/hf" and engine["max_model_len"] == 256
    llm_build.validate(cfg)                   # Serve's schema and Ray's LLMConfig
    assert LLMConfig(**cfg["applications"][0]["args"]["llm_configs"][0]).model_id == "my-sft"
    rc, cfg = _llm(tmp_path, "--model-source", str(hf_model_dir), "--max-model-len", "128")
    assert rc == 0 and _source(cfg)[0] == str(hf_model_dir)
    # A run folder: its latest checkpoint's export (what README's example gives).
    rc, cfg = _llm(tmp_path, "--model-source", str(ckpt.parent), "--max-model-len", "256")
    assert rc == 0 and _source(cfg)[0] == f"{ckpt}/hf"


def test_an_intermediate_checkpoint_of_a_hf_run_is_refused(tmp_path):
    """Before the final step a Hugging Face run's DDP checkpoint holds model.pt (the wrapper's
    weights) but no hf/ export: not something the byte GPT can load."""
    from workloads.common.runs import write_marker

    ckpt = tmp_path / "run" / "checkpoint_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(b"weights")
    (ckpt / "model_config.json").write_text(json.dumps({"hf": {"model_type": "llama"},
                                                        "seq_len": 48, "n_params": 1}))
    write_marker(ckpt, step=1, strategy="ddp", world_size=1, final=False)
    assert "intermediate checkpoint of a Hugging Face run" in _refusal(
        {"checkpoint": str(ckpt)})


def test_llm_config_from_an_s3_export(tmp_path, hf_model_dir, s3_client, checkpoint_bucket,
                                      aws_env, monkeypatch):
    from ray.llm._internal.common.utils.cloud_utils import CloudMirrorConfig
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    for k, v in aws_env.items():
        monkeypatch.setenv(k, v)
    ckpt = _checkpoint_with_export(tmp_path / "runs", hf_model_dir, "s3-run")
    prefix = "llm-units/s3-run/checkpoint_000003"
    for f in ckpt.rglob("*"):
        if f.is_file():
            s3_client.upload_file(str(f), checkpoint_bucket, f"{prefix}/{f.relative_to(ckpt)}")
    uri = f"s3://{checkpoint_bucket}/{prefix}"
    rc, cfg = _llm(tmp_path, "--model-source", uri, "--max-model-len", "200")
    assert rc == 0
    source, _ = _source(cfg)
    assert source == {"bucket_uri": f"{uri}/hf"}
    llm = LLMConfig(**cfg["applications"][0]["args"]["llm_configs"][0])
    mirror = llm.model_loading_config.model_source
    assert isinstance(mirror, CloudMirrorConfig) and mirror.storage_type == "s3"
    # Too long a context for the model, checked in S3 without downloading the weights.
    rc, cfg = _llm(tmp_path, "--model-source", f"{uri}/hf", "--max-model-len", "4096")
    assert rc == 2 and cfg is None
    # A prefix with nothing in it.
    rc, cfg = _llm(tmp_path, "--model-source", f"s3://{checkpoint_bucket}/llm-units/nothing")
    assert rc == 2 and cfg is None


@pytest.mark.parametrize("case,expected", [
    ("no-model", "holds no Hugging Face model (no config.json"),
    ("too-long", "--max-model-len: 8192 is more than the model's max_position_embeddings 256"),
    ("byte-checkpoint", "is a workloads.train checkpoint without an hf/ export"),
    # What the installed vLLM says it cannot load (its model registry, its CPU attention).
    ("unknown-arch", "vLLM has no implementation of NoSuchForCausalLM"),
    ("cpu-head-size", "head size 16 (hidden_size / num_attention_heads) is not one vLLM's CPU "
                      "attention supports (32, 64"),
])
def test_llm_config_refusals_are_one_line(tmp_path, hf_model_dir, capsys, case, expected):
    import json
    import shutil

    from workloads.common.runs import write_marker

    folder = tmp_path / case
    device = []
    if case in ("unknown-arch", "cpu-head-size"):
        shutil.copytree(hf_model_dir, folder)
        config = json.loads((folder / "config.json").read_text())
        if case == "unknown-arch":
            config["architectures"] = ["NoSuchForCausalLM"]
        else:   # the tiny Llama with 4 heads of 16: vLLM's GPU kernels take it, CPU's not
            config.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
            device = ["--device", "cpu"]
        (folder / "config.json").write_text(json.dumps(config))
    elif case == "no-model":
        folder.mkdir()
        (folder / "notes.txt").write_text("x")
    elif case == "too-long":
        folder = hf_model_dir
    else:
        folder.mkdir()
        (folder / "model.pt").write_bytes(b"weights")
        write_marker(folder, step=1, strategy="ddp", world_size=1, final=True)
    extra = [] if case == "too-long" else ["--max-model-len", "128"]
    rc, cfg = _llm(tmp_path, "--model-source", str(folder), *extra, *device)
    err = capsys.readouterr().err.strip().splitlines()[-1:]  # after vLLM's own import logs
    assert rc == 2 and cfg is None
    assert err and expected in err[0] and err[0].startswith(llm_config.PROG), err


@pytest.mark.parametrize("import_path", ["workloads.serve.llm:app_builder",
                                         "ray.serve.llm:build_openai_app"])
def test_serve_config_checks_an_llm_app(tmp_path, hf_model_dir, capsys, import_path):
    """`rayfleet serve-config` on an llm config, the kit's builder or Ray's own: checked by the
    generator's rules, the export resolved in the written file."""
    from rayfleet.commands.cli import main

    ckpt = _checkpoint_with_export(tmp_path / "runs", hf_model_dir)
    rc, cfg = _llm(tmp_path, "--model-source", "Qwen/Qwen2.5-0.5B-Instruct", "--max-model-len",
                   "256")
    cfg["applications"][0]["import_path"] = import_path
    llm = cfg["applications"][0]["args"]["llm_configs"][0]
    llm["model_loading_config"]["model_source"] = str(ckpt)
    src = tmp_path / "mine.yaml"
    src.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "checked.yaml"
    assert main(["serve-config", str(src), "-o", str(out)]) == 0
    written = yaml.safe_load(out.read_text())
    assert _source(written)[0] == f"{ckpt}/hf"
    llm["engine_kwargs"]["max_model_len"] = 100_000
    src.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["serve-config", str(src), "-o", str(tmp_path / "no.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "max_position_embeddings 256" in err, err
