"""Hugging Face models in the training loop, without Ray: the SFT loss, the three strategies
agreeing under `torchrun` with two ranks, resume, the hf/ export, and the driver's refusals
of bad input before any worker starts. The model and tokenizer are made offline
(tests/hf_fixtures.py) and loaded through the same from_pretrained paths a user's take; the
dataset is workloads.data's instruction output."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import pytest
import torch

from tests.conftest import BIN, REPO, SFT_MAX_LENGTH, run, summary_of
from workloads.common import runs as ckpt
from workloads.train import driver, hf_model, inputs, options, placement
from workloads.train.context import TorchrunContext
from workloads.train.loop import LoopConfig, train_loop



def _spec(hf_model_dir, sft_data):
    opts = options.TrainOptions.parse(["--model", str(hf_model_dir), "--dataset", str(sft_data)])
    assert options.check_options(opts) is None
    return inputs.resolve_hf(opts, inputs.dataset_manifest(str(sft_data)))


def _loop(root, spec, source, tokenizer, data, max_steps, **kw) -> tuple[TorchrunContext, dict]:
    cfg = LoopConfig(model=spec.to_dict(), hf_source=source, tokenizer=tokenizer, batch_size=8,
                     lr=3e-3, warmup_steps=2, max_steps=max_steps, checkpoint_every=3,
                     log_every=1, num_workers=0, dataset_path=str(data), **kw)
    ctx = TorchrunContext(root, keep=3)
    return ctx, train_loop(cfg, ctx)


def test_sft_loss_counts_only_the_response_tokens(hf_model_dir):
    model = hf_model.build(str(hf_model_dir), {})
    x = torch.randint(0, 500, (2, 12))
    y = torch.randint(0, 500, (2, 12))
    masked = y.clone()
    masked[:, :7] = hf_model.IGNORE_INDEX          # the prompt
    logits, loss = model(x, masked)
    manual = torch.nn.functional.cross_entropy(logits[:, 7:].reshape(-1, logits.size(-1)),
                                               y[:, 7:].reshape(-1))
    assert loss.item() == pytest.approx(manual.item(), rel=1e-5)
    other = masked.clone()
    other[:, :7] = hf_model.IGNORE_INDEX            # still ignored whatever the prompt holds
    assert model(x, other)[1].item() == pytest.approx(loss.item(), rel=1e-6)
    # Unmasked, every position counts (the prompt's too): the mean over all of them. (Not
    # "differs from the masked loss": on an untrained model both sit near ln(vocab) and may
    # come within any tolerance.)
    _, full = model(x, y)
    every = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    assert full.item() == pytest.approx(every.item(), rel=1e-5)


def test_sft_trains_resumes_on_the_same_curve_and_exports(hf_model_dir, sft_data, tmp_path):
    spec, source, tokenizer = _spec(hf_model_dir, sft_data)
    assert spec.seq_len == SFT_MAX_LENGTH and spec.n_params == sum(
        p.numel() for p in hf_model.build(source, spec.config).parameters())
    def curve(root):
        final = sorted(root.glob("checkpoint_*"))[-1]
        return [(h["step"], h["loss"]) for h in ckpt.read_history(
            (final / "metrics.csv").read_text())]

    _loop(tmp_path / "straight", spec, source, tokenizer, sft_data, 6)
    straight = curve(tmp_path / "straight")
    assert [s for s, _ in straight] == [1, 2, 3, 4, 5, 6]
    assert straight[-1][1] < straight[0][1] - 0.5         # the SFT loss falls
    _loop(tmp_path / "resumed", spec, source, tokenizer, sft_data, 3)
    ctx2, _ = _loop(tmp_path / "resumed", spec, source, tokenizer, sft_data, 6)
    assert [r["step"] for r in ctx2.reports] == [6]       # resumed at 4, not restarted
    resumed = curve(tmp_path / "resumed")
    assert [s for s, _ in resumed] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in resumed] == pytest.approx([v for _, v in straight], abs=1e-4)

    final = sorted((tmp_path / "straight").glob("checkpoint_*"))[-1]
    marker = ckpt.validate(final)
    assert marker["final"] and {"hf/config.json", "hf/model.safetensors",
                                "hf/tokenizer.json"} <= set(marker["files"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(str(final / "hf"))
    trained = hf_model.build(None, spec.config)
    trained.load_state_dict(torch.load(final / "model.pt", weights_only=True))
    x = torch.randint(0, spec.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(exported(x).logits, trained(x))
    tok = AutoTokenizer.from_pretrained(str(final / "hf"))
    assert tok.chat_template and len(tok) == spec.vocab_size


def _torchrun(hf_model_dir, sft_data, out, *strategy):
    proc = run([str(BIN / "torchrun"), "--nproc-per-node", "2", "-m",
                "workloads.train.torchrun", "--model", str(hf_model_dir), "--dataset",
                str(sft_data), "--max-steps", "3", "--log-every", "1", "--checkpoint-every",
                "3", "--batch-size", "4", "--lr", "3e-3", "--output", str(out), *strategy],
               env={"PATH": f"{BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                    "TMPDIR": os.environ["TMPDIR"],   # the run's folder (tests/scratch.py)
                    "HOME": str(out.parent)}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [h["loss"] for h in summary_of(proc.stdout)["history"]]


@pytest.mark.slow
def test_ddp_fsdp_and_zero3_offload_agree_and_export_gathered_weights(hf_model_dir, sft_data,
                                                                     tmp_path):
    ddp = _torchrun(hf_model_dir, sft_data, tmp_path / "ddp", "--strategy", "ddp")
    fsdp = _torchrun(hf_model_dir, sft_data, tmp_path / "fsdp", "--strategy", "fsdp")
    zero3 = _torchrun(hf_model_dir, sft_data, tmp_path / "zero3", "--strategy", "deepspeed",
                      "--zero-stage", "3", "--offload", "--offload-params")
    assert len(ddp) == 3 and ddp[-1] < ddp[0]
    assert fsdp == pytest.approx(ddp, abs=2e-4) and zero3 == pytest.approx(ddp, abs=2e-4)
    # The exports were gathered from two ranks' shards: the same weights as DDP's.
    from safetensors.torch import load_file

    ref = load_file(next((tmp_path / "ddp").glob("checkpoint_*/hf/model.safetensors")))
    for name in ("fsdp", "zero3"):
        got = load_file(next((tmp_path / name).glob("checkpoint_*/hf/model.safetensors")))
        assert got.keys() == ref.keys()
        assert all(torch.allclose(got[k], ref[k], atol=1e-4) for k in ref), name


def _main(capsys, *argv) -> tuple[int, str]:
    code = driver.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err          # one line, no traceback
    return code, err[0]


def test_bad_hf_inputs_are_one_line_before_any_worker(hf_model_dir, sft_data, tmp_path,
                                                      capsys, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")   # a run that got past the checks fails
    storage = ["--storage-path", str(tmp_path / "runs")]
    data = ["--dataset", str(sft_data)]
    no_model = tmp_path / "no-model"
    no_model.mkdir()
    (no_model / "README.md").write_text("weights elsewhere")
    code, line = _main(capsys, "--model", str(no_model), *data, *storage)
    assert code == 2 and "holds no model" in line

    # The dataset was tokenized with the model's tokenizer; another one is refused.
    from tests.hf_fixtures import make_model, make_tokenizer

    other = tmp_path / "other-tok"
    make_tokenizer(other, vocab_size=300)
    code, line = _main(capsys, "--model", str(hf_model_dir), "--tokenizer", str(other), *data,
                       *storage)
    assert code == 2 and "another tokenizer" in line

    # A tokenizer/model vocabulary mismatch: the model embeds fewer ids than the data holds.
    small = tmp_path / "small-vocab"
    shutil.copytree(hf_model_dir, small)
    make_model(small, 256)
    code, line = _main(capsys, "--model", str(small), *data, *storage)
    assert code == 2 and "vocabulary is 256" in line

    code, line = _main(capsys, "--model", str(hf_model_dir), *data, *storage, "--strategy",
                       "deepspeed", "--deepspeed-config", '{"zero_optimisation": {"stage": 3}}')
    assert code == 2 and "unknown DeepSpeed key 'zero_optimisation'" in line
    code, line = _main(capsys, "--model", str(hf_model_dir), *data, *storage, "--strategy",
                       "deepspeed", "--deepspeed-config",
                       '{"zero_optimization": {"stage": 3, "offload_parm": {}}}')
    assert code == 2 and "zero_optimization.offload_parm" in line

    # The kit's byte dataset with a Hugging Face model, and the other way round.
    byte_data = tmp_path / "bytes"
    byte_data.mkdir()
    shutil.copy(next(sft_data.glob("*.parquet")), byte_data)
    (byte_data / "_manifest.json").write_text(json.dumps(
        {"seq_len": SFT_MAX_LENGTH, "tokenizer": {"name": "byte", "sha256": "byte"}}))
    code, line = _main(capsys, "--model", str(hf_model_dir), "--dataset", str(byte_data),
                       *storage)
    assert code == 2 and "not tokenized with a Hugging Face tokenizer" in line
    code, line = _main(capsys, "--model", "tiny", *data, *storage)
    assert code == 2 and "the kit's GPT reads bytes" in line
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_memory_estimate_reads_the_hf_config(hf_model_dir, sft_data):
    spec, _, _ = _spec(hf_model_dir, sft_data)
    opts = options.TrainOptions.parse(["--model", str(hf_model_dir), "--dataset", "x",
                                      "--batch-size", "8"])
    options.check_options(opts)
    base = placement.memory_estimate_bytes(spec, opts)
    assert base["params"] == 4.0 * spec.n_params
    opts = dataclasses.replace(opts, activation_checkpointing=True)
    assert placement.memory_estimate_bytes(spec, opts)["activations"] < base["activations"] / 10


def test_torchrun_entry_point_is_importable_without_ray():
    proc = run([sys.executable, "-c", "import workloads.train.torchrun, sys; "
                "print('ray' in sys.modules)"], cwd=REPO, check=True)
    assert proc.stdout.strip() == "False"


def test_relative_model_paths_are_made_absolute_for_the_workers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    opts = inputs.absolute_hf_paths(options.TrainOptions.parse(
        ["--model", "./models/m", "--tokenizer", "tok", "--dataset", "d"]))
    assert opts.model == str(tmp_path / "models" / "m")
    assert opts.tokenizer == str(tmp_path / "tok")
    opts = inputs.absolute_hf_paths(options.TrainOptions.parse(["--model", "tiny"]))
    assert opts.model == "tiny"                     # a preset, not a path


def test_a_model_folder_named_without_a_slash_is_a_folder_a_preset_name_a_preset(
        tmp_path, monkeypatch):
    from workloads.common.hf import is_hf_spec
    from workloads.common.model import PRESETS

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-llama").mkdir()
    (tmp_path / "tiny").mkdir()
    assert is_hf_spec("my-llama", PRESETS) and is_hf_spec("s3://b/m", PRESETS)
    assert not is_hf_spec("tiny", PRESETS) and not is_hf_spec("125M", PRESETS)
