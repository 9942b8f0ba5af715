"""Multi-LoRA serving: adapter requests, the PEFT loader and the device slots (see docs/architecture.md)."""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
