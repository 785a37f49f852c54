"""Architectures for benchmarks/gpu_suite.py: the full-size configs of the
paper's models, their shrunk ``--tiny`` versions, parameter counting on the
meta device and the published counts."""

from __future__ import annotations

# -- architectures (full size; --tiny shrinks them) --------------------------------------------

MISTRAL_7B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "intermediate_size": 14336, "max_position_embeddings": 32768, "rope_theta": 1e6, "sliding_window": None,
                  "rms_norm_eps": 1e-5}
CLIP_VIT_L14_336 = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                        "image_size": 336, "patch_size": 14, "projection_dim": 768, "hidden_act": "quick_gelu"}
LLAVA_NEXT_GRID = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
LLAMA2_7B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                 "intermediate_size": 11008, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
ALBERT_LARGE = {"embedding_size": 128, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                    "intermediate_size": 4096, "max_position_embeddings": 512}
BERT_LARGE = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                  "max_position_embeddings": 512}
TINY_TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                 "intermediate_size": 64, "max_position_embeddings": 2048}
TINY_ALBERT = {"embedding_size": 16, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "intermediate_size": 64, "max_position_embeddings": 512}
TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                 "max_position_embeddings": 512}
TINY_CLIP = {"embed_dim": 32,
             "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}

# Published parameter counts (full size), for the arch part and the tests.
EXPECTED_PARAMETERS = {
    "LLaMA-2-7B": 6.74e9, "Mistral-7B": 7.24e9, "ALBERT-large": 17.7e6, "BERT-large": 335e6,
    "CLIP ViT-B/32": 151e6, "CLIP ViT-L/14": 428e6, "ResNet-50 v2": 25.5e6,
    # llava-v1.6-mistral-7b's model card: 7.57 B (its row name contains Mistral-7B's and CLIP ViT-L/14's: matched
    # whole, never by substring)
    "LLaVA-NeXT-7B (Mistral-7B + CLIP ViT-L/14-336)": 7.57e9,
}


def _mistral(tiny: bool, vocab: int = 32000):
    from transformers import MistralConfig

    return MistralConfig(vocab_size=vocab, **(TINY_TEXT if tiny else MISTRAL_7B))


def _llava_next_config(tiny: bool, vocab: int = 32064):
    from transformers import CLIPVisionConfig, LlavaNextConfig

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32,
                  "patch_size": 8} if tiny else CLIP_VIT_L14_336
    grid = [[32, 64], [64, 32], [64, 64]] if tiny else LLAVA_NEXT_GRID
    return LlavaNextConfig(vision_config=CLIPVisionConfig(**vision), text_config=_mistral(tiny, vocab),
                           image_grid_pinpoints=grid, vision_feature_layer=-2)


def _open_clip_cfg(name: str, tiny: bool) -> dict:
    if tiny:
        return TINY_CLIP
    import open_clip

    cfg = open_clip.get_model_config(name)  # shipped with open_clip: no network
    if cfg is None:
        raise RuntimeError(f"open_clip has no config {name!r}")
    return cfg


def architectures(tiny: bool = False) -> dict:
    """Name -> a function building the (random-weight) model, full size or
    shrunk with ``tiny``. Build them under ``torch.device("meta")`` to count."""
    def llava():
        from transformers import LlavaNextForConditionalGeneration

        return LlavaNextForConditionalGeneration(_llava_next_config(tiny))

    def mistral():
        from transformers import MistralForCausalLM

        return MistralForCausalLM(_mistral(tiny))

    def llama():
        from transformers import LlamaConfig, LlamaForCausalLM

        size = {k: v for k, v in TINY_TEXT.items()} if tiny else LLAMA2_7B
        return LlamaForCausalLM(LlamaConfig(vocab_size=32000, **size))

    def albert():
        from transformers import AlbertConfig, AlbertModel

        return AlbertModel(AlbertConfig(vocab_size=30000, **(TINY_ALBERT if tiny else ALBERT_LARGE)))

    def bert():
        from transformers import BertConfig, BertModel

        return BertModel(BertConfig(vocab_size=30522, **(TINY_BERT if tiny else BERT_LARGE)))

    def clip(name):
        def build():
            import open_clip

            return open_clip.CLIP(**_open_clip_cfg(name, tiny))

        return build

    return {
        "LLaVA-NeXT-7B (Mistral-7B + CLIP ViT-L/14-336)": llava,
        "Mistral-7B": mistral,
        "LLaMA-2-7B": llama,
        "CLIP ViT-B/32": clip("ViT-B-32"),
        "CLIP ViT-L/14": clip("ViT-L-14"),
        "ALBERT-large": albert,
        "BERT-large": bert,
        "ResNet-50 v2": lambda: resnetv2(tiny),
    }


def resnetv2(tiny: bool):
    """timm's ``resnetv2_50`` (pre-activation ResNet-50 v2, COSMiC's image
    tower), or the same design with one block per stage and narrow channels."""
    import timm

    if not tiny:
        return timm.create_model("resnetv2_50", pretrained=False)
    from timm.layers import BatchNormAct2d, create_conv2d
    from timm.models.resnetv2 import ResNetV2

    return ResNetV2(layers=(1, 1, 1, 1), channels=(32, 64, 128, 256), stem_chs=16, num_classes=10,
                    conv_layer=create_conv2d, norm_layer=BatchNormAct2d)


def count_parameters(build) -> int:
    """Parameters of the model ``build()`` returns, built on the meta device
    (shapes only: a 7B model costs no memory)."""
    import torch

    with torch.device("meta"):
        model = build()
    return sum(p.numel() for p in model.parameters())
