"""Distributed GPT training: `python -m workloads.train` (Ray Train) or
`torchrun -m workloads.train.torchrun` (plain PyTorch, same loop)."""
