"""What llama.cpp's GPU options ask of the GPUs a plan is made for (``check_devices``): a
GPU or shares the machine lacks are named under their key, with the GPUs it has and what to
change."""

from __future__ import annotations

from laya_backend_llamacpp import gpu_options

from laya_core.backend import ModelConfig
from laya_core.memory import devices

TWO = devices.given((16 * 2**30, 8 * 2**30))  # another machine's, as laya plan --gpus says
TWO_HERE = devices.Gpus(TWO.budgets)  # the same, found on this machine


def config(**options: object) -> ModelConfig:
    return ModelConfig(name="m", backend="llamacpp", path="m.gguf", options=options)


def test_a_gpu_or_shares_the_machine_lacks_say_what_it_has_and_what_to_do() -> None:
    asked = config(main_gpu=3, tensor_split=[1, 1, 1])
    assert gpu_options.check_devices(asked, TWO_HERE) == {
        "options.main_gpu": "GPU 3, but this machine has 2 GPU(s) (cuda:0, cuda:1); name one "
                            "of them, or plan for another machine with laya plan --gpus",
        "options.tensor_split": "3 shares, but this machine has 2 GPU(s) (cuda:0, cuda:1); "
                                "give one share per GPU"}
    # Planned for another machine, the errors name that one, and planning elsewhere is no
    # way out there.
    assert gpu_options.check_devices(asked, TWO) == {
        "options.main_gpu": "GPU 3, but the machine planned for (--gpus) has 2 GPU(s) "
                            "(cuda:0, cuda:1); name one of them",
        "options.tensor_split": "3 shares, but the machine planned for (--gpus) has 2 GPU(s) "
                                "(cuda:0, cuda:1); give one share per GPU"}
    assert gpu_options.check_devices(config(n_gpu_layers=10), devices.given(())) == {
        "options.n_gpu_layers": "10 layers on a GPU, but the machine planned for (--gpus) has "
                                'none; remove it ("auto" offloads what fits where there is a '
                                "GPU)"}


def test_options_within_the_machine_pass() -> None:
    assert gpu_options.check_devices(config(main_gpu=1, tensor_split=[2, 1]), TWO) == {}
    assert gpu_options.check_devices(config(main_gpu=1, tensor_split=[2, 1]), TWO_HERE) == {}
    assert gpu_options.check_devices(config(), devices.NO_GPUS) == {}
