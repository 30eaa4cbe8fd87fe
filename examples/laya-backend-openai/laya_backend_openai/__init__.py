"""A Laya backend for any OpenAI-compatible server (llama-server, vLLM, Ollama, another Laya)."""
