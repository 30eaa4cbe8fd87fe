"""The OpenAI-compatible HTTP layer (Starlette, served by Hypercorn)."""

from laya_core.http.app import create_app

__all__ = ["create_app"]
