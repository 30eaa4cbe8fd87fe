"""Laya's ExLlama backends: ``exl2`` (exllamav2: EXL2 and GPTQ folders) and ``exl3``
(exllamav3: EXL3 folders), engine-level, on NVIDIA GPUs."""
