"""TAPM-style storyteller: neighbour pooling, both training stages, save and
reload, generation through TapmGenerator, LoRA, and the CLI end to end. Tiny
random-weight decoders and timm test backbones; images made here."""

from __future__ import annotations

import json

import pytest

import storyrl  # noqa: F401  (torchvision fallback before transformers/timm)
import tiny_models

torch = pytest.importorskip("torch")

STORY_IDS = [[f"img{(k + j) % 5}" for j in range(3 + k % 2)] for k in range(6)]  # stories of 3 and 4 images


@pytest.fixture(scope="module")
def data(tmp_path_factory, one_thread_module):
    """Images, stories, a feature store (timm test_resnet, random weights) and
    a tiny GPT-2 decoder directory."""
    from storyrl.generators.tapm.features import FeatureExtractor, write_features

    root = tmp_path_factory.mktemp("tapm")
    paths = tiny_models.write_images(root / "img", n=5)
    stories = tiny_models.write_tapm_stories(root / "stories.jsonl", STORY_IDS)
    # fast: the `storyrl features` default, so models record it with their backbones
    extractor = FeatureExtractor("test_resnet", pretrained=False, device="cpu", image_pipeline="fast")
    write_features(root / "features", [(p.stem, str(p)) for p in paths], extractor, batch_size=3)
    decoder = tiny_models.save_tiny_decoder(root / "gpt2")
    return {"root": root, "stories": stories, "features": str(root / "features"), "decoder": decoder,
            "images": root / "img"}


def _model(data, seed=0, **options):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.generators.tapm.features import FeatureStore
    from storyrl.generators.tapm.model import TapmModel

    tokenizer = AutoTokenizer.from_pretrained(data["decoder"])
    store = FeatureStore(data["features"])
    decoder = AutoModelForCausalLM.from_pretrained(data["decoder"])
    model = TapmModel.from_decoder(decoder, tokenizer, {t: s["dim"] for t, s in store.types.items()},
                                   {t: s["tokens"] for t, s in store.types.items()}, backbones=store.backbones,
                                   seed=seed, **options)
    return model, tokenizer


def _config(data, out, **options):
    from storyrl.training.storyteller.tapm import TapmTrainConfig

    values = dict(output_dir=str(out), stories=[data["stories"]], features=data["features"], decoder=data["decoder"],
                  adaptation_epochs=2, epochs=4, batch_size=2, lr=3e-3, val_fraction=0.3, dropout=0.0,
                  warmup_steps=2)  # a short warm-up: the few steps here still train
    values.update(options)
    return TapmTrainConfig(**values)


@pytest.fixture(scope="module")
def trained(data):
    """Both stages on the tiny GPT-2, with the decoder's initial weights kept."""
    from storyrl.training.storyteller.tapm import train_tapm

    model, tokenizer = _model(data)
    initial = {k: v.clone() for k, v in model.decoder.state_dict().items()}
    initial_visual = {k: v.clone() for k, v in model.visual.state_dict().items()}
    out = data["root"] / "run"
    result = train_tapm(_config(data, out), progress=False, model=model, tokenizer=tokenizer)
    return {"out": out, "result": result, "model": model, "initial": initial, "initial_visual": initial_visual}


def _batch(data, ids):
    from storyrl.generators.tapm.features import FeatureStore

    store = FeatureStore(data["features"])
    G = max(len(k) for k in ids)
    feats = torch.zeros(len(ids), G, 1, store.types["image"]["dim"])
    mask = torch.zeros(len(ids), G, dtype=torch.bool)
    for b, keys in enumerate(ids):
        feats[b, : len(keys)] = store.get(keys)["image"]
        mask[b, : len(keys)] = True
    return {"image": feats}, mask


# -- architecture --------------------------------------------------------------------------


def test_neighbour_pooling_matches_a_hand_computation():
    from storyrl.generators.tapm.encoder import NeighbourPooling

    torch.manual_seed(0)
    pool = NeighbourPooling(4, [-2, -1, 1, 2])
    x = torch.randn(1, 4, 2, 4)  # one story, 4 slots, 2 tokens per image
    mask = torch.tensor([[True, True, True, False]])  # 3 images; the 4th slot is padding
    out = pool(x, mask)
    assert out.shape == (1, 4, 1 + 4 + 2, 4)
    per_image = x[0].mean(dim=1)  # G C
    story_mean = per_image[:3].mean(dim=0)
    linears = {-2: pool.direction["m2"], -1: pool.direction["m1"], 1: pool.direction["p1"], 2: pool.direction["p2"]}
    with torch.no_grad():
        for i in range(3):
            assert torch.allclose(out[0, i, 0], pool.global_linear(story_mean), atol=1e-6)  # global = mean
            for slot, k in enumerate([-2, -1, 1, 2], start=1):
                j = i + k
                expected = linears[k](per_image[j]) if 0 <= j < 3 else torch.zeros(4)  # zero past the ends
                assert torch.allclose(out[0, i, slot], expected, atol=1e-6), (i, k)
            assert torch.equal(out[0, i, 5:], x[0, i])


def test_generate_with_kv_cache_equals_greedy_without_cache(data):
    model, _ = _model(data, seed=3)
    model.eval()
    feats, mask = _batch(data, STORY_IDS[:2])
    prefix, _, _ = model.encode(feats, mask)
    flat = prefix[mask]
    ids, attention = model.prompt(flat)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attention, visual_prefix=flat, max_new_tokens=5,
                             min_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id)
        # Without cache, on the tokens generate chose (min_new_tokens may veto EOS):
        # the same logits at every step, so the prefix is used on the first step and
        # kept in the cache afterwards.
        start = ids.shape[1]
        for step, cached in enumerate(out.logits):
            full = model(input_ids=out.sequences[:, : start + step], visual_prefix=flat, use_cache=False).logits
            assert torch.allclose(cached, full[:, -1], atol=1e-4), step
    got = model.generate_sentences(feats, mask, max_new_tokens=5)
    assert len(got[0]) == len(STORY_IDS[0]) and len(got[1]) == len(STORY_IDS[1])  # one sentence per image


def test_stages_choose_the_trainable_parameters(data):
    model, _ = _model(data)
    model.set_stage("adaptation")
    assert not any(p.requires_grad for p in model.decoder.parameters())
    assert all(p.requires_grad for p in model.visual.parameters())
    model.set_stage("downstream")
    assert all(p.requires_grad for p in model.decoder.parameters())
    lora, _ = _model(data, lora={"target_modules": ["c_attn"]})  # GPT-2's fused attention projection
    lora.set_stage("downstream")
    trainable = [n for n, p in lora.decoder.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.requires_grad for p in lora.visual.parameters())


def test_four_bit_without_bitsandbytes_is_a_clear_error(data):
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None and torch.cuda.is_available():
        pytest.skip("bitsandbytes and CUDA present: 4-bit would load")
    with pytest.raises(RuntimeError, match="4-bit decoders need"):
        _model(data, quantization="4bit", lora=True)


# -- training ------------------------------------------------------------------------------


@pytest.mark.slow
def test_adaptation_trains_the_encoder_only(trained):
    from safetensors.torch import load_file

    adapted = load_file(str(trained["out"] / "adaptation" / "best" / "model.safetensors"))
    decoder = {k[len("decoder."):]: v for k, v in adapted.items() if k.startswith("decoder.")}
    assert decoder and all(torch.equal(trained["initial"][k], v) for k, v in decoder.items())  # bit-identical
    visual = {k[len("visual."):]: v for k, v in adapted.items() if k.startswith("visual.")}
    assert any(not torch.equal(trained["initial_visual"][k], v) for k, v in visual.items())
    history = [json.loads(line) for line in (trained["out"] / "adaptation" / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2] and "train_acc" in history[0]


@pytest.mark.slow
def test_downstream_trains_the_decoder_and_the_loss_decreases(trained):
    history = trained["result"].history
    assert len(history) == 4
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.5
    now = trained["model"].decoder.state_dict()
    assert any(not torch.equal(trained["initial"][k], now[k]) for k in now)


@pytest.mark.slow
def test_save_and_reload_give_identical_generations(trained, data, tmp_path):
    from storyrl.generators.tapm.model import TapmModel

    model = trained["model"].eval()
    feats, mask = _batch(data, STORY_IDS)
    before = model.generate_sentences(feats, mask, max_new_tokens=8)
    assert any(s for story in before for s in story)  # not all empty: the comparison means something
    model.save_pretrained(tmp_path / "m")
    reloaded = TapmModel.from_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "storyrl_tapm"
    assert reloaded.generate_sentences(feats, mask, max_new_tokens=8) == before
    prefix = model.encode(feats, mask)[0][mask]
    ids, _ = model.prompt(prefix)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, visual_prefix=prefix).logits,
                           reloaded(input_ids=ids, visual_prefix=reloaded.encode(feats, mask)[0][mask]).logits)
    best = TapmModel.from_pretrained(trained["out"] / "best")  # what training saved loads too
    assert best.generate_sentences(feats, mask, max_new_tokens=4)


def test_an_empty_tapm_story_is_a_failure_with_its_reason(tmp_path):
    """A story whose every sentence decodes to nothing is recorded as a failure,
    not written as "" with "failures": 0 (issue 21 item 5)."""
    from storyrl.data import StoryRecord
    from storyrl.generators import create_generator

    generator = create_generator("tapm", model=str(tmp_path), batch_size=3, max_new_tokens=4)

    class Model:  # token 0 decodes to "", anything else to a word
        def generate_sentences(self, features, mask, max_new_tokens):
            return [[[1, 2], [3]], [[0], [0]], [[0], [5]]]

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join("w" for i in ids if i) + ("  " if not any(ids) else "")

    generator._model, generator._tokenizer = Model(), Tokenizer()
    generator._features = lambda records: ({}, None)
    records = [StoryRecord(story_id=s, story="") for s in ("a", "b", "c")]
    out = generator.generate(records)
    assert out.stories == {"a": "w w w", "c": "w"}
    assert list(out.failures) == ["b"]
    assert out.failures["b"] == ("ValueError: empty story: the model generated no text for any of its 2 images "
                                 "(max_new_tokens=4)")


@pytest.mark.slow
def test_tapm_generator_writes_a_story_per_record(trained, data, tmp_path):
    from storyrl.data import load_stories
    from storyrl.generators import create_generator

    records = load_stories(data["stories"])
    generator = create_generator("tapm", model=str(trained["out"] / "best"), features=data["features"],
                                 max_new_tokens=6, batch_size=4)
    out = generator.generate(records)
    assert not out.failures and list(out.stories) == [r.story_id for r in records]
    assert all(isinstance(s, str) for s in out.stories.values())
    # Without a store the features are computed with the model's backbones: same stories.
    on_the_fly = create_generator("tapm", model=str(trained["out"] / "best"), image_root=str(data["images"]),
                                  max_new_tokens=6, batch_size=3)
    fresh = on_the_fly.generate(records)
    assert fresh.stories == out.stories
    # ... made by the store's image pipeline, which the model recorded with its backbones
    from storyrl.generators.tapm.features import FeatureStore

    store_pipeline = FeatureStore(data["features"]).backbones.get("image_pipeline", "exact")
    assert on_the_fly._extractor.image_pipeline == store_pipeline == "fast"
    # A model whose backbones name no pipeline came from an exact store (or one older than the option).
    import shutil

    older = shutil.copytree(trained["out"] / "best", tmp_path / "older")
    config = json.loads((older / "config.json").read_text())
    del config["backbones"]["image_pipeline"]
    (older / "config.json").write_text(json.dumps(config))
    generator = create_generator("tapm", model=str(older), image_root=str(data["images"]), max_new_tokens=2)
    assert not generator.generate(records[:1]).failures
    assert generator._extractor.image_pipeline == "exact"
    out.save(tmp_path / "stories.json")
    assert json.loads((tmp_path / "stories.json").read_text()) == out.stories

    # storyrl generate recognises a TAPM directory and runs this generator.
    from click.testing import CliRunner

    from storyrl.cli import main

    cli_out = tmp_path / "cli.json"
    args = ["generate", "--model", str(trained["out"] / "best"), "--features", str(data["features"]),
            "--data", str(data["stories"]), "--out", str(cli_out), "--max-new-tokens", "6", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(cli_out.read_text()) == out.stories
    assert json.loads((tmp_path / "cli.meta.json").read_text())["generator"] == "tapm"
    result = CliRunner().invoke(main, [*args[:-3], "--out", str(tmp_path / "x.json"), "--setting", "visual"])
    assert result.exit_code != 0 and "--setting does not apply to the tapm generator" in result.output


@pytest.mark.slow
def test_lora_trains_only_adapters_and_encoder(data, tmp_path):
    from safetensors.torch import load_file

    from storyrl.generators.tapm.model import TapmModel
    from storyrl.training.storyteller.tapm import train_tapm

    llama_dir = tiny_models.save_tiny_decoder(tmp_path / "llama", kind="llama")
    config = _config(data, tmp_path / "run", decoder=llama_dir, lora=True, adaptation_epochs=1, epochs=1)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(llama_dir).state_dict()
    train_tapm(config, progress=False)
    saved = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    lora = [k for k in saved if "lora_" in k]
    assert lora and all(any(t in k for t in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in lora)
    for key, value in saved.items():
        if key.startswith("decoder.") and "lora_" not in key:
            name = key.replace("decoder.base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(value, base[name]), key  # the base decoder never changes
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in saved.items() if "lora_B" in k)  # adapters moved

    # Adapters-only saving (as for a 4-bit decoder): the base comes from decoder_name again.
    model = TapmModel.from_pretrained(tmp_path / "run" / "best").eval()
    model.config.save_base_decoder = False
    model.config.decoder_name = llama_dir
    model.save_pretrained(tmp_path / "small")
    assert not [k for k in load_file(str(tmp_path / "small" / "model.safetensors"))
                if k.startswith("decoder.") and "lora_" not in k]
    feats, mask = _batch(data, STORY_IDS[:3])
    reloaded = TapmModel.from_pretrained(tmp_path / "small")
    assert reloaded.generate_sentences(feats, mask, max_new_tokens=5) == model.generate_sentences(
        feats, mask, max_new_tokens=5)


# -- command line ----------------------------------------------------------------------------


def _summary(output: str) -> dict:
    """The command's JSON summary (progress bars and warnings share the output)."""
    assert '{"' in output, output
    return json.loads(output[output.rindex('{"'):].splitlines()[0])


@pytest.mark.slow
def test_features_then_train_through_the_cli(data, tmp_path):
    from click.testing import CliRunner

    from storyrl.cli import main

    runner = CliRunner()
    table = tmp_path / "regions.csv"
    table.write_text("image_id,bbox\n" + "".join(f'img{k},"[0, 0, 20, 20]"\n' for k in range(5)))
    features = tmp_path / "features"
    args = ["features", "--data", data["stories"], "--image-root", str(data["images"]), "--out", str(features),
            "--backbone", "test_resnet", "--vit", "test_vit", "--region-table", str(table), "--max-boxes", "2",
            "--no-pretrained", "--batch-size", "2", "-q"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert _summary(result.output)["computed"] == 5
    index = json.loads((features / "index.json").read_text())
    assert index["types"] == {"image": {"dim": 96 + 64, "tokens": 1}, "boxes": {"dim": 96, "tokens": 2}}
    again = runner.invoke(main, args)  # resumable: nothing left to compute
    assert again.exit_code == 0 and _summary(again.output)["skipped"] == 5

    config = tmp_path / "tapm.yaml"
    config.write_text(f"output_dir: {tmp_path / 'run'}\nstories: [{data['stories']}]\nfeatures: {features}\n"
                      f"decoder: {data['decoder']}\nadaptation_epochs: 1\nepochs: 1\nbatch_size: 3\n")
    result = runner.invoke(main, ["train", "tapm", "--config", str(config), "-q"])
    assert result.exit_code == 0, result.output
    assert _summary(result.output)["epochs_run"] == 1
    best = tmp_path / "run" / "best"
    assert json.loads((best / "config.json").read_text())["model_type"] == "storyrl_tapm"
    result = runner.invoke(main, ["train", "tapm", "--config", str(config), "--resume", "--epochs", "2", "-q"])
    assert result.exit_code == 0, result.output
    assert _summary(result.output)["epochs_run"] == 2
    history = (tmp_path / "run" / "adaptation" / "history.jsonl").read_text().splitlines()
    assert len(history) == 1  # the finished adaptation stage is not run again


def test_vist_examples_keep_each_images_own_storylet(tmp_path):
    """A VIST story-in-sequence file gives one example per story: image keys
    and each image's own text in photo order (not the joined story split
    again), as the storylets were written."""
    from storyrl.generators.tapm.data import load_examples

    storylets = [("s1", 1, "p2", "Rain."), ("s1", 0, "p1", "We went out. It was late."),
                 ("s2", 0, "p3", "A dog."), ("s2", 1, "p4", "A cat.")]
    annotations = [[{"story_id": sid, "worker_arranged_photo_order": order, "photo_flickr_id": photo, "text": text}]
                   for sid, order, photo, text in storylets]
    path = tmp_path / "train.story-in-sequence.json"
    path.write_text(json.dumps({"annotations": annotations}))
    examples = load_examples([str(path)])
    assert [(e.story_id, e.sentences) for e in examples] == [
        ("s1", ["We went out. It was late.", "Rain."]), ("s2", ["A dog.", "A cat."])]
    assert [e.keys for e in examples] == [["p1", "p2"], ["p3", "p4"]]
