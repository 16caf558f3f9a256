"""Parallel layouts applied to the plain model from outside: TP/SP, CP, activation checkpointing, FSDP/DDP, PP."""
