"""Policy adapters for PPO: how each kind of policy samples stories and how
it is run again on them for log-probabilities and values.

* :class:`CausalLMAdapter`: any transformers causal LM. String prompts are
  tokenised as they are; conversational prompts go through the tokenizer's
  chat template (``trl.data_utils.maybe_apply_chat_template``, as TRL's
  trainers do). One sequence per story.
* :class:`VisionLanguageAdapter`: image-text-to-text models (LLaVA-NeXT
  style) with their processor: conversational prompts whose image
  placeholders are filled from the row's ``images``
  (``trl.data_utils.prepare_multimodal_messages``), the processor's
  ``pixel_values``/``image_sizes`` (or ``image_grid_thw`` ...) passed again
  in every forward. One sequence per story.
* :class:`TapmAdapter`: storyrl's TAPM-style generator: one sentence per
  image, each sampled after that image's visual prefix as
  ``TapmModel.generate_sentences`` does (features from a
  :class:`~storyrl.generators.tapm.features.FeatureStore`, keyed by the
  row's ``image_ids``), joined into the story. Each sentence is its own
  sequence; see :mod:`storyrl.training.storyteller.rl.ppo` for how the story's score is
  credited to them.

Every adapter samples with the policy's LoRA adapters merged
(:func:`storyrl.training.storyteller.rl.sampling.merged_adapters`, unless
``merge_adapters_for_sampling`` is off) and returns a :class:`Rollout`:
queries left-padded, responses right-padded and cut after the first stop
token, ``story`` mapping each sequence to its row. A minibatch is a set of
stories (all of a story's sequences travel together, which TAPM's
story-level visual encoder needs); :meth:`PolicyAdapter.model_inputs` builds
the forward inputs of one.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from storyrl.training.storyteller.rl.sampling import merged_adapters

__all__ = [
    "CausalLMAdapter",
    "PolicyAdapter",
    "Rollout",
    "TapmAdapter",
    "VisionLanguageAdapter",
    "is_tapm_policy",
    "make_adapter",
    "response_logits",
    "select_multimodal",
    "truncate_responses",
]


@dataclass
class Rollout:
    """The sequences sampled in one PPO step for ``B`` stories (``N`` ≥ B
    sequences).

    ``query`` (N, Q) left-padded with ``query_mask``; ``response`` (N, T),
    pad after each sequence's end; ``lengths`` (N,) the real response tokens
    (the stop token included); ``ended`` (N,) whether the sequence stopped
    at the stop token rather than at ``response_length``; ``story`` (N,)
    the row each sequence belongs to (sequences are story-major). Per story:
    ``prompts`` (as the dataset gave them), ``completions`` (text, or an
    assistant message for conversational prompts), ``texts`` and
    ``completion_ids``. ``extra`` holds the adapter's own inputs."""

    query: torch.Tensor
    query_mask: torch.Tensor
    response: torch.Tensor
    lengths: torch.Tensor
    ended: torch.Tensor
    story: torch.Tensor
    prompts: list
    completions: list
    texts: list[str]
    completion_ids: list[list[int]]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_stories(self) -> int:
        return len(self.texts)

    def response_mask(self) -> torch.Tensor:
        """(N, T) bool: the real response tokens."""
        positions = torch.arange(self.response.shape[1], device=self.response.device)
        return positions.unsqueeze(0) < self.lengths.unsqueeze(1)

    def sequences_of(self, stories: torch.Tensor) -> torch.Tensor:
        """Indices of the sequences of ``stories``, story-major, in the order given."""
        story = self.story
        return torch.cat([torch.nonzero(story == int(s), as_tuple=True)[0] for s in stories.tolist()])

    def per_story(self, values: torch.Tensor) -> torch.Tensor:
        """(B,) sums over each story's sequences of ``values``, per sequence
        (N,) or per token (N, T), on the device and in the dtype of ``values``."""
        if values.dim() == 2:
            values = values.sum(dim=1)
        totals = torch.zeros(self.num_stories, dtype=values.dtype, device=values.device)
        return totals.index_add_(0, self.story.to(values.device), values)

    def story_token_lengths(self) -> list[int]:
        """Real response tokens per story (summed over its sequences)."""
        return self.per_story(self.lengths).tolist()


def response_logits(logits: torch.Tensor, context_length: int, response_length: int) -> torch.Tensor:
    """The logits predicting the response tokens, (n, T, V): from a full
    forward (positions Q − 1 … Q + T − 2) or one that kept the last T + 1."""
    if logits.shape[1] == response_length + 1:
        return logits[:, :response_length]
    return logits[:, context_length - 1 : context_length - 1 + response_length]


def truncate_responses(response: torch.Tensor, stop_token_id: int | None, pad_token_id: int,
                       generated_lengths: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each row after its first ``stop_token_id`` (the stop token kept,
    everything after it set to ``pad_token_id``). Returns ``(response,
    lengths, ended)``: ``lengths`` counts the kept tokens, ``ended`` tells
    whether the row contains the stop token. Without a stop token a row's
    length is ``generated_lengths`` (or the full width)."""
    N, T = response.shape
    if generated_lengths is None:
        generated_lengths = torch.full((N,), T, dtype=torch.long, device=response.device)
    if stop_token_id is None or T == 0:
        ended = torch.zeros(N, dtype=torch.bool, device=response.device)
        lengths = generated_lengths.clone()
    else:
        is_stop = response == stop_token_id
        ended = is_stop.any(dim=1)
        first = torch.where(ended, is_stop.float().argmax(dim=1), torch.full_like(generated_lengths, T))
        lengths = torch.where(ended, first + 1, generated_lengths)
    positions = torch.arange(T, device=response.device).unsqueeze(0)
    response = response.masked_fill(positions >= lengths.unsqueeze(1), pad_token_id)
    return response, lengths, ended


def _generation_config(args, stop_token_id: int | None, pad_token_id: int, suppress: Sequence[int] = ()):
    """Sampling from the tempered policy. Every logits processor a model's
    own generation config could add is set neutral explicitly (transformers
    fills unset fields from it), so the samples come from the distribution
    whose log-probabilities PPO computes (up to top-k/top-p, as in TRL)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=args.response_length, min_new_tokens=0, do_sample=True, num_beams=1,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, typical_p=1.0,
        repetition_penalty=1.0, no_repeat_ngram_size=0, epsilon_cutoff=0.0, eta_cutoff=0.0,
        # []: never stop early (stop_token none); transformers would fill None from the model's config
        eos_token_id=[stop_token_id] if stop_token_id is not None else [], pad_token_id=pad_token_id,
        suppress_tokens=list(suppress) or None,
    )


def _to(value: Any, device, dtype) -> Any:
    """A processor output on the policy's device; pixel values in its dtype."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point() and dtype is not None and dtype.is_floating_point:
        return value.to(device=device, dtype=dtype)
    return value.to(device)


def _checkpointing_on(model) -> None:
    """Non-reentrant activation checkpointing (transformers 5 renamed
    gradient_checkpointing_enable; both spellings are accepted)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class PolicyAdapter:
    """Base class: sampling, forward inputs and reference forwards of one
    kind of policy. ``processing_class`` is the tokenizer or processor."""

    #: One sequence per story (False for TAPM).
    one_sequence_per_story: bool = True
    #: Token ids never sampled (a VLM's image placeholders).
    suppressed: tuple[int, ...] = ()

    def __init__(self, processing_class, args) -> None:
        self.processing_class = processing_class
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.args = args
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise ValueError("PPO: the tokenizer has neither a pad nor an EOS token")
        self.pad_token_id = int(pad)
        self.stop_token_id = self._stop_token_id()

    def _stop_token_id(self) -> int | None:
        if self.args.stop_token_id is not None:
            return self.args.stop_token_id
        if self.args.stop_token == "eos":
            eos = self.tokenizer.eos_token_id
            if eos is None:
                raise ValueError("PPO: stop_token is eos but the tokenizer has no EOS token; set stop_token_id "
                                 "or stop_token: none")
            return int(eos)
        return None

    # -- to implement ------------------------------------------------------------
    def rollout(self, policy, rows: list[dict]) -> Rollout:
        raise NotImplementedError

    def model_inputs(self, rollout: Rollout, stories: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(sequence indices, forward kwargs)`` for a set of stories."""
        raise NotImplementedError

    def forward(self, policy, inputs: dict[str, Any], output_hidden_states: bool = False,
                response_length: int | None = None):
        """The policy's output (``logits``, ``hidden_states``) on ``inputs``.
        With ``response_length`` T, models that support it compute the logits
        of the last T + 1 positions only (``logits_to_keep``): the response's
        (a VLM's image tokens would otherwise cost a vocabulary-wide row
        each); read them with :func:`response_logits`."""
        return policy(**inputs, output_hidden_states=output_hidden_states, use_cache=False,
                      **self._keep(policy, response_length))

    def _keep(self, model, response_length: int | None) -> dict[str, int]:
        if response_length is None:
            return {}
        base = model.get_base_model() if _is_peft(model) else model
        if is_tapm_policy(base):
            base = base.decoder.get_base_model() if _is_peft(base.decoder) else base.decoder
        try:
            accepts = "logits_to_keep" in inspect.signature(base.forward).parameters
        except (TypeError, ValueError):
            accepts = False
        return {"logits_to_keep": response_length + 1} if accepts else {}

    # -- shared --------------------------------------------------------------------
    def make_reference(self, policy):
        """A frozen copy of the policy, or None when the policy carries peft
        adapters (the reference is then the policy with them disabled)."""
        if _is_peft(policy):
            return None
        if getattr(policy, "is_loaded_in_4bit", False) or getattr(policy, "is_loaded_in_8bit", False):
            raise ValueError("PPO: a quantised policy needs LoRA adapters (peft_config); its weights cannot be "
                             "copied for the reference")
        reference = copy.deepcopy(policy)
        reference.eval().requires_grad_(False)
        return reference

    def reference_forward(self, policy, reference, inputs: dict[str, Any], response_length: int | None = None):
        if reference is not None:
            return self.forward(reference, inputs, response_length=response_length)
        with policy.disable_adapter():
            return self.forward(policy, inputs, response_length=response_length)

    def hidden_size(self, policy) -> int:
        config = policy.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(text.hidden_size)

    def enable_gradient_checkpointing(self, policy) -> None:
        _checkpointing_on(policy)

    def save(self, policy, directory: Path) -> None:
        """The policy (adapters only for a peft model) and its tokenizer/processor."""
        policy.save_pretrained(directory)
        self.processing_class.save_pretrained(directory)

    def decode(self, ids: torch.Tensor) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)


class CausalLMAdapter(PolicyAdapter):
    """Text policies (see the module docs)."""

    def _prompt_texts(self, prompts: list) -> tuple[list[str], bool]:
        from trl.data_utils import is_conversational, maybe_apply_chat_template

        conversational = is_conversational({"prompt": prompts[0]})
        texts = [maybe_apply_chat_template({"prompt": p}, self.processing_class)["prompt"] for p in prompts]
        return texts, conversational

    def _encode(self, rows: list[dict]) -> tuple[dict[str, torch.Tensor], bool, list[int]]:
        """Tokenised prompts (left-padded), whether they are conversational,
        and the images of each."""
        prompts = [row["prompt"] for row in rows]
        texts, conversational = self._prompt_texts(prompts)
        # A chat template writes its own special tokens; a plain prompt gets
        # the tokenizer's (as TRL's trainers do).
        encoded = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="left",
                                 add_special_tokens=not conversational)
        return dict(encoded), conversational, [0] * len(rows)

    def _generate(self, policy, encoded: dict[str, torch.Tensor]) -> torch.Tensor:
        config = _generation_config(self.args, self.stop_token_id, self.pad_token_id, self.suppressed)
        with merged_adapters(policy, self.args.merge_adapters_for_sampling):
            out = policy.generate(**encoded, generation_config=config)
        return out[:, encoded["input_ids"].shape[1]:]

    def rollout(self, policy, rows: list[dict]) -> Rollout:
        device = next(policy.parameters()).device
        encoded, conversational, num_images = self._encode(rows)
        dtype = getattr(policy, "dtype", None)
        encoded = {k: _to(v, device, dtype) for k, v in encoded.items()}
        new = self._generate(policy, encoded)
        response, lengths, ended = truncate_responses(new, self.stop_token_id, self.pad_token_id)
        texts = [self.decode(r[:n]) for r, n in zip(response, lengths.tolist())]
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else list(texts)
        query, query_mask = encoded.pop("input_ids"), encoded.pop("attention_mask")
        return Rollout(
            query=query, query_mask=query_mask, response=response, lengths=lengths, ended=ended,
            story=torch.arange(len(rows), device=device), prompts=[row["prompt"] for row in rows],
            completions=completions, texts=texts,
            completion_ids=[r[:n].tolist() for r, n in zip(response, lengths.tolist())],
            extra={"multimodal": encoded, "num_images": num_images},
        )

    def model_inputs(self, rollout: Rollout, stories: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        seqs = rollout.sequences_of(stories)
        response_mask = rollout.response_mask()[seqs]
        attention = torch.cat((rollout.query_mask[seqs].bool(), response_mask), dim=1).long()
        # Positions count real tokens only (left padding), as generate() numbered them.
        position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
        inputs = {"input_ids": torch.cat((rollout.query[seqs], rollout.response[seqs]), dim=1),
                  "attention_mask": attention, "position_ids": position_ids}
        inputs.update(self._multimodal_inputs(rollout, seqs))
        return seqs, inputs

    def _multimodal_inputs(self, rollout: Rollout, seqs: torch.Tensor) -> dict[str, Any]:
        return {}


class VisionLanguageAdapter(CausalLMAdapter):
    """Image-text-to-text policies with a processor (see the module docs).

    The model's image/video placeholder tokens are suppressed in sampling (a
    sampled placeholder would make the next forward expect image features
    for it; a real model practically never samples one, a random one does),
    and PPO's log-probabilities exclude them too, so that they are those of
    the distribution sampled from."""

    def __init__(self, processing_class, args, policy=None) -> None:
        super().__init__(processing_class, args)
        config = getattr(policy, "config", None)
        names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
        ids = {getattr(config, n, None) for n in names}
        tokenizer_id = getattr(processing_class, "image_token_id", None)
        self.suppressed = tuple(sorted(int(i) for i in ids | {tokenizer_id} if isinstance(i, int) and i >= 0))

    def _encode(self, rows: list[dict]) -> tuple[dict[str, torch.Tensor], bool, list[int]]:
        from trl.data_utils import is_conversational, prepare_multimodal_messages

        prompts = [row["prompt"] for row in rows]
        if not is_conversational({"prompt": prompts[0]}):
            raise ValueError("PPO: a vision-language policy needs conversational prompts "
                             "([{'role': 'user', 'content': [...]}]); the dataset has plain strings")
        images = [_row_images(row) for row in rows]
        messages = [prepare_multimodal_messages(p, images=i) for p, i in zip(prompts, images)]
        texts, _ = self._prompt_texts(messages)
        kwargs = {"images": images} if any(images) else {}
        encoded = self.processing_class(text=texts, return_tensors="pt", padding=True, padding_side="left",
                                        add_special_tokens=False, **kwargs)
        return dict(encoded), True, [len(i) for i in images]

    def _multimodal_inputs(self, rollout: Rollout, seqs: torch.Tensor) -> dict[str, Any]:
        return select_multimodal(rollout.extra["multimodal"], rollout.extra["num_images"], seqs.tolist(),
                                 rollout.query.shape, rollout.response.shape[1])


def _row_images(row: dict) -> list:
    images = row.get("images")
    if images is None and row.get("image") is not None:
        images = [row["image"]]
    if images is None:
        return []
    out = []
    for image in images:
        if isinstance(image, (str, Path)):
            from PIL import Image

            with Image.open(image) as opened:
                image = opened.convert("RGB")
        out.append(image)
    return out


def _block_rows(sizes: Sequence[int], blocks: Sequence[int]) -> list[int]:
    """The row indices of ``blocks`` (in that order) of a tensor made of
    consecutive blocks of ``sizes`` rows."""
    starts = [0, *itertools.accumulate(sizes)]
    return [row for block in blocks for row in range(starts[block], starts[block + 1])]


def select_multimodal(fields: dict[str, Any], num_images: Sequence[int], seqs: list[int],
                      query_shape: tuple[int, int], response_width: int) -> dict[str, Any]:
    """The processor's extra fields for the sequences ``seqs`` of a rollout.

    Per-token fields (the query's shape, e.g. ``token_type_ids``) get zeros
    for the response; per-image fields (``image_sizes``, ``image_grid_thw``,
    and ``pixel_values`` with one row per image) are cut by ``num_images``;
    ``pixel_values`` with ``image_grid_thw`` by its patch rows, as TRL does;
    fields with one row per sequence are indexed directly."""
    image_rows = _block_rows(num_images, seqs)
    grid = fields.get("image_grid_thw")
    return {key: _select_field(key, value, seqs, image_rows, grid, num_images, query_shape, response_width)
            for key, value in fields.items() if isinstance(value, torch.Tensor)}


def _select_field(key: str, value: torch.Tensor, seqs: list[int], image_rows: list[int], grid: Any,
                  num_images: Sequence[int], query_shape: tuple[int, int], response_width: int) -> torch.Tensor:
    N, total = query_shape[0], sum(num_images)
    if value.dim() == 2 and tuple(value.shape) == tuple(query_shape):
        return torch.cat((value, value.new_zeros((N, response_width))), dim=1)[seqs]
    if key == "pixel_values" and grid is not None:
        return value[_block_rows(grid.prod(dim=1).tolist(), image_rows)]
    if value.shape[0] == total and total != N:  # one row per image (a tie with the prompts: per prompt, below)
        return value[image_rows]
    if value.shape[0] == N:
        return value[seqs]
    raise ValueError(f"PPO: cannot split the processor's {key!r} (first dimension {value.shape[0]}) over "
                     f"{N} prompts with {total} images")


class TapmAdapter(PolicyAdapter):
    """storyrl's TAPM-style generator (see the module docs). ``features`` is
    the feature directory (default: ``args.tapm_features``)."""

    one_sequence_per_story = False

    def __init__(self, processing_class, args, features: str | None = None) -> None:
        super().__init__(processing_class, args)
        from storyrl.generators.tapm.features import FeatureStore

        directory = features or args.tapm_features
        if directory is None:
            raise ValueError("PPO: a TAPM policy needs its feature directory (tapm_features)")
        self.store = FeatureStore(directory)

    def _keys(self, row: dict) -> list[str]:
        if row.get("image_ids"):
            return [str(k) for k in row["image_ids"]]
        if row.get("story_images"):
            return [Path(str(p)).stem for p in row["story_images"]]
        raise ValueError(f"PPO: story {row.get('story_id')!r} has no image_ids for the TAPM features")

    def _features(self, rows: list[dict], device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        from storyrl.generators.tapm.features import pad_story_features

        per_story = [self.store.get(self._keys(r), where=f" (story {r.get('story_id')!r})") for r in rows]
        features, mask = pad_story_features(per_story)
        return {k: v.to(device) for k, v in features.items()}, mask.to(device)

    def rollout(self, policy, rows: list[dict]) -> Rollout:
        device = next(policy.parameters()).device
        features, image_mask = self._features(rows, device)
        prefix, _, _ = policy.encode(features, image_mask)
        flat = prefix[image_mask]  # sentences, story-major
        ids, attention = policy.prompt(flat)
        config = _generation_config(self.args, self.stop_token_id, self.pad_token_id)
        with merged_adapters(policy, self.args.merge_adapters_for_sampling):
            out = policy.generate(input_ids=ids, attention_mask=attention, visual_prefix=flat,
                                  generation_config=config)
        new = out[:, ids.shape[1]:]
        response, lengths, ended = truncate_responses(new, self.stop_token_id, self.pad_token_id)
        story = torch.repeat_interleave(torch.arange(len(rows), device=device), image_mask.sum(dim=1))
        texts, completion_ids = [], []
        for b in range(len(rows)):
            seqs = torch.nonzero(story == b, as_tuple=True)[0].tolist()
            sentences = [self._sentence(response[s], int(lengths[s]), bool(ended[s])) for s in seqs]
            texts.append(" ".join(t for t in sentences if t))
            completion_ids.append([tok for s in seqs for tok in response[s][: int(lengths[s])].tolist()])
        return Rollout(
            query=ids, query_mask=attention, response=response, lengths=lengths, ended=ended, story=story,
            prompts=[row.get("prompt") for row in rows], completions=list(texts), texts=texts,
            completion_ids=completion_ids, extra={"features": features, "image_mask": image_mask},
        )

    def _sentence(self, ids: torch.Tensor, length: int, ended: bool) -> str:
        return self.decode(ids[: length - 1 if ended else length]).strip()

    def model_inputs(self, rollout: Rollout, stories: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        seqs = rollout.sequences_of(stories)
        response_mask = rollout.response_mask()[seqs]
        attention = torch.cat((rollout.query_mask[seqs].bool(), response_mask), dim=1).long()
        index = stories.to(rollout.extra["image_mask"].device)
        return seqs, {
            "input_ids": torch.cat((rollout.query[seqs], rollout.response[seqs]), dim=1),
            "attention_mask": attention,
            "features": {k: v[index] for k, v in rollout.extra["features"].items()},
            "image_mask": rollout.extra["image_mask"][index],
        }

    def forward(self, policy, inputs: dict[str, Any], output_hidden_states: bool = False,
                response_length: int | None = None, visual=None):
        visual = visual if visual is not None else policy.visual
        features = {k: v.to(dtype=visual.cls.dtype) for k, v in inputs["features"].items()}
        prefix, _, _ = visual(features, inputs["image_mask"])
        flat = prefix[inputs["image_mask"]]
        return policy(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], visual_prefix=flat,
                      output_hidden_states=output_hidden_states, use_cache=False,
                      **self._keep(policy, response_length))

    def make_reference(self, policy):
        """A frozen copy of the whole model; with LoRA on the decoder only of
        the visual encoder (the decoder's reference is its adapters disabled)."""
        if _is_peft(policy.decoder):
            visual = copy.deepcopy(policy.visual)
            return visual.eval().requires_grad_(False)
        return super().make_reference(policy)

    def reference_forward(self, policy, reference, inputs: dict[str, Any], response_length: int | None = None):
        from storyrl.generators.tapm.encoder import VisualEncoder

        if isinstance(reference, VisualEncoder):
            with policy.decoder.disable_adapter():
                return self.forward(policy, inputs, response_length=response_length, visual=reference)
        return self.forward(reference, inputs, response_length=response_length)

    def hidden_size(self, policy) -> int:
        return int(policy.config.hidden_size)

    def enable_gradient_checkpointing(self, policy) -> None:
        _checkpointing_on(policy.decoder)


def make_adapter(policy, processing_class, args, tapm_features: str | None = None) -> PolicyAdapter:
    """The adapter for ``policy``: TAPM, vision-language (a processor with an
    image processor) or causal LM."""
    base = policy.get_base_model() if _is_peft(policy) else policy
    if is_tapm_policy(base):
        return TapmAdapter(processing_class, args, features=tapm_features)
    if hasattr(processing_class, "image_processor"):
        return VisionLanguageAdapter(processing_class, args, policy=base)
    return CausalLMAdapter(processing_class, args)


def is_tapm_policy(model) -> bool:
    """Whether ``model`` (peft-wrapped or not) is storyrl's ``TapmModel``.
    Told by its class name: an isinstance check would import the TAPM
    package for every policy."""
    base = model.get_base_model() if _is_peft(model) else model
    return type(base).__name__ == "TapmModel"
