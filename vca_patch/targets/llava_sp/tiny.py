"""A tiny random-weight LLaVA (CLIP vision + Llama text) built offline from small configs, for tests and demos."""

from __future__ import annotations

from typing import Any

import torch

IMAGE_TOKEN_ID = 99
VOCAB = 100


def tiny_llava(
    *,
    image_size: int = 48,
    patch_size: int = 4,
    strategy: str = "default",
    seed: int = 0,
    vision_hidden: int = 32,
    text_hidden: int = 64,
) -> Any:
    """LlavaForConditionalGeneration with random weights: a (image_size // patch_size)² patch grid, 2+2 layers."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
    )
    text = LlamaConfig(
        hidden_size=text_hidden,
        intermediate_size=2 * text_hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    grid = image_size // patch_size
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=grid * grid + (strategy == "full"),
        vision_feature_select_strategy=strategy,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlavaForConditionalGeneration(config).eval()


def tiny_processor(image_size: int = 48, patch_size: int = 4, strategy: str = "default") -> Any:
    """A LlavaProcessor for tiny_llava: word-level tokenizer w0..w98 + <image> (id 99), CLIP image processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(IMAGE_TOKEN_ID)} | {"<image>": IMAGE_TOKEN_ID}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", additional_special_tokens=["<image>"])
    images = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,
    )
