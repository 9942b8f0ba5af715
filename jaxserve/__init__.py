"""jaxserve: an LLM serving engine on JAX/XLA (paged KV cache, continuous batching, Pallas kernels)."""

from jaxserve.config import EngineArgs
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM and LLMEngine pull in JAX; import them lazily so `import jaxserve` stays light (CLI --help).
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxserve.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest"]
