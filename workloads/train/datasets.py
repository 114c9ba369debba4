"""Ray Data inputs for the streaming path (`--dataset`): handed to TorchTrainer as
`datasets={"train": ds}` unmaterialised, so preprocessing overlaps training."""

from __future__ import annotations

from rayfleet.errors import ConfigError


def load_dataset(spec: str, seq_len: int, corpus_bytes: int, s3_endpoint: str | None = None):
    import ray.data

    from workloads.train.data import stdlib_ray_dataset

    if spec == "stdlib":
        return stdlib_ray_dataset(corpus_bytes, seq_len)
    from workloads.common.storage import resolve

    storage = resolve(spec, endpoint=s3_endpoint, check_writable=False, create=False)
    ds = ray.data.read_parquet(storage.path, filesystem=storage.filesystem)
    if "tokens" not in ds.schema().names:
        raise ConfigError("--dataset", f"{spec} has no 'tokens' column (columns: "
                          f"{', '.join(ds.schema().names)}); produce it with workloads.data")
    return ds
