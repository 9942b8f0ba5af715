"""The GGUF loader and tokenizer run where torch cannot be imported (jaxserve's run-time promise)."""

import subprocess
import sys
import textwrap

import pytest

from jaxserve.models.loader.default_model import default_model_path

# Runs in a fresh interpreter: torch is blocked before anything else is imported. transformers decides
# whether torch exists with importlib.util.find_spec, so that answers "no" too; any real import raises.
_SCRIPT = textwrap.dedent(
    r"""
    import importlib.abc, importlib.util, sys

    def _is_torch(name):
        return name == "torch" or name.startswith("torch.")

    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if _is_torch(name):
                raise ImportError(f"torch is blocked in this test (import of {name})")
            return None

    sys.meta_path.insert(0, _NoTorch())
    _real_find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a, **k: None if _is_torch(name) else _real_find_spec(name, *a, **k)

    from jaxserve.models.loader.gguf import read_gguf
    from jaxserve.models.loader.gguf_tokenizer import load_gguf_tokenizer

    path = sys.argv[1]
    checkpoint = read_gguf(path)
    assert checkpoint.hf_config["model_type"] == "llama"
    names = [name for name, _ in checkpoint.tensors()]
    assert len(names) == 272, len(names)
    tokenizer = load_gguf_tokenizer(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n"), prompt
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
    assert not any(_is_torch(m) for m in sys.modules), sorted(m for m in sys.modules if _is_torch(m))
    print("OK")
    """
)


@pytest.mark.slow
def test_reader_and_tokenizer_need_no_torch():
    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    result = subprocess.run([sys.executable, "-c", _SCRIPT, path], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]
