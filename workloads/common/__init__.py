"""What the workloads share, the one level below them (data, train, embed and serve import it
and the kit's core, never each other): the byte GPT (model), the run store (runs), sharded
Parquet inputs and outputs (shards), the sentence encoder (encoder), the standard-library
corpus (corpus), the text cleaning of data and embed (text), storage paths (storage), Hugging
Face loading (hf, tiny_hf) and CLI helpers (cli, deps). Nothing runs at import time."""
