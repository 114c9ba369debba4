"""Batch embeddings with Ray Data (`python -m workloads.embed`)."""
