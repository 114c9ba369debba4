"""Hugging Face weights in and out of sharded training (workloads.train.hf_io): the sharded
export loads with from_pretrained, `lm`'s engine and the vLLM checks and gives the model's
logits; two gloo ranks load a model with FSDP2 (rank 1 built on the meta device) and with
ZeRO-3 (built under zero.Init), each holding only its part, with exactly from_pretrained's
weights, and write the export together, each rank its own shards."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port
from workloads.common import runs
from workloads.train import hf_io, hf_model


def _tied_llama(folder: Path, tokenizer_dir: Path | None = None, vocab: int = 515):
    """A tiny Llama whose output head is its input embedding (one tensor, two names); head
    size 32, one vLLM's CPU attention takes; an odd vocabulary, so two ranks' shards of the
    embedding differ in size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=True))
    model.save_pretrained(str(folder))
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(f, folder)
    return model


def _logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)(x).logits


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_export_loads_everywhere_with_the_models_logits(hf_model_dir, tmp_path, tied):
    from transformers import AutoModelForCausalLM

    from workloads.common import hf
    from workloads.serve import llm_source
    from workloads.serve.engines import HFEngine

    if tied:
        ref = tmp_path / "ref"
        model = _tied_llama(ref, hf_model_dir)
    else:
        ref = hf_model_dir
        model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32)
    config = model.config.to_dict()
    sd = model.state_dict()
    x = torch.randint(0, config["vocab_size"], (2, 12))

    # Two ranks' parts written apart (as into two Ray workers' checkpoint folders), then merged.
    written = []
    for rank in range(2):
        written.append(hf_io.export_sharded(sd.__getitem__, config, str(hf_model_dir),
                                            tmp_path / f"rank{rank}", rank=rank, world_size=2,
                                            max_shard_bytes=100_000))
    out = tmp_path / "hf"
    for rank in range(2):
        shutil.copytree(tmp_path / f"rank{rank}", out, dirs_exist_ok=True)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / hf_io.INDEX_FILE).read_text())
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    assert set(written[0]) | set(written[1]) == set(shards) and not set(written[0]) & set(
        written[1])                                   # every shard written once, both ranks wrote
    assert written[0] and written[1]
    # What save_pretrained writes: the same tensor names (a tied head is not written twice)
    # and the same config.json.
    model.save_pretrained(str(tmp_path / "saved"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        assert set(index["weight_map"]) == set(f.keys())
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (tmp_path / "saved" / "config.json").read_text())

    with torch.no_grad():
        want = model(x).logits
    assert torch.equal(_logits(out, x), want)
    engine = HFEngine.load(str(out))
    with torch.no_grad():
        assert torch.equal(engine.model(x).logits, want)
    info = hf.check_model_folder(str(out), "x")
    assert info["weights"] == shards
    assert llm_source.model_source(str(out), 32, device="cpu")[0] == str(out.resolve())


def test_a_model_that_fits_one_shard_is_one_model_safetensors(hf_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_model_dir), dtype=torch.float32)
    files = hf_io.export_sharded(model.state_dict().__getitem__, model.config.to_dict(), None,
                                 tmp_path / "hf")
    assert set(files) == {"model.safetensors"} and not (tmp_path / "hf" / hf_io.INDEX_FILE).exists()
    x = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.equal(_logits(tmp_path / "hf", x), model(x).logits)


def test_plan_keeps_order_and_puts_an_oversized_tensor_alone():
    keys = [("a", (10,)), ("b", (10,)), ("big", (100,)), ("c", (5,))]
    assert hf_io.plan_shards(keys, 4, 80) == [["a", "b"], ["big"], ["c"]]
    assert hf_io.shard_names(1) == ["model.safetensors"]
    assert hf_io.shard_names(2) == ["model-00001-of-00002.safetensors",
                                    "model-00002-of-00002.safetensors"]


# ------------------------------------------------------------------- two ranks, gloo

def _rank(rank: int, world: int, port: int, folder: str, strategy: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from workloads.train import loop
    from workloads.train.context import TorchrunContext

    torch.set_num_threads(1)
    out_dir = Path(out)
    # ZeRO-3: each rank reads its partitions from the files (hf_model.zero3_from_files).
    built = []
    zero3_from_files = hf_model.zero3_from_files
    hf_model.zero3_from_files = lambda folder: built.append(zero3_from_files(folder)) or built[-1]
    spec = hf_model.HFSpec(config=AutoConfig.from_pretrained(folder).to_dict(), seq_len=12,
                           n_params=0)
    cfg = loop.LoopConfig(model=spec.to_dict(), hf_source=folder, strategy=strategy,
                          zero_stage=3, batch_size=2)
    ctx = TorchrunContext(out_dir / "ckpt")
    torch.manual_seed(0)
    _, engine = loop.prepare(cfg, ctx)
    assert [m is not None for m in built] == ([True] if strategy == "deepspeed" else [])

    # Each rank holds its part of the weights only.
    params = list(engine.model.parameters())
    total = sum(p.numel() if not hasattr(p, "ds_shape") else p.ds_shape.numel() for p in params)
    if strategy == "fsdp":
        held = sum(p.to_local().numel() for p in params)
    else:
        assert all(hasattr(p, "ds_tensor") for p in params)
        held = sum(p.ds_tensor.numel() for p in params)
    assert held <= 0.6 * total, (held, total)

    # ... and together exactly the weights from_pretrained reads (tensor by tensor, gathered).
    full = engine._full_tensors()
    on_disk = load_file(f"{folder}/model.safetensors")
    for name, want in on_disk.items():
        assert torch.equal(full(name).cpu(), want), name

    # A forward pass (collective) gives from_pretrained's logits: RoPE's inv_freq and the tied
    # head came along.
    x = torch.load(out_dir / "x.pt")
    engine.model.eval()
    with torch.no_grad():
        torch.save(engine.model(x), out_dir / f"logits{rank}.pt")

    engine.export_hf(out_dir / f"rank{rank}" / runs.HF_DIR, max_shard_bytes=100_000)
    if rank == 0:
        (out_dir / "elsewhere.json").write_text(json.dumps(engine.files_elsewhere))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow   # two processes per case, each importing torch, transformers (DeepSpeed)
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_two_ranks_load_their_parts_and_export_together(hf_model_dir, tmp_path, strategy):
    import torch.multiprocessing as mp

    folder = tmp_path / "tied"
    _tied_llama(folder, hf_model_dir)
    x = torch.randint(0, 512, (2, 12))
    torch.save(x, tmp_path / "x.pt")
    want = _logits(folder, x)
    mp.spawn(_rank, args=(2, free_port(), str(folder), strategy, str(tmp_path)), nprocs=2)

    for rank in range(2):
        assert torch.allclose(torch.load(tmp_path / f"logits{rank}.pt"), want, atol=1e-5)
    out = tmp_path / "hf"
    for rank in range(2):
        shutil.copytree(tmp_path / f"rank{rank}" / runs.HF_DIR, out, dirs_exist_ok=True)
    rank1 = {f"{runs.HF_DIR}/{p.name}" for p in (tmp_path / "rank1" / runs.HF_DIR).iterdir()}
    elsewhere = json.loads((tmp_path / "elsewhere.json").read_text())
    assert rank1 and set(elsewhere) == rank1           # rank 0's marker will list them
    assert all(elsewhere[f] == (tmp_path / "rank1" / f).stat().st_size for f in rank1)
    assert torch.allclose(_logits(out, x), want, atol=1e-6)


def test_an_moe_export_is_written_in_its_files_layout(tmp_path):
    """Mixtral's experts live fused in one tensor inside transformers 5 but as one tensor per
    expert in its files (what vLLM and every other loader read): the shards are written in the
    files' layout, as save_pretrained writes them, and load back to the same logits."""
    from safetensors import safe_open
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64))
    model.save_pretrained(str(tmp_path / "saved"))
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    sd = model.state_dict()
    for rank in range(2):
        hf_io.export_sharded(sd.__getitem__, model.config.to_dict(), None, tmp_path / "hf",
                             rank=rank, world_size=2, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "hf" / hf_io.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == saved and any(".experts.3." in k for k in saved)
    for file in set(index["weight_map"].values()):
        with safe_open(str(tmp_path / "hf" / file), "pt") as f:
            assert {k for k, v in index["weight_map"].items() if v == file} == set(f.keys())
    x = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        assert torch.allclose(_logits(tmp_path / "hf", x), model(x).logits, atol=1e-6)


# ------------------------------------------- FSDP2 loading: rows read from the files

def test_a_mapped_weight_is_found_in_its_file_and_one_written_since_is_not(tmp_path):
    """from_pretrained leaves fp32 weights as views of the mapped safetensors file: found at
    the offset the file's header gives, and read back from there with plain reads; a weight
    this process wrote since (its own copy of the page now) or one in ordinary memory has no
    file location."""
    import struct

    from transformers import AutoModelForCausalLM

    folder = tmp_path / "m"
    _tied_llama(folder)
    lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    raw = (folder / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = "model.layers.1.mlp.up_proj.weight"
    w = lm.get_parameter(name)
    where = hf_io.file_location(w.detach(), hf_io._file_maps())
    assert where == (str(folder.resolve() / "model.safetensors"),
                     8 + n + header[name]["data_offsets"][0])
    back = torch.empty_like(w)
    fd = os.open(where[0], os.O_RDONLY)
    try:
        hf_io._pread_into(fd, where[1], back)
    finally:
        os.close(fd)
    assert torch.equal(back, w)
    with torch.no_grad():
        w[0, 0] += 1
    assert hf_io.file_location(w.detach(), hf_io._file_maps()) is None
    assert hf_io.file_location(torch.ones(64, 64), hf_io._file_maps()) is None


def _scatter_rank(rank: int, world: int, port: int, folder: str, out: str,
                  elsewhere: bool) -> None:
    """FSDP2's loading as loop.prepare does it: rank 0 from_pretrained, the other on the meta
    device, sharded, then scatter_into_shards. `elsewhere`: rank 1 does not see rank 0's
    files (another node), so rank 0 scatters every row."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if elsewhere and rank == 1:
        hf_io._fingerprint = lambda path: None
    model = hf_model.build(folder, AutoConfig.from_pretrained(folder).to_dict(),
                           meta=rank != 0)

    def shard(m):
        for block in m.blocks:
            fully_shard(block)
        fully_shard(m)

    if rank != 0:
        shard(model)
        model.to_empty(device="cpu")
    counts = hf_io.scatter_into_shards(model, rank, torch.device("cpu"))
    if rank == 0:
        shard(model)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        logits = model(torch.load(Path(out) / "x.pt"))
    torch.save({"counts": counts, "n": len(full), "full": full if rank == 0 else None,
                "logits": logits}, Path(out) / f"scatter{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow   # two processes per case, each importing torch and transformers
@pytest.mark.parametrize("elsewhere", [False, True])
def test_fsdp_ranks_read_their_own_rows_from_the_files_or_get_them_from_rank0(
        hf_model_dir, tmp_path, elsewhere):
    """Every rank reads its rows of each weight straight from the safetensors file when all
    ranks see the same file; when one does not, rank 0 scatters them. Either way the sharded
    model holds exactly the file's weights (the tied head too) and gives from_pretrained's
    logits."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    folder = tmp_path / "tied"
    _tied_llama(folder, hf_model_dir)
    x = torch.randint(0, 512, (2, 12))
    torch.save(x, tmp_path / "x.pt")
    want = _logits(folder, x)
    mp.spawn(_scatter_rank, args=(2, free_port(), str(folder), str(tmp_path), elsewhere),
             nprocs=2)
    got = [torch.load(tmp_path / f"scatter{rank}.pt") for rank in range(2)]
    n = got[0]["n"]
    for g in got:
        assert g["counts"] == ({"read": 0, "scattered": n} if elsewhere
                               else {"read": n, "scattered": 0}), g["counts"]
        assert torch.allclose(g["logits"], want, atol=1e-5)
    on_disk = load_file(str(folder / "model.safetensors"))
    full = {k.removeprefix("lm."): v for k, v in got[0]["full"].items()}
    assert set(on_disk) <= set(full)
    for name, value in on_disk.items():
        assert torch.equal(full[name], value), name


def test_zero3_reads_the_files_only_when_they_hold_exactly_from_pretraineds_weights(tmp_path):
    """ZeRO-3's ranks read their partitions straight from the files only when every parameter
    is one tensor of the files under one of its names (a tied head under the embedding's),
    with its shape, and every tensor of the files is a parameter; otherwise from_pretrained
    loads (a file with another tensor, or one missing, or none)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    folder = tmp_path / "tied"
    _tied_llama(folder)
    cfg = AutoConfig.from_pretrained(str(folder))
    plan = hf_model._zero3_plan(folder, cfg)
    entries = hf_model.safetensors_entries(folder)
    assert plan is not None and set(plan.values()) == set(entries.values())
    assert plan["model.embed_tokens.weight"] == entries["model.embed_tokens.weight"]
    assert "lm_head.weight" not in entries
    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, "extra.weight": torch.ones(2)}, str(folder / "model.safetensors"))
    assert hf_model._zero3_plan(folder, cfg) is None
    del weights["model.norm.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    assert hf_model._zero3_plan(folder, cfg) is None
    (folder / "model.safetensors").unlink()
    assert hf_model.safetensors_entries(folder) is None
    assert hf_model._zero3_plan(folder, cfg) is None
