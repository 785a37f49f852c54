"""The parts of benchmarks/gpu_suite.py that train: rl (PPO and GRPO steps,
and RLOO's at full size, through benchmarks/rl_step.py's runners, each next
to plain ``generate`` on the same model, merged and unmerged LoRA) and
deepspeed (``storyrl launch`` with the shipped ZeRO-2 config, in a
subprocess)."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from gpu_suite_arch import LLAMA2_7B
from gpu_suite_parts import synthetic_stories, write_sequence_images
from gpu_suite_report import (
    QUICK_RL_STEPS,
    QUICK_RL_TOKENS,
    Context,
    Section,
    Skip,
    _have,
    _one_line,
    free_memory,
    need,
    row,
    weights_dtype,
)

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"

# -- part: rl -----------------------------------------------------------------------------------

MISTRAL_CHAT_TEMPLATE = (
    "{% for m in messages %}[INST] {% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %} [/INST]{% endfor %}"
)


def readme_estimates() -> dict[str, str]:
    """The 7B memory estimates of benchmarks/README.md's table (last column),
    by model: ``llava`` (LLaVA-NeXT-7B fp16 inference) and ``llama`` (LLaMA-2-7B
    4-bit + LoRA, TAPM training at batch 2)."""
    found = {}
    readme = BENCH / "README.md"
    if not readme.is_file():
        return found
    for line in readme.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or "GiB" not in cells[-1]:
            continue
        if cells[0].startswith("LLaVA-NeXT-7B") and "llava" not in found:
            found["llava"] = cells[-1]
        elif "LLaMA-2-7B" in cells[0] and "4-bit" in cells[0] and "llama" not in found:
            found["llama"] = cells[-1]
    return found


@contextmanager
def rl_options(extra: dict):
    """Let benchmarks/rl_step.py's ``rl_config`` build RLConfigs with
    ``extra`` keys too (policy kind, LoRA, 4-bit; ``ppo``/``grpo`` keys merged),
    without changing rl_step.py."""
    from storyrl.training.storyteller.rl.config import RLConfig

    raw = vars(RLConfig).get("from_mapping")  # None: inherited
    original = RLConfig.from_mapping

    def from_mapping(cls, mapping, *a, **kw):
        if cls is RLConfig:
            mapping = dict(mapping)
            for key, value in extra.items():
                if isinstance(value, dict) and isinstance(mapping.get(key), dict):
                    mapping[key] = {**mapping[key], **value}
                elif isinstance(value, dict) and key in ("ppo", "grpo", "rloo") and key not in mapping:
                    continue  # the other algorithm's keys
                else:
                    mapping[key] = value
        return original.__func__(cls, mapping, *a, **kw)

    RLConfig.from_mapping = classmethod(from_mapping)
    try:
        yield
    finally:
        if raw is not None:
            RLConfig.from_mapping = raw
        else:
            del RLConfig.from_mapping


LLAMA2_VOCAB = 32000


def llama_tokenizer(texts: list[str]):
    """The tests' word-level chat tokenizer over ``texts``, filled up to
    LLaMA-2's 32,000 entries (generate.py's ``sized_tokenizer``)."""
    import generate as gen
    from tiny_models import chat_tokenizer

    return gen.sized_tokenizer(chat_tokenizer(texts), LLAMA2_VOCAB)


def _build_llama_7b(directory: Path, texts: list[str], device: str) -> str:
    """LLaMA-2-7B's architecture, random fp16 weights made on the GPU, with a
    word-level chat tokenizer padded with filler words to 32,000 entries."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = llama_tokenizer(texts)
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **LLAMA2_7B)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    free_memory()
    return str(directory)


def _build_llava(directory: Path, texts: list[str], ctx: Context) -> str:
    """The tiny chat VLM, or the run's shared 7B LLaVA-NeXT (gpu_suite_parts'
    ``llava_7b``) seen through ``directory``: its weights linked, not copied
    (~15 GB), and its processor saved there with a chat template (TRL renders
    the prompts with it; the generate part's copy stays without one)."""
    from gpu_suite_parts import llava_7b
    from tiny_models import LLAVA_CHAT_TEMPLATE, save_tiny_chat_vlm
    from transformers import AutoProcessor

    if ctx.tiny:
        return save_tiny_chat_vlm(directory, texts)
    shared = Path(llava_7b(ctx))
    processor = AutoProcessor.from_pretrained(shared)
    processor.chat_template = MISTRAL_CHAT_TEMPLATE if "[INST]" in processor.tokenizer.get_vocab() \
        else LLAVA_CHAT_TEMPLATE
    own = directory.parent / f"{directory.name}_processor"
    processor.save_pretrained(own)  # saved apart: written through a link it would change the shared copy
    directory.mkdir(parents=True)
    for path in shared.iterdir():
        if not (own / path.name).exists():
            (directory / path.name).symlink_to(path.resolve())
    for path in own.iterdir():
        path.rename(directory / path.name)
    own.rmdir()
    free_memory()
    return str(directory)


def noun_phrase_extractor(rl_step, tiny: bool) -> tuple[str, str]:
    """(rl_step.py's ``--noun-phrases`` choice, why): spaCy's pipeline when
    spaCy is installed, else the regular expression; ``--tiny`` always the
    regex (setting up a spaCy pipeline costs seconds on a shrunk run)."""
    choices = getattr(rl_step, "NP_EXTRACTORS", {})
    if "regex" not in choices:
        return "", "rl_step.py's own default (it has no regex extractor)"
    if tiny:
        return "regex", "--tiny: the cheap regular expression"
    spacy_choice = next((c for c in choices if c.startswith("spacy")), None)
    if spacy_choice and _have("spacy"):
        return spacy_choice, "spaCy is installed"
    return "regex", "spaCy is not installed: regular-expression noun phrases"


def part_rl(ctx: Context, section: Section) -> None:
    try:
        rl_step = importlib.import_module("rl_step")
        runners = {"ppo": rl_step.run_ppo, "grpo": rl_step.run_grpo}
        if hasattr(rl_step, "run_rloo"):
            runners["rloo"] = rl_step.run_rloo
        build_assets, summarise, peak = rl_step.build_assets, rl_step.summarise, rl_step._peak_mib
    except (ImportError, AttributeError) as exc:
        raise Skip(f"benchmarks/rl_step.py's runners are not importable ({_one_line(exc)})") from None
    with _hidden_gpus(ctx.device == "cpu"):  # accelerate (PPO) would take a visible GPU
        _part_rl(ctx, section, rl_step, runners, build_assets, summarise, peak)


@contextmanager
def recorded_policy_dtypes(found: list):
    """Append the weights dtype of every policy storyrl's ``load_policy``
    loads meanwhile to ``found`` (rl_step.py imports it at call time)."""
    import storyrl.training.storyteller.rl.policy as policy_module

    original = policy_module.load_policy

    def load_policy(*a, **kw):
        policy = original(*a, **kw)
        found.append(weights_dtype(policy.model))
        return policy

    policy_module.load_policy = load_policy
    try:
        yield
    finally:
        policy_module.load_policy = original


@contextmanager
def _hidden_gpus(hide: bool):
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _with_precision(spec, precision: str):
    """A reward spec (a name or a mapping, composites nested under
    ``rewards``) with ``precision`` on every model-backed reward in it."""
    if not isinstance(spec, dict):
        return spec  # a name: bleu and the like, model-free
    out = dict(spec)
    if "rewards" in out:
        out["rewards"] = {k: _with_precision(v, precision) for k, v in out["rewards"].items()}
    else:
        out["precision"] = precision
    return out


def _rl_row(model: str, algorithm: str, result, run_s: float, summarise, peak_mib, estimate,
            policy_dtype: str | None = None) -> dict:
    """A report row from one of rl_step.py's runners' results: (steps, reward
    calls[, seconds preparing the rewards[, plain generate next to the
    generation phase (rl_generate.summary)]])."""
    s = summarise(algorithm, result[0], result[1], peak_mib)
    share = s["share"]
    peak_mib = s.get("peak_cuda_mib")
    return {"model": model, "algorithm": algorithm.upper(), "policy weights": policy_dtype,
            "step (s)": s["mean_s"]["step"],
            **{phase: f"{100 * share[phase]:.0f} %" for phase in ("generation", "forward", "reward", "optimisation")},
            **_generate_columns(result[3] if len(result) > 3 else None),
            "run (s)": run_s, "rewards prepared (s)": result[2] if len(result) > 2 else None,
            "peak GiB": None if peak_mib is None else peak_mib / 1024,
            "README estimate": estimate or "not found in benchmarks/README.md"}


def _generate_columns(g: dict | None) -> dict:
    """The generation phase next to plain generate on the same model, batch,
    prompts and decoding steps (ms per generated token; ratios paired per
    timed step, rl_generate.summary)."""
    g = g if g and "error" not in g else {}
    ms = g.get("ms_per_token", {})
    merged = "merged" if "merged" in ms else "plain"
    return {"RL generation (ms/token)": ms.get("generation"),
            "plain generate, LoRA unmerged (ms/token)": ms.get("unmerged"),
            "plain generate, merged (ms/token)": ms.get(merged) if merged in ms else None,
            "generation / generate": g.get("generation_over_generate"),
            "target <= 1.25": None if not g else ("PASS" if g["generation_over_generate"] <= 1.25 else "FAIL")}


def _part_rl(ctx: Context, section: Section, rl_step, runners, build_assets, summarise, peak) -> None:
    if not ctx.tiny:
        ctx.need_cuda("the 7B policies")  # before building anything
    steps, warmup = ctx.pick((1, 0), (QUICK_RL_STEPS - 1, 1), (2, 1))
    batch, generations = (4, 2) if ctx.tiny else (8, 4)
    noun_phrases, np_why = noun_phrase_extractor(rl_step, ctx.tiny)
    # rl_step's own parser: its defaults for whatever options it has grown
    tokens = ctx.pick(16, QUICK_RL_TOKENS, 64)
    args = rl_step.parse_args(["--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch),
                               "--generations", str(generations), "--max-new-tokens", str(tokens),
                               "--generate-repeats", "1",
                               "--ppo-epochs", str(ctx.pick(1, 1, 4)), "--sft-steps", "20" if ctx.tiny else "1",
                               "--device", ctx.device, "--reward", "dhm",
                               *(["--noun-phrases", noun_phrases] if noun_phrases else [])])
    # rewards prepared before training (the image side embedded once) where rl_step.py can do it
    prepare = {"prepare": True} if "prepare" in inspect.signature(runners["ppo"]).parameters else {}
    tmp = ctx.root / "rl"
    t0 = time.perf_counter()
    assets = build_assets(tmp, args)
    if ctx.precision != "auto":  # the dhm reward's models in --precision too
        assets = {**assets, "rewards": {**assets["rewards"], "dhm": [_with_precision(r, ctx.precision)
                                                                     for r in assets["rewards"]["dhm"]]}}
    vocabulary = " ".join([*rl_step.DETS, *rl_step.ADJS, *rl_step.NOUNS, *rl_step.VERBS, *rl_step.INTRANSITIVE,
                           *rl_step.PREPS, "we it was day then . [INST] [/INST]"])
    prompt = rl_step._prompt_text(rl_step.IMAGES_PER_SEQUENCE)
    section.note(f"noun phrases (the dhm reward's GROOViST): {getattr(args, 'noun_phrases', 'regex')} ({np_why})")
    explicit = ctx.precision != "auto"
    section.note(f"precision: {ctx.precision if explicit else 'storyrl auto'} for the policy, "
                 f"{ctx.precision if explicit else 'their own auto'} for the dhm reward's models")
    section.note(f"data and reward models (the dhm reward's tiny CLIP and ALBERT of rl_step.py) built in "
                 f"{time.perf_counter() - t0:.1f} s; "
                 f"{'the LLaMA policy: rl_step.py tiny one, fitted to write sentences; ' if ctx.tiny else ''}"
                 f"{batch} stories per step, "
                 f"{warmup} warm-up + {steps} timed step(s), {args.max_new_tokens} new tokens, "
                 f"PPO {args.ppo_epochs} epoch(s) per rollout")
    estimates = readme_estimates()
    gc_on = not ctx.tiny  # 7B with LoRA: activations recomputed, as the shipped configs do
    models = [
        ("LLaVA-NeXT-7B + LoRA", "llava", {"policy": "vlm", "setting": "visual", "freeze_vision_tower": True,
                                           "lora": {"enabled": True, "r": 16, "alpha": 32}}),
        ("LLaMA-2-7B 4-bit + LoRA", "llama", {"policy": "causal_lm", "setting": "text", "load_in_4bit": True,
                                              "lora": {"enabled": True, "r": 16, "alpha": 32}}),
    ]
    # --quick: PPO and GRPO (its plan has no time for a third 7B run); RLOO samples through the same TRL code
    algorithms = [a for a in (("ppo", "grpo") if ctx.quick or ctx.tiny else ("ppo", "grpo", "rloo"))
                  if a in runners]
    rows = []
    for label, key, extra in models:
        with row(section, label):
            if not ctx.tiny:
                ctx.need_cuda(f"the 7B {label} policy")
            ctx.check(f"rl {key}", 420, 40, f"rl {label}")  # 7B: build, save, PPO, GRPO (RLOO), the replays
            if extra.get("load_in_4bit"):
                if not ctx.cuda:
                    extra = {k: v for k, v in extra.items() if k != "load_in_4bit"}
                    section.skip(f"{label}, its 4-bit base", "no CUDA device (bitsandbytes needs one); ran LoRA on the "
                                 "full-precision base instead")
                    label = label.replace(" 4-bit", "")
                else:
                    need("bitsandbytes", "4-bit loading: pip install 'storyrl[quant]'")
            if key == "llava":
                policy = _build_llava(tmp / "llava", [prompt, vocabulary, *synthetic_stories(4)], ctx)
            elif ctx.tiny:
                policy = assets["policy"]  # rl_step's tiny LLaMA, fitted to write sentences
            else:
                policy = _build_llama_7b(tmp / "llama", [prompt, vocabulary], ctx.device)
            extra = {**extra, "ppo": {"gradient_checkpointing": gc_on},
                     "grpo": {"gradient_checkpointing": gc_on}, "rloo": {"gradient_checkpointing": gc_on},
                     **({"precision": ctx.precision} if ctx.precision != "auto" else {}),
                     # A random 7B writes soup dhm cannot score; PPO counts a story only when every
                     # weighted reward scores it, so dhm is computed and timed at weight 0 and bleu trains.
                     **({} if ctx.tiny else {"reward_weights": [0.0, 1.0]})}
            for algorithm in algorithms:
                free_memory()
                with row(section, f"{label}, {algorithm.upper()}"):  # an OOM in PPO still lets GRPO run
                    ctx.check(f"rl {key} run", 150, 15, f"rl {label} {algorithm}")
                    dtypes: list = []
                    with rl_options(extra), recorded_policy_dtypes(dtypes):
                        t1 = time.perf_counter()
                        run_assets = {**assets, "policy": policy,
                                      "rewards": {"dhm": [*assets["rewards"]["dhm"], "bleu"]}}
                        result = runners[algorithm](run_assets, args, "dhm", tmp / f"{key}_{algorithm}", **prepare)
                        run_s = time.perf_counter() - t1
                    rows.append(_rl_row(label + (" (tiny)" if ctx.tiny else ""), algorithm, result, run_s,
                                        summarise, peak(ctx.device), estimates.get(key),
                                        policy_dtype=", ".join(dict.fromkeys(d or "?" for d in dtypes)) or None))
            if not ctx.tiny and key == "llama":
                shutil.rmtree(Path(policy), ignore_errors=True)  # ~13.5 GB of disk (LLaVA's is shared)
    section.table(rows)
    section.note("generation / generate: the RL step's generation phase (tokenising, generate, decoding; LoRA "
                 "merged for sampling, storyrl's default) over plain model.generate on the same model, right after "
                 "each timed step, with the step's prompts, batch, sampling settings and decoding steps, KV cache "
                 "on, eval mode (benchmarks/rl_generate.py); the reference is the merged model (a 4-bit base: "
                 "merged into NF4 by peft after the run), median over timed steps of the paired ratio, target "
                 f"<= 1.25. {args.max_new_tokens} new tokens per story; one replay per variant and step.")
    section.note("rewards prepared: the image side of the data set embedded (and the human stories scored) "
                 "before training by RLConfig prepare_rewards, untimed in the steps (— where rl_step.py cannot).")
    section.note("time split: rl_step.py's phases (generation, no-grad forwards, the dhm reward, the rest = "
                 "optimisation) as shares of the mean timed step; peak = torch.cuda.max_memory_allocated over the "
                 "run. README estimate: benchmarks/README.md's table of 7B memory estimates, its LLaVA-NeXT-7B fp16 "
                 "inference row and its LLaMA-2-7B 4-bit + LoRA (TAPM training, batch 2) row: not for RL: they are a floor to compare with, not the same workload. The 7B policies are "
                 "random (not fitted), so their stories are word soup that `dhm` cannot score: `bleu` (model-free, "
                 "against the human story) is added next to `dhm`, and at full size `dhm` has weight 0 (computed, "
                 "logged and timed; `bleu` trains), because PPO scores a story only when every reward with a "
                 "non-zero weight scores it (GRPO sums those that did); its cost counts in the reward share, and "
                 "`dhm` does less work on one-sentence soup (no coherence pairs) than on a trained policy's stories.")


# -- part: deepspeed ----------------------------------------------------------------------------


def launch_rl_steps(tmp: Path, launch_options: list[str], steps: int = 3, timeout: float = 600):
    """``storyrl launch OPTIONS -- storyrl train rl`` in a subprocess: ``steps``
    PPO steps of a tiny LLaMA on 8 synthetic sequences, scored by ``bleu``.
    Returns (exit status, last lines of its output, seconds, history rows)."""
    import yaml
    from tiny_models import save_tiny_llama

    paths = write_sequence_images(tmp / "images", 8, (64, 48))
    stories = synthetic_stories(8)
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": s, "images": p}) + "\n"
                            for k, (s, p) in enumerate(zip(stories, paths))))
    policy = save_tiny_llama(tmp / "policy", [*stories, "write a story of five sentences ."])
    config = {"algorithm": "ppo", "output_dir": str(tmp / "run"), "model": policy, "data": str(data),
              "setting": "text", "rewards": ["bleu"], "max_steps": steps, "report_to": "none",
              "ppo": {"per_device_train_batch_size": 4, "response_length": 16, "num_ppo_epochs": 1,
                      "save_steps": None, "logging_steps": 1}}
    (tmp / "rl.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "storyrl", "launch", *launch_options,
               "--", "storyrl", "train", "rl", "--config", str(tmp / "rl.yaml")]
    t0 = time.perf_counter()
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - t0
    history = tmp / "run" / "history.jsonl"
    logged = [json.loads(x) for x in history.read_text().splitlines() if x.strip()] if history.is_file() else []
    tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])[-400:]
    return done.returncode, tail, seconds, logged


def part_deepspeed(ctx: Context, section: Section) -> None:
    need("deepspeed", "pip install deepspeed")
    ctx.need_cuda("DeepSpeed ZeRO-2")
    ctx.check("deepspeed", 180, 1, "deepspeed")
    zero2 = REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml"
    try:
        status, tail, seconds, logged = launch_rl_steps(
            ctx.root / "deepspeed", ["--config_file", str(zero2), "--num_processes", "1"],
            timeout=max(ctx.budget.left(), 1))  # the budget's end, not past it
    except subprocess.TimeoutExpired:
        raise Skip("time budget: storyrl launch did not finish in the time left") from None
    if status != 0:
        raise RuntimeError(f"storyrl launch exited {status}: {tail}")
    step_s = [h["time/step"] for h in logged if "time/step" in h]
    section.table([{"config": "configs/accelerate/deepspeed_zero2.yaml (--num_processes 1)",
                    "policy": "tiny LLaMA (hidden 32, 2 layers)", "reward": "bleu", "steps logged": len(logged),
                    "mean step (s)": sum(step_s) / len(step_s) if step_s else None, "run incl. start (s)": seconds}])
    section.note("`storyrl launch ... -- storyrl train rl` in a subprocess: checks that ZeRO-2 through the shipped "
                 "accelerate config trains end to end on one GPU, not its speed.")
