"""Laya backend plugin: Llama-family models in PyTorch on the core paged KV cache."""
