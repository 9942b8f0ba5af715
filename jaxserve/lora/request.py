"""LoRARequest: which adapter a request runs with (vLLM's name and fields). Plain data, no JAX: it travels
with the request to the scheduler, the prefix cache's hashes and, pickled, to data-parallel replicas."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory under a name and a positive integer id, unique per adapter in one engine.

    >>> LoRARequest("sql", 1, "/adapters/sql-lora")
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_int_id={self.lora_int_id!r} must be a positive integer "
                "(0 means no adapter)"
            )
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")

    @property
    def cache_salt(self) -> int:
        """Seeds the prefix cache's chain of block hashes (jaxserve.block_hash): the same prompt under two
        adapters, or under an adapter and the base model, never shares KV blocks."""
        key = f"lora\x00{self.lora_int_id}\x00{self.lora_name}\x00{self.lora_path}".encode()
        return int.from_bytes(hashlib.sha256(key).digest(), "little")
