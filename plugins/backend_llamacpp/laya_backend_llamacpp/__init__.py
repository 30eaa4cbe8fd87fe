"""Laya's llama.cpp backend. Importing this package does not import llama_cpp."""

from laya_backend_llamacpp.backend import LlamaCppBackend

__all__ = ["LlamaCppBackend"]
