"""Precision is part of every trainer's contract (issue 30): the trainers on
:func:`storyrl.training.loop.fit` (RoViST-C, Vrank, RoViST-VG, COSMiC,
TAPM) train at ``mixed_precision`` fp16 and bf16 on the CPU, in that
precision (the autocast dtype each step runs under is recorded), and
their first step's loss is the fp32 run's within a tolerance derived
from the dtype's epsilon; the weights change, stay finite and fp32 (the
master copy autocast keeps), and best/ loads as the reward.

Tolerance: the first step's loss (before any update, same seed and data)
differs from fp32's only by rounding inside the autocast ops; with
``eps`` = the dtype's machine epsilon (fp16 2^-10, bf16 2^-7) it is
allowed ``LOSS_EPS_FACTOR * eps * max(1, |loss|)``. The factor covers
the accumulated rounding of a few layers (each matmul rounds its output
once to the dtype, inputs are rounded once) with room for other CPUs'
kernels; measured on this machine: at most 0.24 (RoViST-VG fp16), most
under 0.1 (printed with -s).
"""

from __future__ import annotations

import math

import storyrl  # noqa: F401  (torchvision fallback before transformers/timm)

import pytest
import torch
import tiny_models
from test_cosmic import raccoon_dir, tiny_bert  # noqa: F401  (fixtures: COSMiC's tiny data and text encoder)

from storyrl.training import loop

pytestmark = pytest.mark.usefixtures("one_thread_module")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: Allowed first-step loss difference, in units of the dtype's epsilon (module docs).
LOSS_EPS_FACTOR = 4.0


_FIT = loop.fit


def eps(precision: str) -> float:
    return torch.finfo(DTYPES[precision]).eps


def autocast_dtype() -> torch.dtype:
    """The dtype autocast computes in here (fp32 when it is off)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32


class Recorder:
    """``fit`` of a trainer module, wrapped: each training step's loss and the
    autocast dtype it ran under (fp32 when autocast is off) are recorded."""

    def __init__(self, monkeypatch, module) -> None:
        self.losses: list[float] = []
        self.dtypes: set[torch.dtype] = set()
        real = _FIT  # not the module's: an earlier Recorder may have wrapped it

        def fit(model, train, val, config, step_fn, **kwargs):
            def step(m, batch):
                loss, metrics = step_fn(m, batch)
                if m.training:
                    self.losses.append(float(loss.detach().float()))
                    self.dtypes.add(autocast_dtype())
                return loss, metrics

            return real(model, train, val, config, step, **kwargs)

        monkeypatch.setattr(loop, "fit", fit)  # trainers that import it when they run
        if module is not loop and hasattr(module, "fit"):
            monkeypatch.setattr(module, "fit", fit)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def check_run(name: str, precision: str, reference: list[float], rec: Recorder, before: dict, after: dict) -> None:
    """The run at ``precision`` against the fp32 one (module docs)."""
    assert rec.dtypes == {DTYPES[precision]}, rec.dtypes
    first, ref = rec.losses[0], reference[0]
    assert math.isfinite(first)
    diff = abs(first - ref) / (eps(precision) * max(1.0, abs(ref)))
    print(f"{name} {precision}: first loss {first:.6f} vs fp32 {ref:.6f}: {diff:.2f} eps")
    assert diff <= LOSS_EPS_FACTOR, f"{name} {precision}: first loss {first} vs fp32 {ref} ({diff:.1f} eps)"
    assert all(math.isfinite(x) for x in rec.losses)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "no weight changed"
    assert all(torch.isfinite(after[k]).all() for k in after)
    # autocast keeps fp32 master weights: what is saved is fp32
    assert {after[k].dtype for k in after} == {torch.float32}


def test_fp16_and_bf16_on_the_cpu_are_those_dtypes_not_fp32(tmp_path):
    """make_accelerator gives what was asked, on the CPU too: fp16 autocast
    with a GradScaler (accelerate alone trains fp16 in fp32 there), bf16
    autocast, no autocast for no; auto = no on the CPU."""
    from storyrl.training.accelerators import make_accelerator, resolve_mixed_precision

    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    for asked, dtype, scaled in [("fp16", torch.float16, True), ("bf16", torch.bfloat16, False),
                                 ("no", None, False), ("auto", None, False)]:
        accelerator = make_accelerator(asked)
        with accelerator.autocast():
            seen = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        assert seen == dtype, asked
        assert (accelerator.scaler is not None) == scaled, asked
    assert resolve_mixed_precision("auto", cuda=True) == "fp16"
    assert resolve_mixed_precision("auto", cuda=False) == "no"
    with pytest.raises(ValueError, match="mixed_precision: expected one of auto, no, fp16, bf16, got 'fp8'"):
        resolve_mixed_precision("fp8")


def test_fit_at_fp16_and_bf16_matches_fp32_and_resumes(tmp_path, monkeypatch):
    """The generic loop on a small MLP: every precision's first loss against
    fp32's, weights trained; an fp16 run resumes its GradScaler."""
    from torch.utils.data import TensorDataset

    from storyrl.training.config import TrainConfig

    def data(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=g)
        return TensorDataset(x, (x.sum(-1) > 0).long())

    def step(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y), {}

    def run(precision, out, resume=False, **extra):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        before = weights(model)
        rec = Recorder(monkeypatch, loop)
        config = TrainConfig(output_dir=str(out), epochs=2, batch_size=8, lr=0.01, mixed_precision=precision,
                             **extra)
        loop.fit(model, data(32, 0), data(8, 1), config, step, progress=False, resume=resume)
        return rec, before, weights(model)

    reference = run("no", tmp_path / "fp32")[0].losses
    for precision in DTYPES:
        check_run("fit", precision, reference, *run(precision, tmp_path / precision))
    # fp16 resume: the GradScaler's scale is restored with the checkpoint.
    whole, _, w_whole = run("fp16", tmp_path / "whole")
    run("fp16", tmp_path / "cut", max_steps=5)
    resumed, _, w_resumed = run("fp16", tmp_path / "cut", resume=True)
    assert resumed.losses == whole.losses[5:]  # its own steps, as the uninterrupted run took them
    assert all(torch.equal(w_whole[k], w_resumed[k]) for k in w_whole)


# -- the trainers on fit ------------------------------------------------------------------
# Each runs one short epoch at no, fp16 and bf16 (same seed, data and initial
# weights); the tiny models and data are those of the trainers' own tests.

PRECISIONS = ("no", "fp16", "bf16")


def compare_runs(name, runs) -> None:
    reference = runs["no"][0].losses
    assert runs["no"][0].dtypes == {torch.float32}
    for precision in DTYPES:
        check_run(name, precision, reference, *runs[precision])


@pytest.mark.slow
def test_coherence_trains_at_each_precision(tmp_path, monkeypatch):
    import json

    from test_train_coherence import make_tokenizer, synthetic_stories

    from storyrl.models.coherence import CoherenceModel
    from storyrl.rewards import create_reward
    from storyrl.training.judges import coherence

    (tmp_path / "s.json").write_text(json.dumps(synthetic_stories(12)), encoding="utf-8")
    tokenizer = make_tokenizer()
    runs = {}
    for precision in PRECISIONS:
        rec = Recorder(monkeypatch, coherence)
        model = tiny_models.coherence_model(seed=0, size="small", dropout=0.0)
        before = weights(model)
        config = coherence.CoherenceTrainConfig(
            output_dir=str(tmp_path / precision), stories=[str(tmp_path / "s.json")], epochs=1, batch_size=8,
            lr=1e-3, max_length=64, base_model="unreachable/never-loaded", mixed_precision=precision)
        coherence.train_coherence(config, progress=False, model=model, tokenizer=tokenizer)
        runs[precision] = (rec, before, weights(model))
        # best/ of a mixed-precision run is the coherence reward's model
        CoherenceModel.from_pretrained(tmp_path / precision / "best")
        reward = create_reward("coherence", model=str(tmp_path / precision / "best"), device="cpu", precision="fp32")
        assert math.isfinite(reward.score(["Tom woke up early. Then Tom walked to the zoo."])[0])
    compare_runs("coherence", runs)


@pytest.mark.slow
def test_vrank_trains_at_each_precision(tmp_path, monkeypatch):
    from test_vrank import VOCAB_TEXTS, write_vhed

    from storyrl.rewards import create_reward
    from storyrl.training.judges import vrank

    tokenizer = tiny_models.bert_wordpiece_tokenizer(VOCAB_TEXTS, tmp_path / "tok")
    csv_path = write_vhed(tmp_path / "vhed.csv", n_seq=8, pairs_per_seq=2)
    runs = {}
    for precision in PRECISIONS:
        rec = Recorder(monkeypatch, vrank)
        model = tiny_models.vrank_model(len(tokenizer), seed=1, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
        before = weights(model)
        config = vrank.VrankTrainConfig(output_dir=str(tmp_path / precision), vhed=csv_path, epochs=1, batch_size=8,
                                        lr=1e-3, max_length=64, seed=0, base_model="unreachable/never-loaded",
                                        mixed_precision=precision)
        vrank.train_vrank(config, progress=False, model=model, tokenizer=tokenizer)
        runs[precision] = (rec, before, weights(model))
        r = create_reward("vrank", model=str(tmp_path / precision / "best"), device="cpu", precision="fp32")
        assert all(math.isfinite(x) for x in r.compare(["a dog runs ."], ["a cat sits ."]))
    compare_runs("vrank", runs)
    # The default, auto, is the authors' fp16 on CUDA and fp32 (no) on the CPU.
    rec = Recorder(monkeypatch, vrank)
    config = vrank.VrankTrainConfig(output_dir=str(tmp_path / "auto"), vhed=csv_path, epochs=1, batch_size=8,
                                    max_length=64, base_model="unreachable/never-loaded")
    assert config.mixed_precision == "auto"
    vrank.train_vrank(config, progress=False, model=tiny_models.vrank_model(len(tokenizer), seed=1),
                      tokenizer=tokenizer)
    assert rec.dtypes == ({torch.float16} if torch.cuda.is_available() else {torch.float32})


@pytest.mark.slow
def test_rovist_vg_trains_at_each_precision(tmp_path, monkeypatch, images, glove_path):
    from pathlib import Path

    from storyrl.training.judges import rovist_vg

    pairs = tmp_path / "pairs.csv"
    rows = [("img0.png", "[0, 0, 24, 20]", "dog"), ("img0.png", "[24, 0, 48, 40]", "red car"),
            ("img1.png", "", "sky"), ("img1.png", "[0, 0, 30, 30]", "tree"), ("img2.png", "[10, 10, 40, 40]", "man"),
            ("img2.png", "", "church"), ("img0.png", "", "woman"), ("img1.png", "[5, 5, 45, 35]", "bottle")]
    pairs.write_text("image,bbox,phrase\n" + "".join(f'{i},"{b}",{p}\n' for i, b, p in rows))
    runs = {}
    for precision in PRECISIONS:
        rec = Recorder(monkeypatch, rovist_vg)
        model = tiny_models.rovist_vg_model(seed=3)
        before = weights(model)
        config = rovist_vg.RovistVGTrainConfig(output_dir=str(tmp_path / precision), pairs=str(pairs),
                                               image_root=str(Path(images[0]).parent), glove=glove_path, epochs=2,
                                               batch_size=2, lr=3e-3, val_fraction=0.25, mixed_precision=precision)
        rovist_vg.train_rovist_vg(config, progress=False, model=model)
        runs[precision] = (rec, before, weights(model))
        from storyrl.rewards.rovist_vg import RovistVG

        reward = RovistVG(model=str(tmp_path / precision / "best"), glove=glove_path, regions="whole", device="cpu")
        assert math.isfinite(reward.score(["s"], images=[images], nouns=[["dog"]])[0])
    compare_runs("rovist_vg", runs)


@pytest.mark.slow
def test_cosmic_trains_at_each_precision(tmp_path, monkeypatch, raccoon_dir, tiny_bert):
    from test_cosmic import _train_config

    from storyrl.rewards import create_reward
    from storyrl.training.judges import cosmic

    runs = {}
    for precision in PRECISIONS:
        rec = Recorder(monkeypatch, cosmic)
        heads = []
        import storyrl.models.cosmic as models_cosmic

        real_head = models_cosmic.CosmicHead

        class Head(real_head):  # the head train_cosmic builds, kept to read its weights
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                heads.append((self, weights(self)))

        monkeypatch.setattr(models_cosmic, "CosmicHead", Head)  # train_cosmic imports it when it runs
        config = _train_config(raccoon_dir, tiny_bert, tmp_path / precision, epochs=1, batch_size=4,
                               mixed_precision=precision)
        cosmic.train_cosmic(config, progress=False)
        (head, before), = heads
        runs[precision] = (rec, before, weights(head))
        monkeypatch.setattr(models_cosmic, "CosmicHead", real_head)
        reward = create_reward("cosmic", model=str(tmp_path / precision / "best"), device="cpu", precision="fp32")
        assert reward is not None
    compare_runs("cosmic", runs)


@pytest.fixture(scope="module")
def tapm_data(tmp_path_factory):
    from storyrl.generators.tapm.features import FeatureExtractor, write_features

    root = tmp_path_factory.mktemp("tapm")
    paths = tiny_models.write_images(root / "img", n=5)
    ids = [[f"img{(k + j) % 5}" for j in range(3 + k % 2)] for k in range(6)]
    stories = tiny_models.write_tapm_stories(root / "stories.jsonl", ids)
    extractor = FeatureExtractor("test_resnet", pretrained=False, device="cpu")
    write_features(root / "features", [(p.stem, str(p)) for p in paths], extractor, batch_size=3)
    return {"root": root, "stories": stories, "features": str(root / "features"),
            "decoder": tiny_models.save_tiny_decoder(root / "gpt2")}


def tapm_model(data, seed=0):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.generators.tapm.features import FeatureStore
    from storyrl.generators.tapm.model import TapmModel

    tokenizer = AutoTokenizer.from_pretrained(data["decoder"])
    store = FeatureStore(data["features"])
    decoder = AutoModelForCausalLM.from_pretrained(data["decoder"])
    model = TapmModel.from_decoder(decoder, tokenizer, {t: s["dim"] for t, s in store.types.items()},
                                   {t: s["tokens"] for t, s in store.types.items()}, backbones=store.backbones,
                                   seed=seed, dropout=0.0)
    return model, tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["adaptation", "downstream"])
def test_tapm_trains_at_each_precision(tmp_path, monkeypatch, tapm_data, stage):
    from storyrl.training.storyteller import tapm
    from storyrl.training.storyteller.tapm import TapmTrainConfig

    runs = {}
    for precision in PRECISIONS:
        rec = Recorder(monkeypatch, tapm)
        model, tokenizer = tapm_model(tapm_data)
        before = weights(model)
        config = TapmTrainConfig(output_dir=str(tmp_path / precision), stories=[tapm_data["stories"]],
                                 features=tapm_data["features"], decoder=tapm_data["decoder"],
                                 adaptation_epochs=1 if stage == "adaptation" else 0, epochs=1, batch_size=1,
                                 lr=3e-3, val_fraction=0.3, dropout=0.0, mixed_precision=precision,
                                 max_steps=3 if stage == "adaptation" else None)
        tapm.train_tapm(config, progress=False, model=model, tokenizer=tokenizer)
        runs[precision] = (rec, before, weights(model))
    compare_runs(f"tapm {stage}", runs)
    if stage == "downstream":  # best/ of an fp16 run is a TAPM generator's model (fp32 weights, autocast's master)
        from storyrl.data import load_stories
        from storyrl.generators import create_generator
        from storyrl.generators.tapm.model import TapmModel

        best = tmp_path / "fp16" / "best"
        assert {p.dtype for p in TapmModel.from_pretrained(best).parameters()} == {torch.float32}
        records = load_stories(tapm_data["stories"])[:2]
        out = create_generator("tapm", model=str(best), features=tapm_data["features"], max_new_tokens=4,
                               precision="fp32").generate(records)
        # one step in, the tiny model may say nothing yet: it ran, and said so
        assert set(out.stories) | set(out.failures) == {r.story_id for r in records}
        assert all(f.startswith("ValueError: empty story") for f in out.failures.values())


# -- the TRL trainers: SFT, DPO, reward model ---------------------------------------------------
# ``precision`` is the weights' dtype and sets TRL's autocast: bf16 weights
# train under bf16 autocast; fp16 is for an fp16 base under fp32 LoRA
# adapters (fp16 autocast + GradScaler, on the CPU as on CUDA); fp16 full
# weights are refused when the config is read.

P1 = "Write a story using exactly {n} sentences for this image sequence. Do not use more than {n} sentences."
#: (precision, lora): what each run is compared with is the same LoRA setting at fp32.
TRL_RUNS = [("bf16", False), ("bf16", True), ("fp16", True)]
LORA = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def story_assets(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("storyteller")
    texts = [*tiny_models.TAPM_TEXTS, P1.format(n="three"), P1.format(n="four")]
    stories = [" ".join(tiny_models.TAPM_TEXTS[0:2]), " ".join(tiny_models.TAPM_TEXTS[2:4])]
    images = [str(p) for p in tiny_models.write_images(root / "images", 3)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": s, "images": images}) + "\n"
                            for k, s in enumerate(stories)), encoding="utf-8")
    pairs = root / "pairs.jsonl"
    rows = [{"prompt": P1.format(n="four"), "chosen": stories[0], "rejected": stories[1], "images": images,
             "story_id": "s0"},
            {"prompt": P1.format(n="four"), "chosen": tiny_models.TAPM_TEXTS[4], "rejected": stories[1],
             "images": images, "story_id": "s1"}]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"data": str(data), "pairs": str(pairs), "model": tiny_models.save_tiny_llama(root / "llama", texts),
            "plain": tiny_models.save_tiny_llama(root / "plain", texts, chat=False)}


class TrlRecorder:
    """``module.build_trainer`` wrapped: the output dtypes of the model's
    Linear layers while it trains (under autocast: the autocast dtype;
    without: the weights'), and the trainer, kept."""

    def __init__(self, monkeypatch, module) -> None:
        self.dtypes: set[torch.dtype] = set()
        self.trainer = None
        build = module.build_trainer

        def wrapped(config, progress=True, callbacks=None):
            out = build(config, progress, callbacks)
            self.trainer = out[0] if isinstance(out, tuple) else out
            for layer in self.trainer.model.modules():
                if isinstance(layer, torch.nn.Linear):
                    layer.register_forward_hook(self._hook)
            return out

        monkeypatch.setattr(module, "build_trainer", wrapped)

    def _hook(self, layer, inputs, output) -> None:
        if torch.is_grad_enabled():
            self.dtypes.add(output.dtype)


def first_log(history, key: str = "loss") -> float:
    return next(e[key] for e in history if key in e)


def check_trl_run(name, precision, lora, rec, result, reference, keys=("loss",)) -> None:
    """A TRL run at ``precision`` against fp32's (``reference``: its history)."""
    dtype = DTYPES[precision]
    assert rec.dtypes == {dtype}, (name, precision, rec.dtypes)
    assert rec.trainer.args.bf16 == (precision == "bf16") and rec.trainer.args.fp16 == (precision == "fp16")
    params = dict(rec.trainer.model.named_parameters())
    trainable = {k for k, p in params.items() if p.requires_grad}
    if lora:  # the base in the dtype, the adapters (what trains) in fp32
        assert {params[k].dtype for k in params if k not in trainable} == {dtype}
        assert {params[k].dtype for k in trainable} == {torch.float32}
    else:
        assert {p.dtype for p in params.values()} == {dtype}
    assert all(torch.isfinite(params[k]).all() for k in trainable)
    for key in keys:
        got, ref = first_log(result.history, key), first_log(reference, key)
        diff = abs(got - ref) / (eps(precision) * max(1.0, abs(ref)))
        print(f"{name}{' lora' if lora else ''} {precision}: first {key} {got:.6f} vs fp32 {ref:.6f}: {diff:.2f} eps")
        assert diff <= LOSS_EPS_FACTOR, (name, precision, lora, key, got, ref)


def trained_weights(final, lora) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    from pathlib import Path

    name = "adapter_model.safetensors" if lora else "model.safetensors"
    return load_file(Path(final) / name)


@pytest.mark.slow
def test_sft_trains_at_each_precision_and_bf16_final_is_a_dpo_model(story_assets, tmp_path, monkeypatch,
                                                                     trl_offline):
    from storyrl.training.storyteller import dpo, sft

    def options(out, **extra):
        return {"model": story_assets["model"], "data": story_assets["data"], "output_dir": str(out), "prompt": "P1",
                "max_steps": 2, "batch_size": 2, "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, **extra}

    reference = {lora: sft.train(sft.SFTRunConfig.from_mapping(
        options(tmp_path / f"fp32{lora}", precision="fp32", **({"lora": LORA} if lora else {}))), progress=False)
        for lora in (False, True)}
    initial = trained_weights(story_assets["model"], False)
    for precision, lora in TRL_RUNS:
        rec = TrlRecorder(monkeypatch, sft)
        out = tmp_path / f"{precision}{lora}"
        result = sft.train(sft.SFTRunConfig.from_mapping(
            options(out, precision=precision, **({"lora": LORA} if lora else {}))), progress=False)
        check_trl_run("sft", precision, lora, rec, result, reference[lora].history)
        saved = trained_weights(result.final_dir, lora)
        assert all(torch.isfinite(v).all() for v in saved.values())
        if lora:
            assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # B starts at zero
        else:
            assert saved["lm_head.weight"].dtype == DTYPES[precision]
            assert not torch.equal(saved["lm_head.weight"].float(), initial["lm_head.weight"].float())
    # SFT at bf16 -> DPO at bf16 (its final/ is the policy and the reference)
    chained = dpo.train(dpo.DPORunConfig.from_mapping(
        {**options(tmp_path / "dpo", precision="bf16", max_steps=1), "model": str(tmp_path / "bf16False" / "final"),
         "pairs": story_assets["pairs"]}), progress=False)
    assert chained.steps == 1 and math.isfinite(first_log(chained.history))


@pytest.mark.slow
def test_dpo_trains_at_each_precision(story_assets, tmp_path, monkeypatch, trl_offline):
    from storyrl.training.storyteller import dpo

    def config(out, precision, lora):
        return dpo.DPORunConfig.from_mapping(
            {"model": story_assets["model"], "data": story_assets["data"], "pairs": story_assets["pairs"],
             "output_dir": str(out), "prompt": "P1", "max_steps": 2, "batch_size": 2, "learning_rate": 1e-3,
             "logging_steps": 1, "seed": 0, "precision": precision, **({"lora": LORA} if lora else {})})

    reference = {lora: dpo.train(config(tmp_path / f"fp32{lora}", "fp32", lora), progress=False)
                 for lora in (False, True)}
    for precision, lora in TRL_RUNS:
        rec = TrlRecorder(monkeypatch, dpo)
        result = dpo.train(config(tmp_path / f"{precision}{lora}", precision, lora), progress=False)
        # the first loss is log 2 at any precision (policy = reference): the
        # policy's log-probabilities of the stories are what differ
        check_trl_run("dpo", precision, lora, rec, result, reference[lora].history,
                      keys=("loss", "logps/chosen", "logps/rejected"))
        assert all(math.isfinite(e["loss"]) for e in result.history if "loss" in e)
        assert result.steps == 2


@pytest.mark.slow
def test_reward_model_trains_at_each_precision(story_assets, tmp_path, monkeypatch, trl_offline):
    from storyrl.rewards import create_reward
    from storyrl.training.storyteller import reward_model

    def config(out, precision, lora):
        return reward_model.RewardModelRunConfig.from_mapping(
            {"model": story_assets["plain"], "pairs": story_assets["pairs"], "output_dir": str(out), "max_steps": 2,
             "batch_size": 2, "learning_rate": 5e-3, "logging_steps": 1, "seed": 0, "eval_fraction": 0.5,
             "max_length": 64, "precision": precision, **({"lora": LORA} if lora else {})})

    reference = {lora: reward_model.train(config(tmp_path / f"fp32{lora}", "fp32", lora), progress=False)
                 for lora in (False, True)}
    for precision, lora in TRL_RUNS:
        rec = TrlRecorder(monkeypatch, reward_model)
        result = reward_model.train(config(tmp_path / f"{precision}{lora}", precision, lora), progress=False)
        check_trl_run("reward_model", precision, lora, rec, result, reference[lora].history)
        assert result.heldout_pairs == 1 and result.heldout_accuracy in (0.0, 1.0)  # scored at the precision
        # final/ is the reward_model reward's model
        reward = create_reward("reward_model", model=result.final_dir, device="cpu", precision="fp32")
        assert all(math.isfinite(s) for s in reward.score(["the dog was good and happy ."]))


def test_fp16_full_weights_are_refused_when_the_config_is_read(story_assets, tmp_path):
    """fp16 weights without LoRA: one line naming the key, before any model loads."""
    from storyrl.config import ConfigError
    from storyrl.training.storyteller.dpo import DPORunConfig
    from storyrl.training.storyteller.reward_model import RewardModelRunConfig
    from storyrl.training.storyteller.sft import SFTRunConfig

    common = {"model": story_assets["model"], "output_dir": str(tmp_path / "o"), "precision": "fp16"}
    for cls, extra in [(SFTRunConfig, {"data": story_assets["data"]}),
                       (DPORunConfig, {"data": story_assets["data"], "pairs": story_assets["pairs"]}),
                       (RewardModelRunConfig, {"pairs": story_assets["pairs"], "model": story_assets["plain"]})]:
        with pytest.raises(ConfigError) as caught:
            cls.from_mapping({**common, **extra})
        message = str(caught.value)
        assert "\n" not in message and "precision: fp16 weights have no fp32 master copy" in message, message
        assert "lora.enabled: true" in message
        cls.from_mapping({**common, **extra, "lora": LORA})  # with adapters it is a config


@pytest.mark.slow
def test_cosmic_encoder_precision_changes_the_embeddings_within_eps(tmp_path, monkeypatch, raccoon_dir, tiny_bert):
    """COSMiC's ``precision`` is the frozen encoders' dtype: at fp16/bf16 the
    embeddings the head trains on are those of fp32 encoders within the
    dtype's rounding (so is the first loss), and really rounded (not fp32)."""
    from test_cosmic import _train_config

    from storyrl.models.runtime import release_models
    from storyrl.training.judges import cosmic

    runs, tables = {}, {}
    real_collate = cosmic._Collate
    for precision in ("fp32", "fp16", "bf16"):
        release_models()
        rec = Recorder(monkeypatch, cosmic)
        class Collate(real_collate):  # the embedding tables train_cosmic made, kept
            def __init__(self, image_emb, text_emb):
                super().__init__(image_emb, text_emb)
                tables[precision] = (torch.as_tensor(image_emb), torch.as_tensor(text_emb))

        monkeypatch.setattr(cosmic, "_Collate", Collate)
        config = _train_config(raccoon_dir, tiny_bert, tmp_path / precision, epochs=1, batch_size=4,
                               precision=precision)
        cosmic.train_cosmic(config, progress=False)
        runs[precision] = rec.losses
        monkeypatch.undo()
    for precision in DTYPES:
        for k, name in enumerate(("image", "text")):
            got, ref = tables[precision][k].float(), tables["fp32"][k].float()
            diff = (got - ref).abs().max().item() / (eps(precision) * max(1.0, ref.abs().max().item()))
            print(f"cosmic encoders {precision}: {name} embeddings {diff:.2f} eps")
            assert not torch.equal(got, ref)  # the encoders really ran in the dtype
            assert diff <= LOSS_EPS_FACTOR, (precision, name, diff)
        diff = abs(runs[precision][0] - runs["fp32"][0]) / (eps(precision) * max(1.0, abs(runs["fp32"][0])))
        print(f"cosmic encoders {precision}: first loss {diff:.2f} eps")
        assert diff <= LOSS_EPS_FACTOR


VLM_TEMPLATE = (  # LLaVA 1.5's, with an assistant turn (as test_sft.py)
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% else %} ASSISTANT: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}[EOS]{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_vlm_policy_trains_at_each_precision(story_assets, tmp_path, monkeypatch, trl_offline, trainer):
    """A LLaVA policy (its images through the vision tower) at bf16 and fp16 +
    LoRA against fp32: the TRL collator's fp32 pixels run in the dtype."""
    from transformers import AutoProcessor

    from storyrl.training.storyteller import dpo, sft

    texts = [*tiny_models.TAPM_TEXTS, P1.format(n="three"), P1.format(n="four"), "USER: ASSISTANT:"]
    vlm = tiny_models.save_tiny_vlm(tmp_path / "llava", "llava", texts)
    processor = AutoProcessor.from_pretrained(vlm)
    processor.chat_template = VLM_TEMPLATE
    processor.save_pretrained(vlm)
    module = sft if trainer == "sft" else dpo

    def run(out, precision, lora):
        options = {"model": vlm, "data": story_assets["data"], "output_dir": str(out), "prompt": "P1",
                   "max_steps": 1, "batch_size": 2, "learning_rate": 1e-3, "logging_steps": 1, "seed": 0,
                   "precision": precision, "max_length": 256, **({"lora": LORA} if lora else {})}
        if trainer == "sft":
            return sft.train(sft.SFTRunConfig.from_mapping(options), progress=False)
        return dpo.train(dpo.DPORunConfig.from_mapping({**options, "pairs": story_assets["pairs"]}), progress=False)

    reference = {lora: run(tmp_path / f"fp32{lora}", "fp32", lora) for lora in (False, True)}
    keys = ("loss",) if trainer == "sft" else ("logps/chosen", "logps/rejected")
    for precision, lora in TRL_RUNS:
        rec = TrlRecorder(monkeypatch, module)
        result = run(tmp_path / f"{precision}{lora}", precision, lora)
        check_trl_run(f"{trainer} vlm", precision, lora, rec, result, reference[lora].history, keys=keys)


@pytest.mark.slow
def test_sft_fp16_lora_resume_restores_the_grad_scaler(story_assets, tmp_path, monkeypatch, trl_offline):
    """An fp16 + LoRA SFT run killed after checkpoint-2 and resumed equals the
    uninterrupted run: the CPU GradScaler's scale is saved with the
    checkpoint and restored (a fresh scale would skip or rescale steps)."""
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from storyrl.training.storyteller import sft

    def config(out):
        return sft.SFTRunConfig.from_mapping(
            {"model": story_assets["model"], "data": story_assets["data"], "output_dir": str(out), "prompt": "P1",
             "max_steps": 4, "save_steps": 1, "batch_size": 1, "learning_rate": 1e-3, "logging_steps": 1, "seed": 0,
             "precision": "fp16", "lora": LORA})

    whole = sft.train(config(tmp_path / "whole"), progress=False)

    class Kill(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise KeyboardInterrupt("killed after checkpoint-2")

    build = sft.build_trainer
    monkeypatch.setattr(sft, "build_trainer", lambda c, p=True, callbacks=None: build(c, p, [Kill()]))
    with pytest.raises(KeyboardInterrupt):
        sft.train(config(tmp_path / "cut"), progress=False)
    assert (tmp_path / "cut" / "checkpoint-2" / "scaler.pt").is_file()
    monkeypatch.setattr(sft, "build_trainer", build)
    resumed = sft.train(config(tmp_path / "cut"), resume=True, progress=False)
    losses = [[(e["step"], e["loss"]) for e in r.history if "loss" in e] for r in (whole, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    a = load_file(Path(whole.final_dir) / "adapter_model.safetensors")
    b = load_file(Path(resumed.final_dir) / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cpu_fp16_scaler_is_on_and_skips_an_overflowing_step():
    """The CPU GradScaler really scales: a CUDA one made on a CPU machine
    switches itself off with a warning, and fp16 would then train with no
    loss scaling and no skipped steps. A step whose gradients overflow is
    skipped (weights kept) and the scale halves; a finite step trains."""
    from storyrl.training.accelerators import make_accelerator

    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    accelerator = make_accelerator("fp16")
    assert accelerator.scaler.is_enabled()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(3, 4)
    before = [p.detach().clone() for p in model.parameters()]
    scale = accelerator.scaler.get_scale()
    with accelerator.autocast():
        loss = model(x).float().sum() * float("inf")
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # skipped
    assert accelerator.scaler.get_scale() == scale / 2
    with accelerator.autocast():
        loss = model(x).float().pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_every_judge_trainer_takes_every_mixed_precision():
    """Every accelerate trainer's config takes each mixed_precision value,
    auto included (the help of TrainConfig's option promises it)."""
    import dataclasses
    import importlib

    from storyrl.training.accelerators import MIXED_PRECISIONS
    from storyrl.training.config import TrainConfig

    checked = []
    for name in ("judges.coherence", "judges.vrank", "judges.cosmic", "judges.rovist_vg", "storyteller.tapm"):
        module = importlib.import_module(f"storyrl.training.{name}")
        configs = [c for c in vars(module).values()
                   if isinstance(c, type) and issubclass(c, TrainConfig) and c.__module__ == module.__name__]
        assert configs, name
        for cls in configs:
            field = {f.name: f for f in dataclasses.fields(cls)}["mixed_precision"]
            assert field.metadata["choices"] == MIXED_PRECISIONS, cls.__name__
            checked.append(cls.__name__)
    assert len(checked) >= 5
