"""The model on the node: `require_weights` (before any worker starts) reads only local files, and `zerotune fetch`
puts a hub model into the Hugging Face cache (safetensors only) or says in one line why it cannot.

The cache here is built by hand in the layout huggingface_hub reads (models--org--name/refs/main and
snapshots/<commit>/), checked against huggingface_hub's own offline lookup; the downloads go to a fake Hub on
127.0.0.1 (HF_ENDPOINT), so nothing leaves the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from zerotune.config import RECIPES_DIR, load_recipe
from zerotune.errors import UserError
from zerotune.hub import is_hub_id, require_weights

REPO = Path(__file__).resolve().parents[1]
REPO_ID = "org/model"
SHA = "0123456789abcdef0123456789abcdef01234567"
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
MODEL = {  # a sharded safetensors model as the Hub serves it
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors.index.json": json.dumps({"metadata": {"total_size": 24}, "weight_map": {
        "model.embed_tokens.weight": SHARDS[0], "model.norm.weight": SHARDS[1], "lm_head.weight": SHARDS[1]}}).encode(),
    SHARDS[0]: b"\0" * 16,
    SHARDS[1]: b"\1" * 8,
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b"{}",
}
EXTRA = {  # what a Llama repo also holds and fetch must leave alone
    "pytorch_model.bin": b"bin" * 10,
    "original/consolidated.00.pth": b"pth" * 10,
    "original/params.json": b"{}",
    "README.md": b"# model card",
}


# ---- a Hugging Face cache built by hand ---------------------------------------------------------------------

@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    return home


def cache_repo(home: Path, repo: str = REPO_ID, skip: tuple[str, ...] = ()) -> Path:
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(SHA)
    for name, data in MODEL.items():
        if name not in skip:
            (snapshot / name).write_bytes(data)
    return snapshot


def hub_recipe(tmp_path: Path, repo: str = REPO_ID, name: str = "tiny"):
    return load_recipe(name, [f"output_dir={tmp_path / 'run'}", f"model.name_or_path={repo}", "model.init_config=",
                              f"model.tokenizer={repo}"])


def test_the_hand_built_cache_is_what_huggingface_hub_reads(hf_home):
    from huggingface_hub import snapshot_download

    snapshot = cache_repo(hf_home)
    assert Path(snapshot_download(REPO_ID, cache_dir=hf_home / "hub", local_files_only=True)) == snapshot


def test_a_hub_id_is_read_from_its_snapshot(hf_home, tmp_path):
    """What reads a model's own files by path (the samples' stop ids read generation_config.json) finds a hub
    id's snapshot in the cache; a folder stays itself."""
    from zerotune.hub import local_folder

    snapshot = cache_repo(hf_home)
    assert local_folder(REPO_ID) == snapshot
    assert local_folder(str(tmp_path)) == tmp_path
    assert local_folder("org/not-fetched") == Path("org/not-fetched")


def test_a_complete_cache_passes_offline(hf_home, tmp_path):
    cache_repo(hf_home)
    require_weights(hub_recipe(tmp_path))


@pytest.mark.parametrize("missing", [SHARDS[1], "config.json", "tokenizer.json tokenizer_config.json"])
def test_a_partial_cache_names_what_is_missing_and_the_fix(hf_home, tmp_path, missing):
    cache_repo(hf_home, skip=tuple(missing.split()))
    with pytest.raises(UserError) as e:
        require_weights(hub_recipe(tmp_path))
    msg = str(e.value)
    assert f"model.name_or_path '{REPO_ID}' is only partly in the local Hugging Face cache (HF_HOME={hf_home})" in msg
    assert f"missing {missing.split()[0]}" in msg, msg
    assert "run `make fetch RECIPE=tiny` (or `sbatch slurm/prepare.sbatch tiny`) on a node with internet" in msg


def test_an_uncached_hub_id_says_to_fetch_it(hf_home, tmp_path):
    cache_repo(hf_home)
    with pytest.raises(UserError) as e:
        require_weights(hub_recipe(tmp_path, "org/other"))
    assert str(e.value) == (
        f"model.name_or_path 'org/other' is not in the local Hugging Face cache (HF_HOME={hf_home}): run "
        "`make fetch RECIPE=tiny` (or `sbatch slurm/prepare.sbatch tiny`) on a node with internet first; compute "
        "nodes do not download.")


@pytest.mark.slow
def test_a_hub_tokenizer_is_checked_on_its_own(hf_home, tmp_path, tiny_model_dir):
    r = load_recipe("tiny", [f"output_dir={tmp_path}", f"model.name_or_path={tiny_model_dir}", "model.init_config=",
                             "model.tokenizer=org/tokenizer"])
    with pytest.raises(UserError, match=r"^model.tokenizer 'org/tokenizer' is not in the local Hugging Face cache"):
        require_weights(r)
    cache_repo(hf_home, "org/tokenizer", skip=(*SHARDS, "model.safetensors.index.json", "config.json"))
    require_weights(r)  # a tokenizer needs no weights


def test_the_shipped_8b_recipes_stop_before_launch_until_fetched(hf_home, tmp_path):
    """before_launch (zerotune finetune, slurm/job.py preflight) checks the weights first: before data, plan or disk."""
    from zerotune.train.launch import before_launch

    for name in ("llama8b_zero3", "llama8b_lora_zero3", "llama8b_zero3_offload", "llama8b_qlora_t4"):
        with pytest.raises(UserError) as e:
            before_launch(load_recipe(name, [f"output_dir={tmp_path / name}"]))
        assert str(e.value).startswith("model.name_or_path 'meta-llama/Llama-3.1-8B-Instruct' is not in the local "
                                       f"Hugging Face cache (HF_HOME={hf_home}): run `make fetch RECIPE={name}`")


def test_the_shipped_cpu_recipes_pass(hf_home):
    """Random init (init_config) and the local SmolLM2 folder: nothing to fetch, and the preflight passes; a recipe
    that starts from another recipe's model (smollm2_dpo) passes once that model is published, and until then
    says which recipe to run first."""
    from zerotune.layout import upstream_to_train

    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    local = [n for n in names if (m := load_recipe(n).model.name_or_path) is None or not is_hub_id(m)]
    assert {"tiny", "tiny_lora", "tiny_qlora", "smollm2", "smollm2_lora", "smollm2_dpo"} <= set(local), local
    for name in local:
        r = load_recipe(name)
        if (up := upstream_to_train(r)) is None:
            require_weights(r)
            continue
        with pytest.raises(UserError, match=f"recipe {up}'s published model. Run `make data finetune RECIPE={up}`"):
            require_weights(r)


def test_local_folders_need_config_and_weights(hf_home, tmp_path, tiny_model_dir):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")

    def error() -> str:
        with pytest.raises(UserError) as e:
            require_weights(load_recipe("tiny", [f"model.name_or_path={folder}", "model.init_config=",
                                                 f"model.tokenizer={folder}"]))
        return str(e.value)

    assert error() == (f"model.name_or_path: folder {folder} has no model.safetensors (or model.safetensors.index.json "
                       "and its shards). Point model.name_or_path at a folder written by save_pretrained (config.json, "
                       "model.safetensors or its index and shards, tokenizer files), or at a hub id.")
    (folder / "model.safetensors.index.json").write_bytes(MODEL["model.safetensors.index.json"])
    (folder / SHARDS[0]).write_bytes(b"")
    assert f"has no {SHARDS[1]}." in error()
    (folder / SHARDS[1]).write_bytes(b"")
    require_weights(load_recipe("tiny", [f"model.name_or_path={folder}", "model.init_config=",
                                         f"model.tokenizer={folder}"]))
    assert "folder /nonexistent/model not found" in _error_for("/nonexistent/model")
    require_weights(load_recipe("tiny", [f"model.name_or_path={tiny_model_dir}", "model.init_config="]))


def _error_for(name: str) -> str:
    with pytest.raises(UserError) as e:
        require_weights(load_recipe("tiny", [f"model.name_or_path={name}", "model.init_config="]))
    return str(e.value)


# ---- zerotune fetch, through the real entry point -----------------------------------------------------------

def fetch(home: Path, *args: str, offline: bool = False, endpoint: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                        "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1" if offline else "0", HF_HUB_DISABLE_PROGRESS_BARS="1")
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return subprocess.run([sys.executable, "-m", "zerotune", "fetch", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerotune: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def closed_port() -> int:
    from zerotune.ports import free_port

    return free_port()  # closed again on return: connecting is refused at once


@pytest.mark.slow
def test_fetch_random_init_and_local_folder_recipes_has_nothing_to_do(tmp_path, tiny_model_dir):
    proc = fetch(tmp_path / "hf", "tiny", endpoint=f"http://127.0.0.1:{closed_port()}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("fetch: nothing to fetch for tiny: the model is initialised at random from "
                                   "model.init_config (configs/models/tiny_llama31.json); model.tokenizer is the "
                                   "local folder assets/tokenizer/llama3_1.")
    proc = fetch(tmp_path / "hf", "tiny", f"model.name_or_path={tiny_model_dir}", "model.init_config=",
                 f"model.tokenizer={tiny_model_dir}", endpoint=f"http://127.0.0.1:{closed_port()}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"fetch: nothing to fetch for tiny: model.name_or_path is the local folder "
                                   f"{tiny_model_dir}.")
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_fetch_offline_is_one_line(tmp_path):
    one_line(fetch(tmp_path / "hf", "llama8b_zero3", offline=True),
             "model.name_or_path 'meta-llama/Llama-3.1-8B-Instruct' cannot be downloaded: HF_HUB_OFFLINE",
             f"HF_HOME={tmp_path / 'hf'}", "on a node with internet")


@pytest.mark.slow
def test_fetch_without_network_is_one_line(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    one_line(fetch(tmp_path / "hf", "llama8b_zero3", endpoint=endpoint),
             f"cannot be downloaded: the Hugging Face Hub ({endpoint}) did not answer (ConnectError",
             "Run `make fetch RECIPE=llama8b_zero3` on a node with internet.")


class FakeHub(ThreadingHTTPServer):
    """The few Hub endpoints snapshot_download calls: repo info, tree listing, file HEAD/GET."""

    def __init__(self, files: dict[str, bytes], gated: bool = False):
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.files, self.gated, self.requests = files, gated, []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _HubHandler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        hub, path = self.server, unquote(urlsplit(self.path).path)
        hub.requests.append((self.command, path))
        api, resolve = f"/api/models/{REPO_ID}", f"/{REPO_ID}/resolve/{SHA}/"
        oid = {f: hashlib.sha1(d).hexdigest() for f, d in hub.files.items()}
        if path == f"{api}/revision/main":  # metadata is public, gated or not
            return self._send(200, json.dumps({"id": REPO_ID, "sha": SHA,
                                               "siblings": [{"rfilename": f} for f in hub.files]}).encode())
        if path.startswith(f"{api}/tree/{SHA}"):
            return self._send(200, json.dumps([{"type": "file", "oid": oid[f], "size": len(d), "path": f}
                                               for f, d in hub.files.items()]).encode())
        if path.startswith(resolve) and path[len(resolve):] in hub.files:
            if hub.gated:
                return self._send(403, b"gated", {"X-Error-Code": "GatedRepo",
                                                  "X-Error-Message": f"Access to model {REPO_ID} is restricted."})
            name = path[len(resolve):]
            return self._send(200, hub.files[name], {"X-Repo-Commit": SHA, "ETag": f'"{oid[name]}"'})
        self._send(404, b"", {"X-Error-Code": "EntryNotFound"})


@pytest.fixture
def fake_hub(request):
    hub = FakeHub({**MODEL, **EXTRA}, gated=getattr(request, "param", False))
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    yield hub
    hub.shutdown()
    hub.server_close()


@pytest.mark.slow
def test_fetch_downloads_the_safetensors_model_into_the_cache(tmp_path, fake_hub, monkeypatch):
    home = tmp_path / "hf"
    proc = fetch(home, "tiny", f"model.name_or_path={REPO_ID}", "model.init_config=", f"model.tokenizer={REPO_ID}",
                 endpoint=fake_hub.url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    snapshot = home / "hub" / "models--org--model" / "snapshots" / SHA
    assert sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()) == sorted(MODEL)
    assert not [p for _, p in fake_hub.requests if p.endswith((".bin", ".pth", "README.md"))], fake_hub.requests
    size = sum(map(len, MODEL.values()))
    assert f"fetch: {REPO_ID} -> {snapshot}: {len(MODEL)} files, {size:,} bytes (0.00 GiB)" in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("next: prepare the data (make data RECIPE=tiny")
    # the training preflight now passes with no network at all
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    require_weights(hub_recipe(tmp_path))
    # and a second fetch needs no Hub: the endpoint is dead
    again = fetch(home, "tiny", f"model.name_or_path={REPO_ID}", "model.init_config=", f"model.tokenizer={REPO_ID}",
                  endpoint=f"http://127.0.0.1:{closed_port()}")
    assert again.returncode == 0, again.stderr
    assert f"model.name_or_path '{REPO_ID}': already in the cache" in again.stdout


@pytest.mark.slow
@pytest.mark.parametrize("fake_hub", [True], indirect=True, ids=["gated"])
def test_fetch_of_a_gated_model_without_access_says_how_to_get_it(tmp_path, fake_hub):
    line = one_line(fetch(tmp_path / "hf", "tiny", f"model.name_or_path={REPO_ID}", "model.init_config=",
                          f"model.tokenizer={REPO_ID}", endpoint=fake_hub.url))
    assert line == (f"zerotune: model.name_or_path '{REPO_ID}' is a gated model and this node's Hugging Face token "
                    f"cannot read it: accept the licence on {fake_hub.url}/{REPO_ID} (logged in), then `hf auth "
                    "login` (or set HF_TOKEN) here and run `make fetch RECIPE=tiny` again.")
