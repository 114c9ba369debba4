"""`python -m workloads.data`: raw text / JSONL / Parquet -> packed token sequences (Parquet)."""
