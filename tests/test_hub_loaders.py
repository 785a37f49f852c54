"""Every loader that would download from the hub checks it first (issue 21
item 2): offline, the policy, value model, TAPM decoder, the learned metrics'
base models and COSMiC's encoders fail at once, one line naming the model and
the option that points at a local copy; local directories are never probed
and many loaders cost one probe. No test touches the network."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from storyrl.models import hub

MISSING = "nobody/no-such-model"


@pytest.fixture
def probe(monkeypatch):
    """The reachability probe, counted; answers False (no network). Every
    transformers/hub download is replaced by a recorder: none may run."""
    import huggingface_hub
    import transformers

    calls, loads = [], []

    def fake(url, timeout=hub.PROBE_TIMEOUT_S):
        calls.append(url)
        return False

    monkeypatch.setattr(hub, "_probe", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    for name in ("AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForImageTextToText",
                 "AutoModelForSequenceClassification", "AutoProcessor", "AutoTokenizer", "AlbertModel",
                 "AlbertConfig"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained",
                            lambda *a, _n=name, **k: loads.append((_n, a)) or 1 / 0)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: loads.append(("snapshot", a)) or 1 / 0)
    hub._reset()
    yield SimpleNamespace(calls=calls, loads=loads)
    assert loads == [], "a download was tried"
    hub._reset()


def _raises(fn, *needles):
    with pytest.raises(hub.HubUnreachableError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def test_policy_loaders_name_the_model_and_the_model_key(probe):
    from storyrl.training.storyteller.rl.policy import detect_policy, load_policy

    config = SimpleNamespace(model=MISSING, revision=None, precision="fp32", load_in_4bit=False)
    for kind in ("causal_lm", "vlm"):
        _raises(lambda k=kind: load_policy(config, kind=k), f"policy model {MISSING!r}", "--model DIR")
    _raises(lambda: detect_policy(MISSING), f"policy model {MISSING!r}", "--model DIR")
    assert len(probe.calls) == 1  # one probe for the whole process


def test_value_model_names_the_yaml_key(probe):
    from storyrl.training.storyteller.rl.ppo.value import load_value_model

    _raises(lambda: load_value_model(MISSING), f"value model {MISSING!r}", "ppo.value_model")


def test_tapm_decoder_and_tokenizer(probe, tmp_path):
    from storyrl.generators.tapm.model import load_decoder
    from storyrl.training.storyteller.tapm import _build

    _raises(lambda: load_decoder(MISSING), f"TAPM decoder {MISSING!r}")
    config = SimpleNamespace(tokenizer=None, init_from=None, decoder=MISSING)
    _raises(lambda: _build(config, None, None, None), f"tokenizer {MISSING!r}", "set decoder", "--decoder DIR")
    config = SimpleNamespace(tokenizer="nobody/tok", init_from=None, decoder=MISSING)
    _raises(lambda: _build(config, None, None, None), "tokenizer 'nobody/tok'", "--tokenizer DIR")
    config = SimpleNamespace(tokenizer=None, init_from=None, decoder=MISSING)
    _raises(lambda: _build(config, None, None, "a tokenizer"), f"TAPM decoder {MISSING!r}", "--decoder DIR")


@pytest.mark.parametrize("trainer", ["coherence", "vrank"])
def test_learned_metric_trainers_name_base_model_and_tokenizer(probe, trainer):
    import importlib

    build = importlib.import_module(f"storyrl.training.judges.{trainer}")._build_model
    config = SimpleNamespace(init_from=None, base_model=MISSING, tokenizer=None, dropout=0.1, pooling="pooler",
                             max_length=8)
    _raises(lambda: build(config, None, None), f"base model {MISSING!r}", "set base_model", "--base-model DIR")
    config.tokenizer = "nobody/tok"
    _raises(lambda: build(config, "a model", None), "tokenizer 'nobody/tok'", "set tokenizer", "--tokenizer DIR")


def test_coherence_reward_loader_names_base_model_before_reading_the_checkpoint(probe, tmp_path):
    from storyrl.models.coherence import CoherenceModel, load_coherence_model

    checkpoint = tmp_path / "rovist_c.pth"
    checkpoint.write_bytes(b"not read: the hub check comes first")
    _raises(lambda: load_coherence_model(str(checkpoint), MISSING), f"ALBERT config {MISSING!r}",
            "coherence reward's base_model", "--base-model DIR")
    _raises(lambda: CoherenceModel.from_base(MISSING), f"ALBERT base model {MISSING!r}")


def test_vrank_reward_loader_names_model_and_tokenizer(probe, tmp_path):
    from storyrl.models.vrank import VrankModel, load_vrank_model

    _raises(lambda: load_vrank_model(MISSING), f"Vrank model {MISSING!r}", "--vrank-model DIR")
    _raises(lambda: VrankModel.from_base(MISSING), f"Vrank base encoder {MISSING!r}")


def test_vrank_tokenizer_option_is_checked(probe, tmp_path, monkeypatch):
    from storyrl.models import vrank

    monkeypatch.setattr(vrank.VrankModel, "from_pretrained", classmethod(lambda cls, d: ("net", None)))
    _raises(lambda: vrank.load_vrank_model(str(tmp_path), MISSING), f"Vrank tokenizer {MISSING!r}",
            "--tokenizer DIR")


def test_cosmic_encoders(probe, tmp_path, monkeypatch):
    import json

    from storyrl.models import cosmic

    spec = cosmic.EncoderSpec(image_model="resnet18", image_pretrained="default", text_model=str(tmp_path))
    _raises(lambda: cosmic.require_encoders(spec), "COSMiC image tower 'resnet18'", "'timm/resnet18",
            "image_pretrained")
    # random or file weights need no hub; a local text model is not probed
    cosmic.require_encoders(cosmic.EncoderSpec(image_model="resnet18", image_pretrained=None,
                                               text_model=str(tmp_path)))
    no_image = cosmic.EncoderSpec(image_model="resnet18", image_pretrained=None, text_model=MISSING)
    _raises(lambda: cosmic.require_encoders(no_image), f"COSMiC text model {MISSING!r}", "text_model")
    # the reward names the file that names the encoders
    model_dir = tmp_path / "cosmic"
    model_dir.mkdir()
    (model_dir / cosmic._CONFIG_FILE).write_text(json.dumps({"encoders": no_image.to_dict()}))
    monkeypatch.setattr(cosmic, "cosmic_encoders", lambda *a, **k: 1 / 0)
    _raises(lambda: cosmic.load_cosmic(str(model_dir), device="cpu"), f"COSMiC text model {MISSING!r}",
            str(model_dir / cosmic._CONFIG_FILE), "encoders.text_model")


def test_cosmic_trainer_checks_before_loading_data(probe):
    from storyrl.models.cosmic import EncoderSpec
    from storyrl.training.judges.cosmic import train_cosmic

    spec = EncoderSpec(image_model="resnet18", image_pretrained=None, text_model=MISSING)
    config = SimpleNamespace(encoder_spec=lambda: spec)  # no data options: loading them would fail
    _raises(lambda: train_cosmic.__wrapped__(config, False, False), f"COSMiC text model {MISSING!r}",
            "--text-model DIR")
    spec = EncoderSpec(image_model="resnet18", image_pretrained="default", text_model=MISSING)
    _raises(lambda: train_cosmic.__wrapped__(config, False, False), "COSMiC image tower 'resnet18'",
            "--image-pretrained FILE")


def test_local_directories_are_never_probed(probe, tmp_path):
    from storyrl.models.hub import require_hub_model

    for name in (str(tmp_path), f"{tmp_path}/", "~"):
        require_hub_model(name)
    # paths that do not exist are not repo ids either: the loader reports them, no probe and no hub error
    for name in (str(tmp_path / "missing"), "./missing", "../missing", "~/missing", "runs/a/final"):
        require_hub_model(name)
    assert probe.calls == []
    with pytest.raises(hub.HubUnreachableError):  # a repo id is still checked
        require_hub_model("org/model")
    assert len(probe.calls) == 1


def test_many_loaders_one_probe(probe):
    from storyrl.generators.tapm.model import load_decoder
    from storyrl.models.vrank import load_vrank_model
    from storyrl.training.storyteller.rl.ppo.value import load_value_model

    for load in (load_decoder, load_value_model, load_vrank_model):
        with pytest.raises(hub.HubUnreachableError):
            load(MISSING)
    assert len(probe.calls) == 1


def test_rovist_vg_trainer_checks_the_vit_before_loading_data(probe):
    from storyrl.training.judges.rovist_vg import train_rovist_vg

    config = SimpleNamespace(vit="resnet18", pretrained_vit=True, timm_kwargs={})  # no data options
    _raises(lambda: train_rovist_vg.__wrapped__(config, False, False), "timm model 'resnet18'", "'timm/resnet18",
            "--no-pretrained-vit")
    # local weights: no hub needed, so the run goes on to read its data (which this config lacks)
    config.timm_kwargs = {"pretrained_cfg_overlay": {"file": "/weights.pth"}}
    with pytest.raises(AttributeError, match="pairs"):
        train_rovist_vg.__wrapped__(config, False, False)


def test_an_unreachable_hub_turns_on_offline_mode_for_cached_models(probe, tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "models--org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(hub, "_cache_dir", lambda: tmp_path)
    assert constants.is_offline_mode() is False
    hub.require_hub_model("org/cached")  # cached: passes, but the hub was probed once ...
    assert len(probe.calls) == 1
    assert constants.is_offline_mode() is True  # ... and the cached copy loads without retries
    message = _raises(lambda: hub.require_hub_model("org/not-cached"), "cannot be reached")
    assert "HF_HUB_OFFLINE is set" not in message and len(probe.calls) == 1
    hub._reset()
    assert constants.is_offline_mode() is False  # tests get the flag back


def test_after_the_switch_the_reason_is_still_the_unreachable_hub(probe):
    assert hub.hub_reachable() is False
    assert hub._env_offline() is False  # doctor and the errors name the hub, not HF_HUB_OFFLINE


def test_coherence_directory_without_tokenizer_names_the_albert_tokenizer(tmp_path, monkeypatch):
    # a directory saved without a tokenizer takes base_model's: offline and not cached,
    # that is the one-line hub error, not transformers' message about slow tokenizers
    import socket

    from huggingface_hub import constants
    from tiny_models import save_coherence_model

    from storyrl.models.coherence import CoherenceModel, load_coherence_model

    directory = save_coherence_model(tmp_path / "coh", None)
    assert CoherenceModel.from_pretrained(directory)[1] is None  # not an empty-vocabulary tokenizer
    cache = tmp_path / "hf"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "_cache_dir", lambda: cache)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: 1 / 0)  # no network, even broken
    hub._reset()
    try:
        for base, shown in ((MISSING, MISSING), ("albert-large-v1", "albert-large-v1")):
            message = _raises(lambda b=base: load_coherence_model(directory, b), f"ALBERT tokenizer {shown!r}",
                              "HF_HUB_OFFLINE is set", "coherence reward's base_model", "--base-model DIR")
            assert str(cache) in message
    finally:
        hub._reset()


def test_vrank_directory_without_tokenizer_takes_the_tokenizer_option(tmp_path):
    # transformers 5 builds an empty-vocabulary tokenizer from a directory holding only
    # config.json; a Vrank directory saved without a tokenizer must take the option's
    from tiny_models import bert_wordpiece_tokenizer, vrank_model

    from storyrl.models.vrank import VrankModel, load_vrank_model

    tokenizer = bert_wordpiece_tokenizer(["a cat sat on the mat", "the dog ran"], tmp_path / "tok")
    tokenizer.save_pretrained(tmp_path / "tok")
    vrank_model(tokenizer.vocab_size).save_pretrained(tmp_path / "vrank")
    assert VrankModel.from_pretrained(tmp_path / "vrank")[1] is None
    _, loaded = load_vrank_model(str(tmp_path / "vrank"), str(tmp_path / "tok"))
    assert loaded.get_vocab() == tokenizer.get_vocab()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer; give the tokenizer option"):
        load_vrank_model(str(tmp_path / "vrank"))
