"""Build tiny local model directories that vLLM's own factories accept (no hub download).

A byte-level BPE tokenizer trained with the `tokenizers` library on a few sentences, the
Qwen2-VL special tokens plus `<image>` and a chat template, and either a LLaVA config (multimodal:
vLLM builds a real multimodal processor and HF processor for it) or a Llama config with
random safetensors weights (for `vllm serve`). head_dim is 64 (vLLM's CPU backend needs >= 64).
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN2_VL_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<image>",
]  # fmt: skip
IMAGE_TOKEN = "<image>"

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A picture is worth a thousand words; describe this image please.",
    "Tokenizers are shared between threads in the vLLM API server.",
    "What is in the image? A cat, a dog and 42 birds.",
] * 20


def write_tokenizer(path: Path, vocab_size: int = 600, chat_template: str = CHAT_TEMPLATE,
                    tokenizer_class: str = "PreTrainedTokenizerFast") -> None:
    """A byte-level BPE tokenizer with the Qwen2-VL special tokens, saved as a fast tokenizer.
    Past a few hundred tokens it trains on generated text with enough distinct words to fill
    the vocabulary (151k, Qwen-sized: a minute or two on 2 cores)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from vllm_tokenizer_pool.local_tokenizer import generated_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=QWEN2_VL_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS if vocab_size <= 1000 else generated_text(vocab_size * 8),
                            trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in QWEN2_VL_SPECIAL
    }  # fmt: skip
    config = {
        "tokenizer_class": tokenizer_class,
        "model_max_length": 4096,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "added_tokens_decoder": added,
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    )


def _ids(path: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in QWEN2_VL_SPECIAL} | {"vocab": tok.get_vocab_size()}


def write_llava(path: Path) -> Path:
    """Config, tokenizer and processor files of a tiny LLaVA (no weights: never loaded).

    LLaVA rather than Qwen2-VL: its HF processor (CLIP image processor + tokenizer) needs no
    torchvision, which does not import beside the CPU torch these venvs use.
    """
    write_tokenizer(path)
    ids = _ids(path)
    vocab = ((ids["vocab"] + 63) // 64) * 64
    text = {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
    }
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 1,
        "num_hidden_layers": 1,
        "image_size": 28,
        "patch_size": 14,
        "projection_dim": 64,
    }
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": ids[IMAGE_TOKEN],
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "text_config": text,
        "vision_config": vision,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    image_processor = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": 28},
        "do_center_crop": True,
        "crop_size": {"height": 28, "width": 28},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
        "resample": 3,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=1))
    processor = {
        "processor_class": "LlavaProcessor",
        "patch_size": 14,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
        "image_token": IMAGE_TOKEN,
    }
    (path / "processor_config.json").write_text(json.dumps(processor, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|im_end|>"]}))
    return path


def _random(torch):
    """A seeded initializer: the same model bytes on every build."""
    g = torch.Generator().manual_seed(0)
    return lambda *shape: torch.randn(*shape, generator=g) * 0.02


def _decoder_weights(torch, rand, *, vocab: int, hidden: int, inter: int, layers: int,
                     qkv_bias: bool) -> dict:
    """The text decoder both tiny models share (Llama layout; Qwen2 adds q/k/v biases)."""
    weights = {
        "model.embed_tokens.weight": rand(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        for proj in "qkv":
            weights[p + f"self_attn.{proj}_proj.weight"] = rand(hidden, hidden)
            if qkv_bias:
                weights[p + f"self_attn.{proj}_proj.bias"] = torch.zeros(hidden)
        weights[p + "self_attn.o_proj.weight"] = rand(hidden, hidden)
        weights[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    return weights


def write_llama(path: Path) -> Path:
    """A tiny Llama with random safetensors weights that `vllm serve` can load on a CPU."""
    import torch
    from safetensors.torch import save_file

    write_tokenizer(path)
    ids = _ids(path)
    vocab = ((ids["vocab"] + 63) // 64) * 64
    hidden, inter, layers, heads = 128, 256, 2, 2
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": vocab,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|im_end|>"]}))
    rand = _random(torch)
    weights = _decoder_weights(torch, rand, vocab=vocab, hidden=hidden, inter=inter,
                               layers=layers, qkv_bias=False)
    save_file(weights, str(path / "model.safetensors"))
    return path


# --------------------------------------------------------------- Qwen2-VL (real `vllm serve`)

QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_VERSION = 2  # bump when a builder's output changes: part of the cache key
MODELS_CACHE = Path.home() / ".cache" / "vlm-operator" / "models"


def write_qwen2_vl(path: Path, vocab_size: int = 600, max_positions: int = 2048,
                   inter: int = 256, layers: int = 2) -> Path:
    """A tiny random-weight Qwen2-VL (text 128 wide, 2 layers; vision 64 wide, 1 block; head_dim
    64 in both) in the original checkpoint layout (model.*, visual.*, lm_head), which every vLLM
    release maps. Its image processor resizes any image to 56x56..112x112 pixels, so a 1x1 PNG
    costs 4 image tokens. ``vocab_size`` 151000 gives Qwen's vocabulary size (the embeddings stay
    small: 128 wide); ``max_positions`` 65536 allows prompts long enough that their prefill
    takes seconds even on this tiny model (attention grows with the square of the length);
    ``inter`` and ``layers`` make the weights as large as a download worth timing needs.
    Needs torch + safetensors (run it with a vLLM venv's python)."""
    import torch
    from safetensors.torch import save_file

    write_tokenizer(path, vocab_size=vocab_size, chat_template=QWEN2_VL_CHAT_TEMPLATE,
                    tokenizer_class="Qwen2TokenizerFast")
    (path / "chat_template.json").write_text(
        json.dumps({"chat_template": QWEN2_VL_CHAT_TEMPLATE}))
    ids = _ids(path)
    vocab = ((ids["vocab"] + 63) // 64) * 64
    hidden, heads = 128, 2
    v_dim, v_mlp, patch, temporal, merge = 64, 128, 14, 2, 2
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "max_window_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},  # sums to head_dim/2
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": vocab,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": {
            "depth": 1, "embed_dim": v_dim, "hidden_size": hidden, "hidden_act": "quick_gelu",
            "mlp_ratio": v_mlp // v_dim, "num_heads": 1, "in_channels": 3, "patch_size": patch,
            "spatial_merge_size": merge, "temporal_patch_size": temporal,
        },
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|im_end|>"]}))
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    image_processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "min_pixels": 56 * 56,
        "max_pixels": 112 * 112,
        "size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
        "patch_size": patch,
        "temporal_patch_size": temporal,
        "merge_size": merge,
        "image_mean": mean,
        "image_std": std,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=1))
    rand = _random(torch)
    weights = _decoder_weights(torch, rand, vocab=vocab, hidden=hidden, inter=inter,
                               layers=layers, qkv_bias=True)
    merged = v_dim * merge * merge
    b = "visual.blocks.0."
    weights |= {
        "visual.patch_embed.proj.weight": rand(v_dim, 3, temporal, patch, patch),
        b + "norm1.weight": torch.ones(v_dim), b + "norm1.bias": torch.zeros(v_dim),
        b + "norm2.weight": torch.ones(v_dim), b + "norm2.bias": torch.zeros(v_dim),
        b + "attn.qkv.weight": rand(3 * v_dim, v_dim), b + "attn.qkv.bias": torch.zeros(3 * v_dim),
        b + "attn.proj.weight": rand(v_dim, v_dim), b + "attn.proj.bias": torch.zeros(v_dim),
        b + "mlp.fc1.weight": rand(v_mlp, v_dim), b + "mlp.fc1.bias": torch.zeros(v_mlp),
        b + "mlp.fc2.weight": rand(v_dim, v_mlp), b + "mlp.fc2.bias": torch.zeros(v_dim),
        "visual.merger.ln_q.weight": torch.ones(v_dim),
        "visual.merger.ln_q.bias": torch.zeros(v_dim),
        "visual.merger.mlp.0.weight": rand(merged, merged),
        "visual.merger.mlp.0.bias": torch.zeros(merged),
        "visual.merger.mlp.2.weight": rand(hidden, merged),
        "visual.merger.mlp.2.bias": torch.zeros(hidden),
    }  # fmt: skip
    save_file(weights, str(path / "model.safetensors"))
    return path


BUILDERS = {
    "qwen2-vl": write_qwen2_vl,
    "qwen2-vl-151k": lambda path: write_qwen2_vl(path, vocab_size=151_000),
    # prompts up to 64k tokens, and 8 layers so that one such prefill takes well over 10 s
    # (stallSeconds' minimum) on one fast core: 8.7 s per 2 layers on a 2-core AMD EPYC machine
    "qwen2-vl-long": lambda path: write_qwen2_vl(path, max_positions=65536, layers=8),
    # about 1.2 GB of float32 weights (24 layers of a 32768-wide MLP): a download and a load
    # that take measurable time, for bench/real_vllm_starts.py
    "qwen2-vl-1g": lambda path: write_qwen2_vl(path, inter=32768, layers=24),
    "llama": write_llama,
}


def cached_model(kind: str) -> Path:
    """A tiny model of BUILDERS under ~/.cache/vlm-operator/models, built once (atomically)."""
    import shutil
    import tempfile

    final = MODELS_CACHE / f"{kind}-tiny-v{MODEL_VERSION}"
    if (final / "model.safetensors").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    BUILDERS[kind](tmp)
    try:
        tmp.rename(final)
    except OSError:  # built concurrently by someone else
        shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":  # `<vllm venv>/bin/python vllm_tiny_model.py KIND` -> the model dir
    import sys

    print(cached_model(sys.argv[1] if len(sys.argv) > 1 else "qwen2-vl"))
