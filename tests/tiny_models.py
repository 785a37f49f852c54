"""Tiny random-weight models, tokenizers and data files for the tests, in one place.

Every model here is built from a config with random weights (seeded), and
every tokenizer is trained or assembled here from a handful of texts: nothing
is downloaded, and once its library is imported each is built in well
under a second on a CPU (the full-size Faster R-CNN detector in about one).
They go through storyrl's real loading paths (``save_pretrained``/
``from_pretrained``, open_clip ``local-dir:``), so a test exercises what
users run, only smaller.

Models and their sizes:

- :func:`save_tiny_clip`: open_clip CLIP, 32-d embeddings, 32 px images,
  ViT of 2 layers (width 32, patch 8), text transformer of 2 layers (width
  32, context 16, the real 49 408-token BPE vocabulary).
- :func:`coherence_model` / :func:`save_coherence_model`: RoViST-C
  (ALBERT + pair head); ``ALBERT_SIZES`` "small" (vocabulary 128, hidden 32,
  2 layers) or "tiny" (vocabulary 64, hidden 16, 1 layer).
- :func:`albert_tokenizer`: word-level BERT-style tokenizer for them.
- :func:`rovist_vg_model`: RoViST-VG, a timm ViT of 1 layer (width 32,
  32 px images, patch 8) with 16-d projections of 8-d word vectors.
- :func:`write_glove`: a GloVe text file of ``WORD_DIM``-d random vectors.
- :func:`tiny_llama` / :func:`chat_tokenizer`: a causal LM (LLaMA, hidden
  32, 2 layers) and a word-level tokenizer with a chat template, for TRL.
- :func:`save_random_detector`: torchvision Faster R-CNN (ResNet-50 FPN,
  91 COCO classes), random weights, as a ``--weights`` file.
- :func:`write_images`: small colour-gradient PNG files.

Heavy libraries are imported inside the functions, so importing this module
(conftest does) costs nothing. ``conftest.py`` exposes the common ones as
fixtures: ``tiny_clip``, ``images``, ``glove_path``, ``rovist_vg_dir``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path


def _torchvision_fallback() -> None:
    """Import storyrl first: on import it installs pure-PyTorch fallbacks for
    torchvision's compiled ops where they fail to load, which open_clip,
    timm and torchvision itself need."""
    importlib.import_module("storyrl")

# -- CLIP (open_clip) -------------------------------------------------------------

TINY_CLIP_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2.0},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def save_tiny_clip(directory: Path, seed: int = 0) -> str:
    """A tiny random-weight CLIP (``TINY_CLIP_CFG``, seeded) saved as an
    open_clip ``local-dir:`` model: ``open_clip_config.json`` and the
    weights in ``directory`` (kept if already there). Returns the model name
    to pass as ``clip_model``."""
    _torchvision_fallback()
    import open_clip
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "open_clip_pytorch_model.bin").exists():
        torch.manual_seed(seed)
        model = open_clip.CLIP(**TINY_CLIP_CFG)
        (directory / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_CLIP_CFG}))
        torch.save(model.state_dict(), directory / "open_clip_pytorch_model.bin")
    return f"local-dir:{directory}"


TINY_CLIP_TOWERS = {
    # open_clip's ModifiedResNet (the RN50 family's tower), one block per stage
    "resnet": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 16, "head_width": 16},
    # a timm trunk (resnet18, random weights) with open_clip's linear projection
    "timm": {"image_size": 32, "timm_model_name": "resnet18", "timm_model_pretrained": False,
             "timm_pool": "avg", "timm_proj": "linear"},
}


def save_tiny_clip_tower(directory: Path, tower: str, seed: int = 0) -> str:
    """:func:`save_tiny_clip` with another image tower (``TINY_CLIP_TOWERS``:
    ``"resnet"`` or ``"timm"``) and a 1-layer text tower, as a ``local-dir:``
    model name."""
    _torchvision_fallback()
    import open_clip
    import torch

    text_cfg = {**TINY_CLIP_CFG["text_cfg"], "layers": 1}
    cfg = {**TINY_CLIP_CFG, "vision_cfg": TINY_CLIP_TOWERS[tower], "text_cfg": text_cfg}
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "open_clip_pytorch_model.bin").exists():
        torch.manual_seed(seed)
        model = open_clip.CLIP(**cfg)
        (directory / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))
        torch.save(model.state_dict(), directory / "open_clip_pytorch_model.bin")
    return f"local-dir:{directory}"


def save_tiny_clip_hf_text(directory: Path, seed: int = 0) -> str:
    """A tiny CLIP whose text tower is a transformers BERT (open_clip's
    ``HFTextEncoder``, as ``hf-hub:`` models with an ``hf_model_name`` have):
    the BERT (``bert_config``, vocabulary of ``TAPM_TEXTS``) and its
    tokenizer in ``directory/bert``, the CLIP as a ``local-dir:`` model name.
    open_clip's own tokenizer loader is not used for it (pass the BERT
    tokenizer: :func:`hf_text_tokenize`)."""
    _torchvision_fallback()
    import torch
    from open_clip.model import CustomTextCLIP
    from transformers import BertModel

    bert = directory / "bert"
    cfg = {"embed_dim": 32, "vision_cfg": {**TINY_CLIP_CFG["vision_cfg"], "layers": 1},
           "text_cfg": {"hf_model_name": str(bert), "hf_tokenizer_name": str(bert), "hf_proj_type": "linear",
                        "hf_pooler_type": "cls_pooler", "context_length": 16}}
    if not (directory / "open_clip_pytorch_model.bin").exists():
        torch.manual_seed(seed)
        tokenizer = bert_wordpiece_tokenizer(TAPM_TEXTS, bert)
        BertModel(bert_config(len(tokenizer))).save_pretrained(bert)
        tokenizer.save_pretrained(bert)
        (directory / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))
        torch.save(CustomTextCLIP(**cfg).state_dict(), directory / "open_clip_pytorch_model.bin")
    return f"local-dir:{directory}"


def hf_text_tokenize(directory: Path, context_length: int = 16):
    """``texts -> [n, context_length]`` token ids of the BERT saved by
    :func:`save_tiny_clip_hf_text` in ``directory``, padded as open_clip's
    HF tokenizer pads."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory / "bert")

    def tokenize(texts):
        return tokenizer(list(texts), padding="max_length", max_length=context_length, truncation=True,
                         return_tensors="pt").input_ids

    return tokenize


def write_images(directory: Path, n: int = 3, size: tuple[int, int] = (48, 40)) -> list[Path]:
    """``n`` distinct small RGB images (colour gradients, ``size`` = width,
    height) as ``img0.png``, ``img1.png``, ... in ``directory``; the colours
    depend on ``n`` only, so the same call gives the same files."""
    import numpy as np
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    rng = np.random.default_rng(n)
    for k in range(n):
        w, h = size
        x = np.linspace(0, 1, w)[None, :, None]
        y = np.linspace(0, 1, h)[:, None, None]
        base = rng.uniform(0, 255, size=3)
        pixels = (base * (0.4 + 0.6 * x) * (0.5 + 0.5 * y) + 40 * k) % 256
        path = directory / f"img{k}.png"
        Image.fromarray(pixels.astype("uint8")).save(path)
        paths.append(path)
    return paths


# -- word-level tokenizers ------------------------------------------------------------

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CHAT_SPECIALS = ["[PAD]", "[UNK]", "[EOS]"]
# "role : content" per message; the words are added to the chat tokenizer's texts.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
CHAT_TEMPLATE_WORDS = "user : assistant : system :"


def _word_level(texts, specials: list[str], *, lowercase: bool, sort_vocab: bool = False):
    """A ``tokenizers.Tokenizer``: whitespace/punctuation words of ``texts``,
    ids for ``specials`` first, then the words by frequency as the trainer
    orders them, or alphabetically with ``sort_vocab``; unknown words give
    ``[UNK]``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    texts = [t.lower() for t in texts] if lowercase else list(texts)
    whitespace, vocab = pre_tokenizers.Whitespace(), None
    if sort_vocab:
        words = sorted({w for t in texts for w, _ in whitespace.pre_tokenize_str(t)} - set(specials))
        vocab = {w: i for i, w in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = whitespace
    if vocab is None:
        tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    return tok


def albert_tokenizer(texts, *, sort_vocab: bool = False, vocab_size: int = 128):
    """A word-level, lower-casing BERT-style ``PreTrainedTokenizerFast`` over
    the words of ``texts`` (``[PAD] [UNK] [CLS] [SEP] [MASK]`` first), with
    the standard pair encoding ``[CLS] a [SEP] b [SEP]`` and token types, as
    ALBERT's. Word ids follow frequency, or the alphabet with ``sort_vocab``.
    Fails unless the vocabulary fits an ALBERT of ``vocab_size``."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _word_level(texts, BERT_SPECIALS, lowercase=True, sort_vocab=sort_vocab)
    assert tok.get_vocab_size() <= vocab_size, f"{tok.get_vocab_size()} words do not fit vocab_size={vocab_size}"
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    # Standard pair encoding: test_coherence's independent reference relies on it.
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def chat_tokenizer(texts, chat_template: str = CHAT_TEMPLATE):
    """A word-level, case-keeping ``PreTrainedTokenizerFast`` trained on
    ``texts`` plus ``CHAT_TEMPLATE_WORDS`` (``[PAD] [UNK] [EOS]`` first),
    decoding with spaces between words, with ``chat_template``: for a causal
    LM (:func:`tiny_llama`) under TRL."""
    from tokenizers import decoders
    from transformers import PreTrainedTokenizerFast

    tok = _word_level([*texts, CHAT_TEMPLATE_WORDS], CHAT_SPECIALS, lowercase=False)
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]", chat_template=chat_template
    )


# -- RoViST-C coherence (ALBERT) -----------------------------------------------------

ALBERT_SIZES = {
    "small": {"vocab_size": 128, "embedding_size": 16, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2},
    "tiny": {"vocab_size": 64, "embedding_size": 8, "hidden_size": 16, "intermediate_size": 32,
             "num_hidden_layers": 1},
}


def albert_config(size: str = "small"):
    """``transformers.AlbertConfig`` of ``ALBERT_SIZES[size]``, 2 attention heads."""
    from transformers import AlbertConfig

    return AlbertConfig(**ALBERT_SIZES[size], num_attention_heads=2)


def coherence_model(seed: int = 0, *, size: str = "small", dropout: float = 0.4, head_scale: float = 1.0):
    """A random-weight RoViST-C ``CoherenceModel`` (ALBERT of
    :func:`albert_config` ``size``, seeded with ``seed``), in training mode.
    ``head_scale`` multiplies the pair head's weights: random weights give
    probabilities near 0.5, and 20 spreads them so that scores vary."""
    import torch

    from storyrl.models.coherence import CoherenceModel

    torch.manual_seed(seed)
    model = CoherenceModel.from_config(albert_config(size), dropout=dropout)
    if head_scale != 1.0:
        with torch.no_grad():
            model.linear.weight.mul_(head_scale)
    return model


def save_coherence_model(directory: Path, tokenizer, **options) -> str:
    """:func:`coherence_model` (``options``) saved with ``tokenizer`` in
    storyrl's format; returns the directory, a reward's ``model``."""
    coherence_model(**options).eval().save_pretrained(directory, tokenizer)
    return str(directory)


# -- RoViST-VG (timm ViT) and GloVe -----------------------------------------------------

TINY_VIT = "vit_tiny_patch16_224"
TINY_TIMM = {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 32, "num_heads": 2}
WORD_DIM = 8
GLOVE_WORDS = ["dog", "cat", "car", "sky", "tree", "man", "woman", "red", "church", "bottle", "the", "a"]


def rovist_vg_model(seed: int = 0, embed_dim: int = 16, word_dim: int = WORD_DIM):
    """A random-weight ``RovistVGModel`` in eval mode: ``TINY_VIT`` shrunk by
    ``TINY_TIMM`` (no ImageNet weights) and projections to ``embed_dim`` from
    ``word_dim``-d word vectors, seeded with ``seed``."""
    import torch

    from storyrl.models.rovist_vg import RovistVGModel

    torch.manual_seed(seed)
    return RovistVGModel.from_config(TINY_VIT, False, embed_dim, word_dim, timm_kwargs=TINY_TIMM).eval()


def write_glove(path: Path, words=GLOVE_WORDS, dim: int = WORD_DIM, seed: int = 1) -> str:
    """A GloVe text file at ``path``: one line ``word v1 ... v{dim}`` per word,
    standard normal values (``numpy`` seed ``seed``). Returns the path."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lines = [w + " " + " ".join(f"{v:.6f}" for v in rng.normal(size=dim)) for w in words]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


# -- causal LM (TRL) -------------------------------------------------------------------

LLAMA_SIZE = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 64, "max_position_embeddings": 128,
}


def tiny_llama(tokenizer, seed: int = 0):
    """A random-weight ``LlamaForCausalLM`` of ``LLAMA_SIZE`` for
    ``tokenizer`` (its vocabulary, pad and eos ids; no bos), seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, **LLAMA_SIZE,
    )
    return LlamaForCausalLM(config)


# -- region detector (torchvision) -------------------------------------------------------


def save_random_detector(path: Path, seed: int = 0) -> Path:
    """torchvision's Faster R-CNN ResNet-50 FPN with random weights (91 COCO
    classes, no backbone weights), its state dict saved at ``path``: a
    ``--weights`` file for ``storyrl regions``. Returns the path."""
    import warnings

    import torch

    _torchvision_fallback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the compat fallback warning
        from torchvision.models.detection import fasterrcnn_resnet50_fpn

    torch.manual_seed(seed)
    model = fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=91)
    torch.save(model.state_dict(), path)
    return Path(path)


# -- vision-language models (zero-shot prompting) -------------------------------------

VLM_SPECIALS = ["[PAD]", "[UNK]", "[EOS]", "<image>"]
VLM_IMAGE_SIZE = 32  # vision towers see 32x32 pixels in 8x8 patches
_VLM_VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": VLM_IMAGE_SIZE, "patch_size": 8}
_VLM_TEXT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 2048}
# "USER: <image>\n<text> ASSISTANT:" -- LLaVA 1.5's layout, with words the tiny vocabulary knows
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}USER: {% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)


def vlm_tokenizer(texts, image_token: bool = True):
    """A whitespace-split word-level ``PreTrainedTokenizerFast`` over the
    words of ``texts`` (so ``[INST]``, ``[/INST]`` and ``<s>`` are plain
    words, as in Mistral's text), ``<image>`` special (and the tokenizer's
    ``image_token`` unless ``image_token=False``: BLIP-2's processor sets
    its own), decoding with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(list(texts), trainers.WordLevelTrainer(special_tokens=VLM_SPECIALS))
    tok.decoder = decoders.WordPiece()
    extra = {"extra_special_tokens": {"image_token": "<image>"}} if image_token else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]",
                                   **extra)


def _text_config(kind: str, tokenizer):
    from transformers import LlamaConfig, MistralConfig, OPTConfig

    ids = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    if kind == "opt":
        return OPTConfig(**ids, bos_token_id=tokenizer.eos_token_id, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=2048)
    config_class = MistralConfig if kind == "mistral" else LlamaConfig
    return config_class(**ids, bos_token_id=None, num_key_value_heads=1, **_VLM_TEXT)


def save_tiny_vlm(directory: Path, family: str, texts, seed: int = 0) -> str:
    """A random-weight vision-language model and its processor saved in
    ``directory``, loadable with the Auto classes: ``llava_next`` (Mistral
    decoder, like llava-v1.6-mistral), ``llava`` (LLaMA decoder, LLaVA 1.5's
    chat template) or ``blip2`` (OPT decoder, 4 query tokens). The vocabulary
    is the words of ``texts``. Returns the directory."""
    import torch
    from transformers import (
        Blip2Config, Blip2ForConditionalGeneration, Blip2Processor, Blip2QFormerConfig, Blip2VisionConfig,
        BlipImageProcessor, CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration,
        LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor, LlavaNextProcessor,
        LlavaProcessor,
    )

    tokenizer = vlm_tokenizer([*texts, LLAVA_CHAT_TEMPLATE.replace("\n", " ")], image_token=family != "blip2")
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    size = VLM_IMAGE_SIZE
    torch.manual_seed(seed)
    if family == "llava_next":
        grid = [[size, size], [size, 2 * size], [2 * size, size]]
        config = LlavaNextConfig(vision_config=CLIPVisionConfig(**_VLM_VISION), text_config=_text_config("mistral", tokenizer),
                                 image_token_index=image_token, image_grid_pinpoints=grid, vision_feature_layer=-1)
        model = LlavaNextForConditionalGeneration(config)
        images = LlavaNextImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                         image_grid_pinpoints=grid)
        processor = LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)
    elif family == "llava":
        config = LlavaConfig(vision_config=CLIPVisionConfig(**_VLM_VISION), text_config=_text_config("llama", tokenizer),
                             image_token_index=image_token, vision_feature_layer=-1)
        model = LlavaForConditionalGeneration(config)
        images = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=LLAVA_CHAT_TEMPLATE)
    elif family == "blip2":
        config = Blip2Config(
            vision_config=Blip2VisionConfig(**_VLM_VISION),
            qformer_config=Blip2QFormerConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=32, encoder_hidden_size=16, vocab_size=len(tokenizer)),
            text_config=_text_config("opt", tokenizer), num_query_tokens=4, image_token_index=image_token,
        )
        model = Blip2ForConditionalGeneration(config)
        images = BlipImageProcessor(size={"height": size, "width": size})
        processor = Blip2Processor(image_processor=images, tokenizer=tokenizer, num_query_tokens=4)
    else:
        raise ValueError(f"unknown tiny VLM family {family!r}")
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return str(directory)


# -- TAPM: tiny GPT-2 decoder and story data (test_tapm*.py) -------------------------------

TAPM_TEXTS = ["a dog ran to the park .", "the cat sat on a red mat .", "we went home and slept .",
              "my family had a big party .", "the kids played in the snow ."]


def tiny_gpt2(tokenizer, seed: int = 0):
    """A random-weight ``GPT2LMHeadModel`` (2 layers, width 32) for
    ``tokenizer`` (its vocabulary; EOS doubles as BOS, as in GPT-2), seeded."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=128,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    return GPT2LMHeadModel(config)


def save_tiny_decoder(directory: Path, kind: str = "gpt2", seed: int = 0) -> str:
    """A tiny random decoder (``"gpt2"`` or ``"llama"``) and its word-level
    tokenizer over ``TAPM_TEXTS``, saved to ``directory`` (a decoder name for
    ``storyrl train tapm``)."""
    tokenizer = chat_tokenizer(TAPM_TEXTS)
    model = tiny_gpt2(tokenizer, seed) if kind == "gpt2" else tiny_llama(tokenizer, seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def write_tapm_stories(path: Path, image_ids: list[list[str]]) -> str:
    """JSONL story records, one per image-id list, with one ``TAPM_TEXTS``
    sentence per image (rotating, so stories differ)."""
    import json

    with open(path, "w", encoding="utf-8") as f:
        for k, ids in enumerate(image_ids):
            story = " ".join(TAPM_TEXTS[(k + j) % len(TAPM_TEXTS)] for j in range(len(ids)))
            f.write(json.dumps({"story_id": f"s{k}", "story": story, "image_ids": ids}) + "\n")
    return str(path)


# -- noun phrases without spaCy ---------------------------------------------------------


class KeywordPhrases:
    """Stands in for GROOViST's spaCy noun-phrase extractor (no English
    pipeline can be installed offline): each of ``words`` found in a story is
    one noun phrase, in story order. Set it as a GROOViST reward's
    ``_extractor``."""

    def __init__(self, words) -> None:
        self.words = frozenset(words)

    def extract(self, stories):
        import re

        return [[w for w in re.findall(r"[a-z]+", story.lower()) if w in self.words] for story in stories]


# -- RL policies (test_rl_train.py) ------------------------------------------------------


def save_tiny_llama(directory: Path, texts, seed: int = 0, chat: bool = True) -> str:
    """:func:`tiny_llama` and its :func:`chat_tokenizer` over ``texts`` saved
    in ``directory`` (a causal-LM policy); ``chat=False`` drops the chat
    template (plain-string prompts). Returns the directory."""
    tokenizer = chat_tokenizer(texts)
    if not chat:
        tokenizer.chat_template = None
    tiny_llama(tokenizer, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def save_tiny_chat_vlm(directory: Path, texts, seed: int = 0) -> str:
    """:func:`save_tiny_vlm` ``llava_next`` whose processor has a chat
    template (``LLAVA_CHAT_TEMPLATE``), as the hub's LLaVA-NeXT processors
    do: TRL renders VLM prompts with it. Returns the directory."""
    from transformers import AutoProcessor

    save_tiny_vlm(directory, "llava_next", texts, seed)
    processor = AutoProcessor.from_pretrained(directory)
    processor.chat_template = LLAVA_CHAT_TEMPLATE
    processor.save_pretrained(directory)
    return str(directory)


# -- Vrank (BERT encoder, WordPiece) ---------------------------------------------------

BERT_SIZE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 128}


def bert_wordpiece_tokenizer(texts, directory: Path):
    """A real BERT WordPiece tokenizer (``BertTokenizerFast``, lower-casing)
    whose ``vocab.txt`` in ``directory`` holds ``BERT_SPECIALS`` and every
    lower-cased word and punctuation mark of ``texts`` (sorted), so no word is
    split or unknown; pair encoding ``[CLS] a [SEP] b [SEP]`` with token types."""
    import re

    from transformers import BertTokenizerFast

    words = sorted({w for t in texts for w in re.findall(r"\w+|[^\w\s]", t.lower())} - set(BERT_SPECIALS))
    directory.mkdir(parents=True, exist_ok=True)
    vocab = BERT_SPECIALS + words
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    # transformers 5 takes the vocabulary itself (a mapping), not vocab_file.
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)


def bert_config(vocab_size: int, **overrides):
    """``transformers.BertConfig`` of ``BERT_SIZE`` (hidden 32, 2 layers) for a
    vocabulary of ``vocab_size``."""
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab_size, **{**BERT_SIZE, **overrides})


def vrank_model(vocab_size: int, seed: int = 0, pooling: str = "pooler", **overrides):
    """A random-weight ``VrankModel`` over a :func:`bert_config` BERT, seeded,
    in training mode."""
    import torch

    from storyrl.models.vrank import VrankModel

    torch.manual_seed(seed)
    return VrankModel.from_config(bert_config(vocab_size, **overrides), pooling=pooling)
