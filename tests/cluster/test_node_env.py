"""A node built only by the rendered cluster YAML runs every workload README submits.

Every other test cluster runs from the kit's own venv, where `workloads` is installed and every
package is present. This one is built the way `ray up` builds a node: the YAML that
`rayfleet render` makes from the example stack outputs gives its `setup_commands`, run one by
one with `bash -c` in a scratch HOME holding the YAML's `file_mounts` (the token). A token-auth
cluster is started from the venv those commands built (`rayfleet local up --python`), and the
operator reaches it as on AWS: `ray job submit --working-dir .` for data, train (each
strategy) and embed, and `rayfleet serve-config` + `serve deploy` for the `lm` app from the
config as committed, its code fetched by the nodes from S3 (a moto server). The embeddings'
own checks ride on this module's embed job; `rag`'s run on README's rag example
(tests/cluster/test_readme.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import BIN, REPO, free_port, run, summary_of
from tests.workloads.conftest import post_json, wait_healthy

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.moto]
BUCKET = "rayfleet-node-env"
DOCS = 80   # stdlib module docstrings: __future__ ... email.*, csv and bz2 among them


def _pip_passthrough(home: Path) -> dict[str, str]:
    """What the machine's pip is told (index mirrors, wheel folders, cache), also from a scratch
    HOME: on AWS the image's pip config plays this part. The cache keeps reruns offline-fast."""
    for rel in (".config/pip", ".pip"):
        src = Path.home() / rel
        if src.is_dir():
            shutil.copytree(src, home / rel, dirs_exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    env.setdefault("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
    return env


def build_node(root: Path) -> dict:
    """What `ray up` does to a node before `ray start`: the rendered YAML's file mounts copied
    into a scratch HOME, then its setup commands run one by one with `bash -c`."""
    token = root / "operator" / "auth_token"
    yaml_path = root / "cluster.yaml"
    rendered = run([str(BIN / "rayfleet"), "render", str(REPO / "cluster-configs" / "examples" /
                                                          "dev-outputs.json"),
                    "-o", str(yaml_path), "--token-file", str(token)], timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    cfg = yaml.safe_load(yaml_path.read_text())

    home = root / "home"
    home.mkdir()
    for remote, local in cfg["file_mounts"].items():   # what `ray up` copies before setup
        dest = home / remote.removeprefix("~/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(local).expanduser(), dest)
    env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
           **_pip_passthrough(home)}
    for cmd in cfg["setup_commands"] + cfg["head_setup_commands"]:
        proc = subprocess.run(["bash", "-c", cmd], env=env, cwd=home, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return {"home": home, "env": env}


# The node's venv takes a minute or more of mostly single-threaded pip work: when this module
# is part of the run, tests/conftest.py starts building it as soon as collection ends, beside
# the tests that run first (the Ansible role builds its own venv then), and the fixture below
# waits for it. Run alone, the module builds it itself.
PREBUILD: dict = {}


def start_prebuild() -> None:
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    root = Path(tempfile.mkdtemp(prefix="rayfleet-node-"))
    pool = ThreadPoolExecutor(max_workers=1)
    PREBUILD.update(root=root, future=pool.submit(build_node, root))
    pool.shutdown(wait=False)


@pytest.fixture(scope="module")
def node(tmp_path_factory, aws_env, s3_client):
    if "future" in PREBUILD:
        root, built = PREBUILD["root"], PREBUILD["future"].result()
    else:
        root = tmp_path_factory.mktemp("node")
        built = build_node(root)
    home, env = built["home"], built["env"]
    python = home / "rayfleet-venv" / "bin" / "python"
    assert (home / ".rayfleet" / "auth_token").stat().st_mode & 0o777 == 0o600

    s3_client.create_bucket(Bucket=BUCKET)
    state = root / "rayfleet-home"
    up_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # The nodes reach "S3" (moto) with these, as an instance role would give them.
    up_env.update(aws_env, RAYFLEET_HOME=str(state))
    up = run([str(BIN / "rayfleet"), "local", "up", "--python", str(python), "--num-cpus", "4",
              "--object-store-memory", "1GB", "--port", str(free_port()),
              "--dashboard-port", str(free_port())], env=up_env, timeout=180)
    assert up.returncode == 0, up.stderr
    exports = run([str(BIN / "rayfleet"), "local", "env"], env=up_env, check=True).stdout
    client = {**up_env, **dict(line.removeprefix("export ").split("=", 1)
                               for line in exports.splitlines())}
    try:
        yield {"python": python, "env": client, "root": root, "setup": env}
    finally:
        down = run([str(BIN / "rayfleet"), "local", "down"], env=up_env, timeout=120)
        if "future" in PREBUILD:
            shutil.rmtree(root, ignore_errors=True)
        assert down.returncode == 0, down.stdout + down.stderr


def _submit(node, *argv: str, timeout: float = 400):
    """`ray job submit --working-dir .` from the operator's venv, as README's cloud path."""
    return run([str(BIN / "ray"), "job", "submit", "--working-dir", ".", "--", "python", "-m",
                *argv], env=node["env"], timeout=timeout)


def test_the_node_has_the_environment_and_not_the_kit(node):
    # The kit's code must come with each job: nothing of it is installed on the node.
    probe = run([str(node["python"]), "-c", "import workloads"], env=node["setup"],
                cwd=node["root"])
    assert "No module named 'workloads'" in probe.stderr, probe.stderr[-2000:]
    ray_version = run([str(node["python"]), "-c", "import ray; print(ray.__version__)"],
                      env=node["setup"], cwd=node["root"], check=True).stdout.strip()
    client_version = run([str(BIN / "python"), "-c", "import ray; print(ray.__version__)"],
                         check=True).stdout.strip()
    assert ray_version == client_version  # rule 25


@pytest.fixture(scope="module")
def ddp_run(node):
    """DDP with its checkpoints in S3 (the moto server), as README's cloud path trains."""
    proc = _submit(node, "workloads.train", "--smoke-test", "--max-steps", "10",
                   "--checkpoint-every", "5", "--name", "node-ddp", "--storage-path",
                   f"s3://{BUCKET}/runs")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return summary_of(proc.stdout), proc.stdout


def test_train_ddp_checkpoints_to_s3_with_its_summary(ddp_run, s3_client, aws_env,
                                                      monkeypatch):
    s, stdout = ddp_run
    assert s["steps"] == 10 and s["strategy"] == "ddp" and s["final_loss"] < s["first_loss"]
    assert "global batch 16 seqs = 8 x 1 accum x 2 workers" in stdout
    assert "lr 0.003 x 2 = 0.006" in stdout   # linear LR scaling with world size
    keys = [o["Key"] for o in s3_client.list_objects_v2(
        Bucket=BUCKET, Prefix="runs/node-ddp/")["Contents"]]
    assert any(k.endswith("/rayfleet_checkpoint.json") for k in keys)
    assert any(k.endswith("/model.pt") for k in keys)
    assert "runs/node-ddp/metrics.csv" in keys
    png = s3_client.get_object(Bucket=BUCKET, Key="runs/node-ddp/loss.png")
    assert png["Body"].read()[:4] == b"\x89PNG"   # matplotlib ran on the node
    assert s["checkpoint"].startswith(f"s3://{BUCKET}/runs/node-ddp/")
    # The `lm` app's loader reads that s3:// checkpoint (served from it below, on the node).
    from workloads.serve.lm import check_checkpoint, load_checkpoint

    for key, value in aws_env.items():
        monkeypatch.setenv(key, value)
    assert check_checkpoint(s["checkpoint"])["step"] == 10
    model_config, state = load_checkpoint(s["checkpoint"])
    assert model_config["seq_len"] == 64 and "tok.weight" in state


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_sharded_strategies_train_and_write_per_rank_shards(node, strategy):
    storage = node["root"] / "runs"   # a folder this one-machine "cluster" shares
    proc = _submit(node, "workloads.train", "--smoke-test", "--strategy", strategy,
                   "--max-steps", "10", "--checkpoint-every", "10", "--storage-path",
                   str(storage))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    s = summary_of(proc.stdout)
    assert s["steps"] == 10 and s["final_loss"] < s["first_loss"]
    ckpt = storage / f"smoke-{strategy}" / s["checkpoint"].rsplit("/", 1)[1]
    files = json.loads((ckpt / "rayfleet_checkpoint.json").read_text())["files"]
    if strategy == "fsdp":
        # Each of the two ranks wrote its own shard (rank 1's reaches storage through Ray,
        # so it is checked on disk rather than in rank 0's marker).
        assert {"dcp/__0_0.distcp", "dcp/.metadata"} <= set(files)
        assert (ckpt / "dcp" / "__0_0.distcp").exists() and (ckpt / "dcp" / "__1_0.distcp").exists()
    else:
        assert len(list((ckpt / "ds" / "ckpt").glob("zero_pp_rank_*_optim_states.pt"))) == 2
    assert "model.pt" in files  # full weights on the final checkpoint, for serving
    assert (storage / f"smoke-{strategy}" / "loss.png").exists()


DATA = ["workloads.data", "--smoke-test", "--max-bytes", "300000", "--shard-bytes", "60000"]


@pytest.fixture(scope="module")
def packed(node):
    out = node["root"] / "data"
    proc = _submit(node, *DATA, "--output", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return out, summary_of(proc.stdout)


def test_data_writes_packed_sequences_in_named_shards(packed):
    out, s = packed
    assert s["seq_len"] == 64 and s["written"] == s["shards"] >= 2 and s["skipped"] == 0
    files = sorted(p.name for p in out.glob("*.parquet"))
    assert files and all(f.startswith("shard-0000") and f.endswith("-000.parquet")
                         for f in files)
    table = pq.read_table(out)
    assert table.num_rows == s["rows"] > 100
    first = table.column("tokens")[0].as_py()
    assert len(first) == 65 and all(0 <= t < 256 for t in first)  # seq_len + 1 bytes
    markers = [json.loads(p.read_text()) for p in sorted((out / "_done").glob("*.json"))]
    assert sum(m["rows"] for m in markers) == s["rows"]


def test_data_rerun_skips_written_shards_and_changes_nothing(node, packed):
    out, s = packed
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}
    proc = _submit(node, *DATA, "--output", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    again = summary_of(proc.stdout)
    assert again["written"] == 0 and again["skipped"] == s["shards"]
    assert again["rows"] == s["rows"]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")} == before


@pytest.fixture(scope="module")
def embeddings(node):
    out = node["root"] / "embeddings"
    proc = _submit(node, "workloads.embed", "--smoke-test", "--max-docs", str(DOCS),
                   "--batch-size", "32", "--output", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return out, summary_of(proc.stdout)


def _table(out: Path):
    return pq.read_table(sorted(out.glob("*.parquet")))


def test_embed_writes_one_unit_vector_per_document_with_its_id(node, embeddings):
    out, summary = embeddings
    t = _table(out)
    assert summary["rows"] == t.num_rows == DOCS and summary["dim"] == 384
    assert t.schema.field("embedding").type.list_size == 384
    # Same documents, same order as the source (preserve_order), ids intact. The source is the
    # node's own Python's standard library (its Python need not be the operator's).
    ids = run([str(node["python"]), "-c", "import json; from workloads.embed.pipeline import "
               f"stdlib_docs; print(json.dumps([d['id'] for d in stdlib_docs({DOCS})]))"],
              env={**node["setup"], "PYTHONPATH": str(REPO)}, check=True).stdout
    assert t["id"].to_pylist() == json.loads(ids)
    vecs = np.array(t["embedding"].to_pylist(), dtype=np.float32)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    assert json.loads((out / "_manifest.json").read_text())["model"] == "all-MiniLM-L6-v2"


def test_vectors_are_what_the_model_gives_here(embeddings):
    """Deterministic and correct: the node's actors, batching 32 at a time, agree with the
    same packaged model run once in this process, one document at a time."""
    from workloads.embed.pipeline import encode, load_encoder, model_path

    t = _table(embeddings[0])
    enc = load_encoder(model_path("all-MiniLM-L6-v2"))
    for i in (0, 17, DOCS - 1):
        mine = encode(enc, [t["text"][i].as_py()], 1)[0]
        assert np.abs(mine - np.array(t["embedding"][i].as_py())).max() < 1e-5


# --------------------------------------------------------------------------- serve

@pytest.fixture(scope="module")
def serve_port() -> int:
    # Serve's proxy keeps the port of the first deploy for the cluster's life.
    return free_port()


def _deploy(node, app: str, config_dir: Path, port: int, **args: str) -> str:
    """The committed config on a free port, packaged with `rayfleet serve-config` to the
    bucket, then `serve deploy`ed: the nodes fetch the code from S3 themselves."""
    cfg = yaml.safe_load((REPO / "cluster-configs" / "serve" / f"{app}.yaml").read_text())
    cfg["http_options"]["port"] = port
    src = config_dir / f"{app}.yaml"
    src.write_text(yaml.safe_dump(cfg))
    out = config_dir / f"serve-{app}.yaml"
    made = run([str(BIN / "rayfleet"), "serve-config", str(src), "--package-to",
                f"s3://{BUCKET}/rayfleet/packages", "-o", str(out),
                *[f"--arg={k}={v}" for k, v in args.items()]], env=node["env"], timeout=120)
    assert made.returncode == 0, made.stderr
    working_dir = yaml.safe_load(out.read_text())["applications"][0]["runtime_env"][
        "working_dir"]
    assert working_dir.startswith(f"s3://{BUCKET}/rayfleet/packages/_ray_pkg_")
    run([str(BIN / "serve"), "deploy", str(out)], env=node["env"], check=True, timeout=120)
    return wait_healthy({"env": node["env"]}, f"http://127.0.0.1:{port}", app)


def test_serve_lm_from_the_committed_config_and_the_s3_checkpoint(node, ddp_run, serve_port,
                                                                 tmp_path):
    url = _deploy(node, "lm", tmp_path, serve_port, checkpoint=ddp_run[0]["checkpoint"])
    status, done = post_json(url + "/v1/completions", {"model": "rayfleet-lm", "prompt": "import ",
                                                   "max_tokens": 8, "seed": 1})
    assert status == 200, done
    assert done["choices"][0]["text"] and done["usage"]["completion_tokens"] >= 1
