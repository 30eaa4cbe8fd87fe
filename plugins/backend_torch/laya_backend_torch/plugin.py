"""Registers the PyTorch backend as ``torch``. Importing this module imports no torch: the
backend class defers it to ``load_weights``."""

from laya_core.hookspecs import Register, hookimpl

from laya_backend_torch.backend import TorchBackend


@hookimpl
def register_backends(register: Register) -> None:
    register(TorchBackend.name, TorchBackend)
