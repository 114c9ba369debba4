"""Ray Data inputs for the streaming path (`--dataset`): handed to TorchTrainer as
`datasets={"train": ds}`; streamed (each worker's shard read while it trains) unless the
dataset is small enough to hold in the object store, where reading it once beats restarting
the read every epoch."""

from __future__ import annotations

from rayfleet.errors import ConfigError
from workloads.common.storage import resolve
from workloads.train.data import stdlib_ray_dataset


def load_dataset(spec: str, seq_len: int, corpus_bytes: int, s3_endpoint: str | None = None):
    import ray.data

    if spec == "stdlib":
        return stdlib_ray_dataset(corpus_bytes, seq_len)
    storage = resolve(spec, endpoint=s3_endpoint, check_writable=False, create=False)
    ds = ray.data.read_parquet(storage.path, filesystem=storage.filesystem)
    if "tokens" not in ds.schema().names:
        raise ConfigError("--dataset", f"{spec} has no 'tokens' column (columns: "
                          f"{', '.join(ds.schema().names)}); produce it with workloads.data")
    size = parquet_bytes(storage)
    if size <= MATERIALIZE_BYTES:
        # Small enough to hold: read once into the object store. Streamed, every epoch starts
        # a new execution of the read (~4 s each on 2 cores), which for a dataset of a few
        # steps per epoch is most of the run (100 SFT steps: 101 s streamed, 29 s held).
        print(f"[rayfleet] dataset {spec}: {size / 2**20:.1f} MiB of Parquet, held in the "
              f"object store (streamed above {MATERIALIZE_BYTES >> 20} MiB)", flush=True)
        ds = ds.materialize()
    return ds


# Datasets up to this much Parquet are materialized once instead of streamed every epoch.
MATERIALIZE_BYTES = 256 << 20


def parquet_bytes(storage) -> int:
    import pyarrow.fs as pafs

    infos = storage.fs.get_file_info(pafs.FileSelector(storage.path, recursive=True,
                                                       allow_not_found=True))
    return sum(i.size or 0 for i in infos if i.type == pafs.FileType.File
               and i.path.endswith(".parquet"))
