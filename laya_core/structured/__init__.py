"""Structured output: constraints on what a sequence may generate, built once in the core.

A request's ``response_format``, ``structured_outputs``, ``guided_*`` or ``tools`` fields
become a :class:`~laya_core.structured.spec.ConstraintSpec`: plain data (an llguidance
grammar and the request field it came from) that can cross to the engine's process. The
engine client compiles it (:mod:`laya_core.structured.compiler`, off the engine thread, with a
cache) into a matcher, and the engine asks that matcher for each step's allowed-token mask
(:mod:`laya_core.engine.allowed_tokens`), which every backend applies before it samples. Tool calls
are parsed back out of the generated text by :mod:`laya_core.structured.tools`.

llguidance does the matching: a 3 MB wheel with no dependencies that refuses the JSON-schema
keywords it cannot enforce, where the alternative checked (xgrammar) needs torch and accepted
``uniqueItems`` and look-ahead patterns without enforcing them (../shared/notes).
"""
