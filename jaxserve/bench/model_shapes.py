"""Config-only model directories for dummy-weight benchmarks (no download).

    python -m jaxserve.bench.model_shapes llama3-8b DIR [--num-hidden-layers 4] [--no-tokenizer]

writes DIR/config.json (then `--model DIR --load-format dummy`; HF's side of the benches initialises the
same shape randomly) and, unless --no-tokenizer, a word-level tokenizer whose vocabulary is exactly the
model's: every id decodes to a word, and `bench serve`'s random word prompts encode one token per word, so
the OpenAI server can take text prompts and stream every generated token as text. It is no real language's
tokenizer: text through it measures speed, nothing else.
"""

from __future__ import annotations

import argparse
import json
import os

SHAPES = {
    # The shape ../shared/bench/hf_baseline.py measures transformers on.
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001, hidden_act="silu", torch_dtype="bfloat16",
    ),
    # Embedding models (`jaxserve bench embed`): BERT-base (bge-base, e5-base, all-mpnet's width) and a bare
    # Qwen3-8B decoder as Qwen3-Embedding-8B ships it (a *Model architecture: runner "auto" pools it).
    "bert-base": dict(
        architectures=["BertModel"], model_type="bert", hidden_size=768, intermediate_size=3072,
        num_hidden_layers=12, num_attention_heads=12, vocab_size=30522, max_position_embeddings=512,
        type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0, torch_dtype="float32",
    ),
    "qwen3-embedding-8b": dict(
        architectures=["Qwen3Model"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151665,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151643, hidden_act="silu", torch_dtype="bfloat16",
    ),
    # Llama-3.2-1B's shape: the 8B's vocabulary, so it can be the 8B's draft model (speculative decoding).
    "llama3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001, hidden_act="silu", torch_dtype="bfloat16",
    ),
    # Qwen2-VL-7B-Instruct (transformers-4 layout, as released): `jaxserve bench vl` serves it with dummy weights.
    "qwen2-vl-7b": dict(
        architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl", hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, hidden_act="silu",
        torch_dtype="bfloat16", use_sliding_window=False, sliding_window=32768, max_window_layers=28,
        rope_scaling=dict(type="mrope", mrope_section=[16, 24, 24]),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        vision_config=dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, in_chans=3, hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    ),
    # EAGLE heads for the llama3-8b shape (speculative_config method "eagle" / "eagle3", --load-format dummy draws
    # random weights of these shapes): one decoder layer of the 8B's widths. EAGLE-1 (as
    # yuhuili/EAGLE-LLaMA3-Instruct-8B) scores with the target's lm_head; EAGLE-3 (as
    # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) with its own over a 32k draft vocabulary, reading 3 target layers.
    "eagle-llama3-8b": dict(
        architectures=["LlamaForCausalLMEagle"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
        torch_dtype="bfloat16",
    ),
    "eagle3-llama3-8b": dict(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        draft_vocab_size=32000, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        hidden_act="silu", torch_dtype="bfloat16",
    ),
}

# Vision-language shapes: the tokenizer's special tokens at the config's ids (the prompt's image placeholders).
_VISION_SPECIALS = (("vision_start_token_id", "<|vision_start|>"), ("image_token_id", "<|image_pad|>"),
                    ("vision_end_token_id", "<|vision_end|>"))


def write_shape(name: str, out_dir: str, num_hidden_layers: int | None = None, tokenizer: bool = True) -> str:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    if num_hidden_layers is not None and num_hidden_layers < 1:
        raise ValueError(f"--num-hidden-layers={num_hidden_layers} is invalid: must be >= 1")
    import transformers

    # As save_pretrained writes it. Without it, transformers 5.0–5.17 take any local tokenizer for a Mistral one
    # and warn that its regex pattern is wrong.
    config = {**SHAPES[name], "transformers_version": transformers.__version__}
    if num_hidden_layers is not None:
        config["num_hidden_layers"] = num_hidden_layers
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if tokenizer and "bos_token_id" in config:  # an encoder shape gets none: its benches use token ids
        extra = {config[k]: text for k, text in _VISION_SPECIALS if k in config}
        write_word_tokenizer(out_dir, config["vocab_size"], config["bos_token_id"], config["eos_token_id"], extra)
    return out_dir


def write_word_tokenizer(
    out_dir: str, vocab_size: int, bos_id: int, eos_id: int, extra_special: dict[int, str] | None = None
) -> None:
    """One token per space-separated word ("▁the", ..., "▁w1234"), SentencePiece-style spaces;
    ``extra_special`` (id -> text) are further special tokens, matched whole in text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxserve.bench.serve import _WORDS  # the words of `bench serve`'s random prompts

    words = list(dict.fromkeys(_WORDS))
    unk_id = min(set(range(3)) - {bos_id, eos_id})
    special = {unk_id: "<unk>", bos_id: "<|begin_of_text|>", eos_id: "<|end_of_text|>", **(extra_special or {})}
    vocab, k = {}, 0
    for i in range(vocab_size):
        if i in special:
            vocab[special[i]] = i
        else:
            vocab[f"▁{words[k]}" if k < len(words) else f"▁w{i}"] = i
            k += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[bos_id], eos_token=special[eos_id],
                                   unk_token="<unk>")
    if extra_special:
        fast.add_special_tokens({"additional_special_tokens": list(extra_special.values())})
    fast.save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.model_shapes", description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out_dir")
    p.add_argument("--num-hidden-layers", type=int, default=None, help="fewer layers, same widths (quick runs)")
    p.add_argument("--no-tokenizer", dest="tokenizer", action="store_false", help="config.json only")
    ns = p.parse_args(argv)
    print(write_shape(ns.shape, ns.out_dir, ns.num_hidden_layers, ns.tokenizer))


if __name__ == "__main__":
    main()
