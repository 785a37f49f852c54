"""storyrl doctor: pieces derived from rewards and configs, found by cache and
file lookups (a fake Hugging Face cache, a fake asset cache, a monkeypatched
spaCy check, no CUDA and no bitsandbytes), exit codes, --json, and --fetch
with fake downloaders. The GPU lines: tests/test_doctor_gpu.py."""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest
from click.testing import CliRunner

from storyrl import doctor as lib
from storyrl.cli.doctor import doctor
from storyrl.models import hub

CLIP = "timm/vit_base_patch32_clip_224.openai"  # open_clip's hub repo of ViT-B-32 / openai


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Offline, empty caches, no spaCy pipeline, no GPU; no socket may open."""
    cache = tmp_path / "hf"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("STORYRL_CACHE", str(tmp_path / "assets"))
    monkeypatch.chdir(tmp_path)
    installed: set[str] = set()

    def require_pipeline(name):
        from storyrl.noun_phrases import PipelineNotInstalled

        if name not in installed:
            raise PipelineNotInstalled(f"spaCy pipeline {name!r} is not installed; install it with: x")

    monkeypatch.setattr("storyrl.noun_phrases.require_pipeline", require_pipeline)
    monkeypatch.setattr("storyrl.doctor.checks._installed",
                        lambda module: f"/site/{module}" if module in installed else None)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed, whatever this machine has

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access: {args}")

    monkeypatch.setattr(socket, "create_connection", no_network)
    hub._reset()
    yield {"cache": cache, "spacy": installed, "tmp": tmp_path}
    hub._reset()


def cache_model(cache, repo_id: str) -> None:
    """The hub cache layout huggingface_hub writes."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    (folder / "snapshots" / "abc123").mkdir(parents=True)
    (folder / "snapshots" / "abc123" / "config.json").write_text("{}")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("abc123")


def write_assets(tmp_path) -> None:
    (tmp_path / "assets").mkdir(exist_ok=True)
    (tmp_path / "assets" / "concreteness_ratings.csv").write_text("Word;Conc.M\ndog;4.9\n")
    (tmp_path / "assets" / "all_pronouns.txt").write_text("it\n")


def run(*args: str):
    result = CliRunner().invoke(doctor, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def pieces(*args: str) -> tuple[int, dict[tuple[str, str], dict]]:
    result = run("--json", *args)
    data = json.loads(result.output)
    assert data["ok"] == (result.exit_code == 0)
    return result.exit_code, {(p["kind"], p["target"]): p for p in data["pieces"]}


def test_model_free_reward_needs_nothing(env):
    result = run("-m", "repetition")
    assert result.exit_code == 0
    # the GPU lines, then the verdict; a CPU build is fine when nothing needs a GPU
    assert result.output.splitlines()[0].startswith("OK        torch ")
    assert result.output.splitlines()[-1] == "nothing to check: no model, pipeline, word list or file is needed"
    assert pieces("-m", "repetition,bleu") == (0, {})


def test_groovist_needs_clip_spacy_and_assets(env):
    code, found = pieces("-m", "groovist")
    assert code == 1
    required = {k for k, p in found.items() if p["required"]}
    assert required == {("hub", CLIP), ("spacy", "en_core_web_trf"), ("asset", "concreteness_ratings.csv"),
                        ("asset", "all_pronouns.txt")}
    assert not found[("torch", "cuda")]["required"]  # GROOViST runs on the CPU too
    assert found[("hub", CLIP)]["get"] == f"hf download {CLIP}"
    assert found[("spacy", "en_core_web_trf")]["get"] == "python -m spacy download en_core_web_trf"
    assert found[("asset", "all_pronouns.txt")]["get"] == "storyrl assets"
    assert all(p["needed_by"] == ["groovist"] for p in found.values())

    # Each piece turns present on its own; the exit code follows the required ones only.
    cache_model(env["cache"], CLIP)
    write_assets(env["tmp"])
    env["spacy"].add("en_core_web_trf")
    code, found = pieces("-m", "groovist")
    assert code == 0, found
    assert found[("hub", CLIP)]["where"].endswith(f"models--{CLIP.replace('/', '--')}")
    assert found[("asset", "all_pronouns.txt")]["where"] == str(env["tmp"] / "assets" / "all_pronouns.txt")
    assert found[("spacy", "en_core_web_trf")]["where"] == "/site/en_core_web_trf"
    assert not found[("torch", "cuda")]["present"]  # optional: it did not fail the run


def test_options_change_the_pieces(env, tmp_path):
    config = tmp_path / "g.yaml"
    config.write_text("reward: groovist\nspacy_pipeline: en_core_web_sm\nweighting: none\n"
                      "clip_pretrained: null\npronouns: my_pronouns.txt\n")
    _, found = pieces("--config", str(config))
    keys = {k for k, p in found.items() if p["required"]}
    # no CLIP download (random weights), no concreteness list (no weighting), the
    # pronoun file where the config says, and the pipeline it names
    assert keys == {("spacy", "en_core_web_sm"), ("path", "my_pronouns.txt")}
    assert found[("path", "my_pronouns.txt")]["needed_by"] == ["g.yaml:groovist"]


def test_spacy_trf_missing_mentions_installed_sm(env):
    env["spacy"].add("en_core_web_sm")
    _, found = pieces("-m", "groovist")
    assert "en_core_web_sm is installed" in found[("spacy", "en_core_web_trf")]["where"]
    assert not found[("spacy", "en_core_web_trf")]["present"]


def test_coherence_local_model_directory(env, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("reward: coherence\nmodel: runs/coh\n")
    code, found = pieces("--config", str(config))
    assert code == 1
    model = found[("path", "runs/coh")]
    assert model["required"] and not model["present"]
    assert model["get"] == "storyrl train coherence --config configs/training/coherence.yaml"
    assert found[("hub", "albert-large-v1")]["required"]  # the tokenizer must come from somewhere
    assert not found[("path", "(authors' RoViST-C checkpoint)")]["required"]

    # A trained directory with its tokenizer needs nothing from the hub.
    (tmp_path / "runs" / "coh").mkdir(parents=True)
    (tmp_path / "runs" / "coh" / "tokenizer_config.json").write_text("{}")
    code, found = pieces("--config", str(config))
    assert code == 0
    assert ("hub", "albert-large-v1") not in found
    assert found[("path", "runs/coh")]["where"] == str((tmp_path / "runs" / "coh").resolve())

    # The authors' checkpoint (a file) needs base_model and trust_checkpoint.
    (tmp_path / "rovist_c.pt").write_bytes(b"x")
    config.write_text("reward: coherence\nmodel: rovist_c.pt\n")
    code, found = pieces("--config", str(config))
    assert code == 1
    assert not found[("path", "(trust_checkpoint for rovist_c.pt)")]["present"]
    assert found[("hub", "albert-large-v1")]["required"]
    config.write_text("reward: coherence\nmodel: rovist_c.pt\ntrust_checkpoint: true\nbase_model: my/albert\n")
    cache_model(env["cache"], "my/albert")
    assert pieces("--config", str(config))[0] == 0


def test_unset_model_is_missing(env):
    code, found = pieces("-m", "coherence")
    assert code == 1
    assert found[("path", "(coherence.model not set)")]["where"] == "not configured"


def test_dhm_config_walks_its_components(env):
    from conftest import REPO

    code, found = pieces("--config", str(REPO / "configs" / "rewards" / "dhm.yaml"))
    assert code == 1
    required = {k for k, p in found.items() if p["required"]}
    # the file's grounding uses en_core_web_sm; its coherence model is a local directory
    assert ("spacy", "en_core_web_sm") in required and ("spacy", "en_core_web_trf") not in found
    assert ("path", "runs/coherence/best") in required
    assert found[("hub", CLIP)]["needed_by"] == ["dhm.yaml:dhm/groovist"]
    # dimensions: [coherence, repetition] drops the grounding pieces
    code, found = pieces("--config", str(REPO / "configs" / "rewards" / "dhm_no_grounding.yaml"))
    assert not any(k[0] in ("spacy", "asset") or k == ("hub", CLIP) for k in found)


def test_rl_and_sweep_configs(env, tmp_path):
    (tmp_path / "r.yaml").write_text("reward: repetition\n")
    rl = tmp_path / "rl.yaml"
    rl.write_text("algorithm: grpo\noutput_dir: out\ndata: vist/train.json\nmodel: org/policy\n"
                  "rewards: [r.yaml, groovist]\nload_in_4bit: true\n")
    code, found = pieces("--config", str(rl))
    assert code == 1
    assert found[("torch", "cuda")]["required"]  # training a policy: GPU required
    assert found[("hub", "org/policy")]["required"]
    assert found[("path", "vist/train.json")]["get"] == lib.VIST_URL
    assert ("package", "bitsandbytes") in found
    assert found[("spacy", "en_core_web_trf")]["needed_by"] == ["rl.yaml:groovist"]

    sweep = tmp_path / "s.yaml"
    sweep.write_text("data: vwp.csv\ndata_format: vwp\noutput_dir: out\nsettings: [visual]\nprompts: [P1]\n"
                     "models:\n  - name: a\n  - name: b\n    options: {model: org/vlm}\n"
                     "rewards:\n  repetition: r.yaml\n")
    code, found = pieces("--config", str(sweep))
    assert found[("path", "vwp.csv")]["get"] == lib.VWP_URL
    from storyrl.models.vlm import DEFAULT_VLM

    assert found[("hub", DEFAULT_VLM)]["needed_by"] == ["s.yaml:a"]  # the generator's default model
    assert found[("hub", "org/vlm")]["needed_by"] == ["s.yaml:b"]


def test_everything_when_nothing_named(env):
    code, found = pieces()
    assert code == 1
    required = {k for k, p in found.items() if p["required"]}
    from storyrl.models.vlm import DEFAULT_VLM

    assert {("torch", "cuda"), ("hub", CLIP), ("hub", "albert-large-v1"), ("hub", DEFAULT_VLM),
            ("spacy", "en_core_web_trf"), ("asset", "all_pronouns.txt"), ("path", lib.PAPER_DATA)} <= required
    # rewards outside the paper's d_HM are listed, optional
    assert not found[("path", "(vrank.model not set)")]["required"]
    assert not found[("path", "(rovist_vg.glove not set)")]["required"]
    assert found[("path", "(rovist_vg.glove not set)")]["get"] == lib.GLOVE_URL


def test_offline_is_fast_and_opens_no_socket(env):
    start = time.perf_counter()
    result = run()
    assert time.perf_counter() - start < 10
    assert result.exit_code == 1
    assert "MISSING   torch " in result.output
    assert "get it: a CUDA build of torch: https://pytorch.org/get-started/locally/" in result.output
    assert "`storyrl doctor --fetch` downloads" in result.output.splitlines()[-1]


def test_gpu_present(env, monkeypatch):
    import torch

    from test_doctor_gpu import simulate_gpu

    simulate_gpu(monkeypatch, torch, "Fake GPU", 16, (8, 0), bf16=True)
    reqs = lib.check(lib.requirements(["clipscore"]))
    gpu = next(p for p in reqs.pieces if p.kind == "torch")
    assert gpu.present and "Fake GPU" in gpu.where


def test_fetch_calls_each_downloader_and_reports_failures(env, monkeypatch):
    calls = []
    monkeypatch.setattr("storyrl.doctor.fetching.hub_reachable", lambda: True)

    def snapshot_download(repo_id):
        calls.append(("hub", repo_id))
        cache_model(env["cache"], repo_id)

    def spacy_download(name):
        calls.append(("spacy", name))
        raise SystemExit(1)  # what spaCy's CLI does when pip fails

    def download_assets(names):
        calls.append(("asset", *names))
        (env["tmp"] / "assets").mkdir(exist_ok=True)
        for name in names:
            (env["tmp"] / "assets" / name).write_text("x\n")

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    monkeypatch.setattr("storyrl.models.hub._probe", lambda url: True)
    monkeypatch.setattr("spacy.cli.download", spacy_download)
    monkeypatch.setattr("storyrl.assets.download_assets", download_assets)
    result = run("-m", "groovist", "--fetch", "--json")
    data = json.loads(result.output)
    assert result.exit_code == 1  # the spaCy pipeline is still missing
    assert sorted(calls) == sorted([("hub", CLIP), ("spacy", "en_core_web_trf"),
                                    ("asset", "concreteness_ratings.csv"), ("asset", "all_pronouns.txt")])
    state = {p["target"]: (p["present"], p["fetch_error"]) for p in data["pieces"]}
    assert state[CLIP] == (True, None)
    assert state["all_pronouns.txt"] == (True, None)
    assert state["en_core_web_trf"] == (False, "python -m spacy download en_core_web_trf failed (exit 1)")
    assert data["missing"] == ["spaCy pipeline en_core_web_trf"]
    assert ("torch", "cuda") not in {(c[0], c[1]) for c in calls}  # GPU torch is not downloaded


def test_fetch_offline_fails_fast_per_piece(env, monkeypatch):
    monkeypatch.setattr("storyrl.models.hub._probe", lambda url: False)
    monkeypatch.setattr("storyrl.assets.download_assets",
                        lambda names: (_ for _ in ()).throw(RuntimeError(f"could not download {names[0]}")))
    result = run("-m", "groovist", "--fetch")
    assert result.exit_code == 1
    assert "fetch failed: HF_HUB_OFFLINE is set" in result.output
    assert "fetch failed: github.com cannot be reached" in result.output
    assert "fetch failed: could not download all_pronouns.txt" in result.output
    assert "could not be downloaded" in result.output.splitlines()[-1]


def test_bad_names_and_configs(env, tmp_path):
    result = run("-m", "nosuch")
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "--metrics: unknown reward 'nosuch'" in result.output
    bad = tmp_path / "bad.yaml"
    for text, message in (("reward: groovist\ntheta: [1\n", "invalid YAML"),
                          ("reward: groovist\nno_such_option: 1\n", "no_such_option"),
                          ("foo: 1\n", "not a reward config"),
                          ("- 1\n", "expected a YAML mapping")):
        bad.write_text(text)
        result = run("--config", str(bad))
        assert result.exit_code == 1, text
        assert result.output.count("\n") == 1 and str(bad) in result.output and message in result.output, \
            result.output
    assert run("--config", str(tmp_path / "absent.yaml")).exit_code == 2  # click's own usage error


def test_fetch_leaves_optional_pieces_alone(env, monkeypatch):
    # optional pieces can be gigabytes the paper's setup does not use
    fetched = []
    monkeypatch.setitem(lib._FETCHERS, "hub", lambda piece: fetched.append(("hub", piece.target)))
    monkeypatch.setitem(lib._FETCHERS, "asset", lambda piece: fetched.append(("asset", piece.target)))
    reqs = lib.Requirements()
    reqs.add(lib.Piece("hub", "org/optional", "an optional model", "hf download org/optional", False), "x")
    reqs.add(lib.Piece("hub", "org/required", "a required model", "hf download org/required", True), "y")
    reqs.add(lib.Piece("asset", "all_pronouns.txt", "pronouns", "storyrl assets", False), "x")
    lib.fetch(reqs)
    assert fetched == [("hub", "org/required")]
    optional = next(p for p in reqs.pieces if p.target == "org/optional")
    assert optional.present is False and optional.fetch_error is None


def test_groovist_concreteness_file_replaces_the_asset(env, tmp_path):
    (tmp_path / "my.csv").write_text("Word;Conc.M\ndog;4.9\n")
    config = tmp_path / "g.yaml"
    config.write_text("reward: groovist\nweighting: concreteness\nconcreteness: my.csv\n")
    _, found = pieces("--config", str(config))
    assert ("asset", "concreteness_ratings.csv") not in found
    assert found[("path", "my.csv")]["present"] and found[("path", "my.csv")]["required"]
    assert ("asset", "all_pronouns.txt") in found  # the pronoun list still comes from the asset cache
    # without the file, the asset is what is needed
    config.write_text("reward: groovist\nweighting: concreteness\n")
    _, found = pieces("--config", str(config))
    assert found[("asset", "concreteness_ratings.csv")]["required"]


def test_clip_local_dir_is_a_missing_directory(env, tmp_path):
    config = tmp_path / "g.yaml"
    config.write_text("reward: groovist\nclip_model: local-dir:/nonexistent\n")
    code, found = pieces("--config", str(config))
    assert code == 1
    piece = found[("path", "/nonexistent")]
    assert piece["required"] and not piece["present"]
    assert piece["where"] == "no such file or directory: /nonexistent"
    assert not any(kind == "package" for kind, _ in found)  # not an optional "cannot be checked" row
    assert ("hub", CLIP) not in found


def test_three_segment_model_path_is_a_missing_path_not_a_hub_repo(env, tmp_path):
    # vrank's model option may be a hub repo id or a directory: "models/x/y" cannot be a repo id
    config = tmp_path / "v.yaml"
    config.write_text("reward: vrank\nmodel: models/x/y\n")
    code, found = pieces("--config", str(config))
    assert code == 1
    piece = found[("path", "models/x/y")]
    assert piece["required"] and not piece["present"]
    assert piece["get"] == "storyrl train vrank --config configs/training/vrank.yaml"
    assert ("hub", "models/x/y") not in found
    # the same for a base model; "org/name" is a hub repo
    config.write_text("reward: coherence\nmodel: runs/coh\nbase_model: models/x/y\n")
    _, found = pieces("--config", str(config))
    assert not found[("path", "models/x/y")]["present"] and ("hub", "models/x/y") not in found
    config.write_text("reward: vrank\nmodel: org/vrank\n")
    _, found = pieces("--config", str(config))
    assert found[("hub", "org/vrank")]["get"] == "hf download org/vrank"


def test_rl_config_without_model_needs_the_default_policy(env, tmp_path):
    from storyrl.models.vlm import DEFAULT_VLM

    rl = tmp_path / "rl.yaml"
    rl.write_text("algorithm: grpo\noutput_dir: out\ndata: vist/train.json\nrewards: [repetition]\n")
    code, found = pieces("--config", str(rl))
    assert code == 1
    policy = found[("hub", DEFAULT_VLM)]
    assert policy["required"] and not policy["present"] and policy["needed_by"] == ["rl.yaml"]
    cache_model(env["cache"], DEFAULT_VLM)
    _, found = pieces("--config", str(rl))
    assert found[("hub", DEFAULT_VLM)]["present"]


def test_empty_metrics_is_a_usage_error_not_the_whole_setup(env):
    # -m '' and -m ,,, name no reward: a slip, answered at once, not the paper's full check
    for value in ("", ",,,", " , "):
        result = run("-m", value)
        assert result.exit_code == 2, value
        assert result.output.count("\n") == 1, result.output
        assert "--metrics: no reward named" in result.output and "leave -m out" in result.output


_REAL_CONNECT = socket.create_connection  # before env's guard replaces it


def _remote_config(tmp_path, url: str):
    config = tmp_path / "remote.yaml"
    config.write_text(f"reward: remote\nurl: {url}\n")
    return config


@pytest.fixture
def local_network(env, monkeypatch):
    """Sockets to this machine only (the reward server's test doubles), no proxy."""
    monkeypatch.setattr(socket, "create_connection", _REAL_CONNECT)
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("no_proxy", "*")
    monkeypatch.setattr("storyrl.doctor.checks.SERVER_TIMEOUT_S", 0.5)
    env["spacy"].add("httpx")  # env's set of installed modules


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_reward_checks_its_server(local_network, tmp_path):
    import http.server
    import threading

    from conftest import REPO

    # The shipped config: its server's /health is what gets checked.
    reqs = lib.requirements([], [REPO / "configs" / "rewards" / "remote.yaml"])
    server = next(p for p in reqs.pieces if p.kind == "server")
    assert server.target == "http://localhost:5000/health" and server.required

    # No server: a failure naming the URL, and how to start one.
    url = f"http://127.0.0.1:{_closed_port()}"
    result = run("--config", str(_remote_config(tmp_path, url + "/get_reward")))
    assert result.exit_code == 1
    line = next(line for line in result.output.splitlines() if "reward server" in line)
    assert line.startswith("MISSING")
    assert f"reward server {url}" in line and f"down: {url}/health" in line, result.output
    assert f"start `storyrl serve --config REWARD.yaml` at {url}" in result.output

    # A server that accepts but never answers: the check gives up after its timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        _, found = pieces("--config", str(_remote_config(tmp_path, url)))
    assert found[("server", f"{url}/health")]["where"] == f"down: {url}/health: no answer within 0.5 s"

    # A server that answers /health: present, exit 0.
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path.startswith("/moved"):  # a redirect to a page that answers 200
                self.send_response(302)
                self.send_header("Location", "/health")
                self.end_headers()
                return
            self.send_response(200 if self.path == "/health" else 500)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        code, found = pieces("--config", str(_remote_config(tmp_path, url + "/")))
        # A /health that redirects is not followed (nor is it by the reward's own setup): down.
        moved_code, moved = pieces("--config", str(_remote_config(tmp_path, url + "/moved/get_reward")))
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
    assert code == 0, found
    assert found[("server", f"{url}/health")]["where"] == f"{url}/health answers (HTTP 200)"
    assert found[("package", "httpx")]["present"]
    assert moved_code == 1 and moved[("server", f"{url}/moved/health")]["where"] == f"{url}/moved/health answers HTTP 302"


def _cpu_rl_config(tmp_path, extra: str = "", algorithm: str = "grpo") -> str:
    (tmp_path / "policy").mkdir(exist_ok=True)
    (tmp_path / "train.jsonl").write_text("{}\n")
    rl = tmp_path / "rl.yaml"
    rl.write_text(f"algorithm: {algorithm}\noutput_dir: out\ndata: train.jsonl\nmodel: policy\npolicy: causal_lm\n"
                  "rewards: [repetition]\n" + extra)
    return str(rl)


def test_rl_config_that_trains_on_the_cpu_needs_no_gpu(env, tmp_path):
    result = run("--config", _cpu_rl_config(tmp_path))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].startswith("WARN      torch ")  # a note, not a failure
    _, found = pieces("--config", _cpu_rl_config(tmp_path))
    assert not found[("torch", "cuda")]["required"]


@pytest.mark.parametrize("extra, key", [
    ("load_in_4bit: true\nlora: {enabled: true}\n", "load_in_4bit"),
    ("grpo: {use_vllm: true}\n", "grpo.use_vllm"),
    ("grpo: {fp16: true}\n", "grpo.fp16"),
    ("rloo: {use_vllm: true}\n", "rloo.use_vllm"),
    ("rloo: {fp16: true}\n", "rloo.fp16"),
])
def test_rl_config_asking_for_cuda_needs_gpu_torch(env, tmp_path, extra, key):
    algorithm = "rloo" if key.startswith("rloo") else "grpo"
    code, found = pieces("--config", _cpu_rl_config(tmp_path, extra, algorithm))
    assert code == 1
    gpu = found[("torch", "cuda")]
    assert gpu["required"] and not gpu["present"] and gpu["needed_by"] == [f"rl.yaml ({key})"]
    assert (("package", "vllm") in found) == key.endswith("use_vllm")


def test_reward_on_a_cuda_device_needs_gpu_torch(env, tmp_path):
    config = tmp_path / "g.yaml"
    config.write_text("reward: groovist\ndevice: cuda:0\n")
    _, found = pieces("--config", str(config))
    assert found[("torch", "cuda")]["required"]
