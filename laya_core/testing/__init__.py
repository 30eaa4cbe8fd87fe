"""Laya's backend conformance suite, for any backend package to run against itself.

    pytest -p laya_core.testing.plugin --pyargs laya_core.testing.test_conformance \\
        --laya-backend NAME --laya-model PATH [--laya-options JSON] [--laya-plugin MOD:ATTR]

``--laya-options`` are the backend's ``[models.options]``, as a JSON object; give it the
options under which a sequence's tokens do not depend on its neighbours (the llama.cpp
backend's ``{"flash_attn": false}``, the torch backend's ``{"deterministic": true}``), as
the suite checks that. ``--laya-plugin`` registers a plugin object that is not installed
(an object or module with ``@hookimpl`` functions), such as a backend under test in a
source tree. See spec/hooks.md for the contract each test holds a backend to.
"""
