"""LoRA (workloads.train --lora-r, PEFT) without Ray: the tiny Llama fine-tuned with adapters
learns as full SFT does, its checkpoints hold the adapter only and name the base, a resumed run
continues the same curve, the final checkpoint's adapter/ (PeftModel.from_pretrained) and
merged hf/ give the trained model's logits, `lm` serves base + adapter (greedy answers equal
PEFT's own), `llm`'s generator writes Ray's lora_config. Bad input (LoRA on the byte GPT or
on fresh weights, targets that match no module, an adapter whose base differs from the served
model, for `lm` and `llm`) is tests/faults/test_bad_input.py's. The slow tier runs FSDP2
(stopped and resumed), ZeRO-3, and ZeRO-2 with activation checkpointing, two ranks each under
torchrun; a killed Ray Train worker is tests/workloads/test_serve_hf.py's, vLLM's LoRA the
rehearsal's; `lm` deployed with an adapter by `serve deploy` is tests/cluster/test_readme.py's."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from tests.unit.test_serve_hf_units import _refusal  # lm's one-line refusal, as there
from workloads.common import hf
from workloads.common import runs as ckpt
from workloads.train import hf_model, inputs, options
from workloads.train.context import TorchrunContext
from workloads.train.loop import LoopConfig, train_loop

# The tiny Llama's weights are random: what SFT learns first is which tokens answers use, so
# the output head is among the targets (vLLM serves lm_head adapters too). LoRA's usual rate is
# a few times full fine-tuning's.
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"
LORA = ["--lora-r", "8", "--lora-targets", TARGETS]
FULL_LR, LORA_LR = 3e-3, 1e-2


def _spec(model_dir, data, *extra):
    opts = options.TrainOptions.parse(["--model", str(model_dir), "--dataset", str(data), *extra])
    assert options.check_options(opts) is None
    return inputs.resolve_hf(opts, inputs.dataset_manifest(str(data)))


def _train(root, model_dir, data, max_steps, lr, *extra, merge=False) -> list[float]:
    """The loop in this process (world size 1); the loss of every step of the run so far."""
    spec, source, tokenizer = _spec(model_dir, data, *extra)
    cfg = LoopConfig(model=spec.to_dict(), hf_source=source, tokenizer=tokenizer, batch_size=8,
                     lr=lr, warmup_steps=2, max_steps=max_steps, checkpoint_every=3,
                     log_every=1, num_workers=0, dataset_path=str(data), lora_merge=merge)
    train_loop(cfg, TorchrunContext(root, keep=3))
    final = ckpt.local_checkpoints(root)[-1]
    return [h["loss"] for h in ckpt.read_history((final / ckpt.METRICS).read_text())]


def _logged(out: str) -> list[tuple[int, float]]:
    """(step, loss) of each `[rayfleet] step` line in a run's output."""
    return [(int(s), float(v)) for s, v in
            re.findall(r"\[rayfleet\] step (\d+)/\d+ loss (\d+\.\d+)", out)]


def _check_went_on(out: str, at: int, straight: list[float], scratch: list[float],
                   tol: float) -> None:
    """The run that printed `out` went on from its step-`at` checkpoint: it says so, trains only
    steps at+1.. and logs the losses of the run that never stopped (`straight`). Its history
    alone cannot tell: a deterministic rerun from step 0 writes the same one."""
    assert f"[rayfleet] resumed from step {at} (" in out, out[-2000:]
    logged = _logged(out)
    assert [s for s, _ in logged] == list(range(at + 1, len(straight) + 1)), logged
    losses = [v for _, v in logged]
    assert losses == pytest.approx(straight[at:], abs=tol), (losses, straight)
    # What gives the check its teeth: a run from step 0 logs other losses for as many steps.
    assert losses != pytest.approx(scratch[:len(losses)], abs=0.05), (losses, scratch)


@pytest.fixture(scope="module")
def lora_run(hf_model_dir, sft_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora") / "run"
    losses = _train(root, hf_model_dir, sft_data, 6, LORA_LR, *LORA, merge=True)
    return root, losses


def test_lora_learns_as_full_sft_does_training_only_the_adapter(lora_run, hf_model_dir,
                                                                sft_data, tmp_path):
    root, lora = lora_run
    full = _train(tmp_path / "full", hf_model_dir, sft_data, 6, FULL_LR)
    assert len(lora) == len(full) == 6 and lora[0] == pytest.approx(full[0], abs=1e-4)
    # The same data, the same first step; the adapters bring the loss down at least as far.
    assert full[-1] < full[0] - 0.5 and lora[-1] <= full[-1] + 0.1, (full, lora)

    final = ckpt.local_checkpoints(root)[-1]
    saved = torch.load(final / ckpt.FULL_WEIGHTS, weights_only=True)
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)   # no base weights
    model = json.loads((final / ckpt.MODEL_CONFIG).read_text())
    assert model["lora"]["r"] == 8 and model["lora"]["alpha"] == 16
    assert model["lora"]["base"] == {"source": str(hf_model_dir),
                                     "fingerprint": hf.weights_fingerprint(str(hf_model_dir), "x")}
    assert model["n_trainable"] == sum(v.numel() for v in saved.values()) < model["n_params"] / 4
    marker = ckpt.validate(final)
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors",
            "adapter/rayfleet_base.json", "adapter/tokenizer.json",
            "hf/model.safetensors"} <= set(marker["files"])


def test_resumed_lora_run_continues_the_curve(lora_run, hf_model_dir, sft_data, tmp_path,
                                              capsys):
    _, straight = lora_run
    scratch = _train(tmp_path / "resumed", hf_model_dir, sft_data, 3, LORA_LR, *LORA)
    capsys.readouterr()
    resumed = _train(tmp_path / "resumed", hf_model_dir, sft_data, 6, LORA_LR, *LORA)
    # Steps 4-6 ran on the adapter, the optimizer moments and the data position the step-3
    # checkpoint held (printed losses have 4 decimals).
    _check_went_on(capsys.readouterr().out, 3, straight, scratch, tol=2e-4)
    optim = torch.load(ckpt.local_checkpoints(tmp_path / "resumed")[-1] / ckpt.OPTIMIZER,
                       weights_only=False)
    # AdamW's own count: 6 steps, not the 3 a fresh optimizer after the resume would have.
    assert {int(s["step"]) for s in optim["state"].values()} == {6}
    assert resumed == pytest.approx(straight, abs=1e-4)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_adapter_and_merged_exports_give_the_trained_models_logits(lora_run, hf_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = ckpt.local_checkpoints(lora_run[0])[-1]
    spec = json.loads((final / ckpt.MODEL_CONFIG).read_text())
    trained = hf_model.build(str(hf_model_dir), spec["hf"], lora=spec["lora"])
    trained.load_state_dict(torch.load(final / ckpt.FULL_WEIGHTS, weights_only=True),
                            strict=False)
    base = AutoModelForCausalLM.from_pretrained(str(hf_model_dir), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(final / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(final / "hf"), dtype=torch.float32)
    x = torch.randint(0, spec["hf"]["vocab_size"], (2, 16))
    with torch.no_grad():
        want = trained(x)
        assert torch.allclose(adapted(input_ids=x).logits, want, atol=1e-5)
        assert torch.allclose(merged(x).logits, want, atol=1e-4)
        # And the adapter did change the model: the base alone answers otherwise.
        assert not torch.allclose(AutoModelForCausalLM.from_pretrained(
            str(hf_model_dir), dtype=torch.float32)(x).logits, want, atol=1e-2)
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_model_dir)
    assert sorted(config["target_modules"]) == sorted(TARGETS.split(","))


# --------------------------------------------------------------------------- strategies

def _torchrun(model_dir, data, out, max_steps, *args) -> tuple[list[float], str]:
    """2 ranks under torchrun (no Ray), checkpoints in `out`: the run's history (every logged
    step's loss, restored ones too) and its output."""
    from tests.conftest import BIN, run, summary_of

    proc = run([str(BIN / "torchrun"), "--nproc-per-node", "2", "-m",
                "workloads.train.torchrun", "--model", str(model_dir), "--dataset", str(data),
                "--max-steps", str(max_steps), "--log-every", "1", "--checkpoint-every", "2",
                "--batch-size", "4", "--lr", str(LORA_LR), "--output", str(out), *LORA, *args],
               env={"PATH": f"{BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                    "TMPDIR": os.environ["TMPDIR"],   # the run's folder (tests/scratch.py)
                    "HOME": str(out.parent)}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [h["loss"] for h in summary_of(proc.stdout)["history"]], proc.stdout


@pytest.mark.slow
def test_lora_under_fsdp2_zero3_and_zero2_resumes_agrees_and_exports_the_same_adapter(
        hf_model_dir, sft_data, tmp_path):
    """Two ranks each: FSDP2 stopped at step 2 and resumed to 4 (its sharded checkpoint holds
    the adapter and its optimizer state, not the frozen base), ZeRO-3 straight to 4, ZeRO-2
    with activation checkpointing straight to 4; the same curve, and the adapter gathered
    from the shards is the same."""
    from safetensors.torch import load_file

    scratch, _ = _torchrun(hf_model_dir, sft_data, tmp_path / "fsdp", 2, "--strategy", "fsdp")
    fsdp, out = _torchrun(hf_model_dir, sft_data, tmp_path / "fsdp", 4, "--strategy", "fsdp")
    zero3, _ = _torchrun(hf_model_dir, sft_data, tmp_path / "zero3", 4, "--strategy",
                         "deepspeed", "--zero-stage", "3")
    zero2, _ = _torchrun(hf_model_dir, sft_data, tmp_path / "zero2", 4, "--strategy",
                         "deepspeed", "--zero-stage", "2", "--activation-checkpointing")
    assert len(fsdp) == 4 and fsdp[-1] < fsdp[0] and zero3 == pytest.approx(fsdp, abs=2e-4)
    # The second FSDP run trained steps 3-4 from the sharded step-2 state (adapter, optimizer,
    # data position): ZeRO-3's uninterrupted losses for those steps, not a restart's.
    _check_went_on(out, 2, zero3, scratch, tol=3e-4)
    assert zero2 == pytest.approx(fsdp, abs=2e-4)
    first = ckpt.local_checkpoints(tmp_path / "fsdp")[0]
    assert first.name.endswith("02") and ckpt.FULL_WEIGHTS not in ckpt.validate(first)["files"]
    ref, *others = (load_file(str(ckpt.local_checkpoints(tmp_path / s)[-1] / "adapter" /
                                  "adapter_model.safetensors"))
                    for s in ("fsdp", "zero3", "zero2"))
    assert all(".lora_" in k for k in ref)
    for got in others:
        assert got.keys() == ref.keys()
        assert all(torch.allclose(got[k], ref[k], atol=1e-4) for k in ref)


# --------------------------------------------------------------------------- fingerprint

def test_weights_fingerprint_names_the_weights_not_their_dtype(hf_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.hf_fixtures import make_model

    model = AutoModelForCausalLM.from_pretrained(str(hf_model_dir), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    other = tmp_path / "other"
    make_model(other, 512, seed=1)
    same = hf.weights_fingerprint(str(hf_model_dir), "x")
    assert hf.weights_fingerprint(str(tmp_path / "bf16"), "x") == same
    assert hf.weights_fingerprint(str(other), "x") != same


# --------------------------------------------------------------------------- lm

def test_lm_serves_a_lora_runs_base_and_adapter_checked_against_its_base(lora_run,
                                                                          hf_model_dir, tmp_path):
    from workloads.serve.lm import check_args

    final = ckpt.local_checkpoints(lora_run[0])[-1]
    adapter = str(final / "adapter")
    # Without --lora-merge's hf/, the checkpoint is served as its base plus its adapter.
    shutil.copytree(final, tmp_path / "ckpt", ignore=shutil.ignore_patterns("hf"))
    ckpt.write_marker(tmp_path / "ckpt", step=6, strategy="ddp", world_size=1, final=True)
    args = check_args({"checkpoint": str(tmp_path / "ckpt")})
    assert (args["checkpoint"], args["adapter"]) == (str(hf_model_dir),
                                                     str(tmp_path / "ckpt" / "adapter"))
    # A base folder plus an adapter (a folder, or the LoRA run's checkpoint that holds one).
    assert check_args({"checkpoint": str(hf_model_dir), "adapter": adapter})["adapter"] == adapter
    assert check_args({"checkpoint": str(hf_model_dir),
                       "adapter": str(tmp_path / "ckpt")})["adapter"] == \
        str(tmp_path / "ckpt" / "adapter")

    # (An adapter trained on other weights: tests/faults/test_bad_input.py's table.)
    msg = _refusal({"checkpoint": str(tmp_path / "ckpt"), "adapter": adapter})
    assert "brings its own adapter" in msg
    msg = _refusal({"checkpoint": str(hf_model_dir), "adapter": str(hf_model_dir)})
    assert "is not a LoRA adapter folder (no adapter_config.json" in msg
    msg = _refusal({"checkpoint": str(hf_model_dir), "adapter": "relative/adapter"})
    assert "args.adapter" in msg and "relative path" in msg


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lm_engine_with_the_adapter_answers_as_peft_does(lora_run, hf_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workloads.serve.engines import GenRequest
    from workloads.serve.model_source import load_engine

    final = ckpt.local_checkpoints(lora_run[0])[-1]
    engine = load_engine(str(hf_model_dir), str(final / "adapter"))
    tok = AutoTokenizer.from_pretrained(str(hf_model_dir))
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        str(hf_model_dir), dtype=torch.float32), str(final / "adapter"))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat the word golf twice."}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False).input_ids
    want = peft.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(
        1, len(ids), dtype=torch.long), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    seq, got = list(ids), []
    for _ in range(len(want)):
        tok_id = engine.step([seq], [GenRequest(seq, 1, temperature=0)], [None])[0]
        seq.append(tok_id)
        got.append(tok_id)
    assert got == want


# --------------------------------------------------------------------------- llm (vLLM)

def _second_adapter(adapter, out):
    """Another adapter of the same base: the trained one with its B matrices negated."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, out)
    weights = load_file(str(out / "adapter_model.safetensors"))
    save_file({k: -v if ".lora_B." in k else v for k, v in weights.items()},
              str(out / "adapter_model.safetensors"))
    return out


def test_llm_config_serves_adapters_from_s3_checked_against_the_model(
        lora_run, hf_model_dir, tmp_path, s3_client, checkpoint_bucket, aws_env, monkeypatch,
        capsys):
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    from workloads.serve import llm_config

    for k, v in aws_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    adapter = ckpt.local_checkpoints(lora_run[0])[-1] / "adapter"

    def upload(folder, prefix):
        for f in folder.rglob("*"):
            if f.is_file():
                s3_client.upload_file(str(f), checkpoint_bucket,
                                      f"{prefix}/{f.relative_to(folder)}")

    upload(adapter, "lora-units/adapters/sft")
    upload(_second_adapter(adapter, tmp_path / "neg"), "lora-units/adapters/neg")
    path = f"s3://{checkpoint_bucket}/lora-units/adapters"
    base = ["--model-id", "tiny", "--model-source", str(hf_model_dir), "--max-model-len", "256",
            "--device", "cpu"]

    def generate(*args):
        import yaml

        out = tmp_path / "llm.yaml"
        out.unlink(missing_ok=True)
        rc = llm_config.main([*base, *args, "--output", str(out)])
        err = capsys.readouterr().err.strip()
        return rc, (yaml.safe_load(out.read_text()) if out.exists() else None), err

    rc, cfg, err = generate("--lora-path", path + "/", "--max-lora-rank", "8")
    assert rc == 0, err
    llm = cfg["applications"][0]["args"]["llm_configs"][0]
    assert llm["lora_config"] == {"dynamic_lora_loading_path": path,
                                  "max_num_adapters_per_replica": 16}
    assert llm["engine_kwargs"] | {"enable_lora": True, "max_lora_rank": 8, "max_loras": 4} == \
        llm["engine_kwargs"]
    assert LLMConfig(**llm).lora_config.dynamic_lora_loading_path == path

    def refused(*args) -> str:
        rc, cfg, err = generate(*args)
        assert rc == 2 and cfg is None and len(err.splitlines()) == 1, err
        return err

    assert "cloud storage only" in refused("--lora-path", str(adapter.parent))
    assert "has rank 8, more than 1" in refused("--lora-path", path, "--max-lora-rank", "1")
    assert "vLLM takes one of 1, 8, 16" in refused("--lora-path", path, "--max-lora-rank", "4")
    assert "is itself an adapter folder" in refused("--lora-path", f"{path}/sft")
    assert "holds no adapter folders" in refused("--lora-path", f"{path}-none")
    # (Adapters served on other weights than theirs: tests/faults/test_bad_input.py.)
    rc, _, err = generate("--lora-path", path, "--model-id", "a:b")
    assert rc == 2 and "may not hold ':'" in err
