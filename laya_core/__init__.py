"""Laya: an LLM inference serving layer.

The core holds the contracts (hook specs, types, the backend step interface), the manifest,
the scheduler and cache accounting, the engine, the reference router and the HTTP app.
It never imports a backend library: backends arrive as plugins.
"""

__version__ = "0.1.0"
