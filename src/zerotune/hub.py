"""The recipe's model on this node: `zerotune fetch` downloads it once; training checks it, offline, before launch.

Compute nodes often have no internet, and every rank calling `from_pretrained` on a hub id would hit the Hub at
once or fail deep inside the workers. So the download is a step of its own, on a node with internet
(`make fetch RECIPE=...`, or slurm/prepare.sbatch), into the Hugging Face cache; the same hub id then resolves
from that cache on every node that shares its file system. `require_weights` (train.before_launch: `zerotune
train` before torchrun, slurm/job.py preflight before srun) only looks at local files, whether or not the node
could reach the Hub: compute nodes never download.

  model.name_or_path   null                random init from model.init_config: nothing to fetch
                       a local folder      config.json and weights (model.safetensors, or an index and every shard)
                       a hub id            the same files in the cache, at the revision `main` points to
  model.tokenizer      a folder or hub id  tokenizer.json, tokenizer_config.json or tokenizer.model

The cache is where huggingface_hub puts it: HF_HUB_CACHE, else HF_HOME/hub (default ~/.cache/huggingface/hub).
fetch takes safetensors only: no .bin/.pth copies and no original/ folder (Llama's is another 16 GB checkpoint).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from .config import REPO_ROOT, Recipe, load_recipe, resolve_path
from .errors import UserError
from .families import of_config, public_config
from .layout import producing_recipe

CONFIG = "config.json"
# (single file, index) pairs from_pretrained can load, in its order of preference; fetch downloads the first only
WEIGHTS = [("model.safetensors", "model.safetensors.index.json"), ("pytorch_model.bin", "pytorch_model.bin.index.json")]
TOKENIZER_ANY = ["tokenizer.json", "tokenizer_config.json", "tokenizer.model"]  # one of them makes a tokenizer
# What fetch takes before the weights (top level only: fnmatch's * would also match original/params.json)
MODEL_FILES = [CONFIG, "generation_config.json", "model.safetensors.index.json"]
TOKENIZER_FILES = [*TOKENIZER_ANY, "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt"]
SLURM_HF_HOME = REPO_ROOT / ".cache" / "huggingface"  # slurm/env.sh's default HF_HOME (the submit dir's .cache)


class ModelConfigError(RuntimeError):
    pass


class WeightsError(UserError):
    """The model or tokenizer a stage needs is not on this node; the message says how to get it here."""


# ---- where the cache is -------------------------------------------------------------------------------------

def hf_home() -> Path:
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home)))


def hub_cache() -> Path:
    """The cache a process started now would use (huggingface_hub reads these variables once, at import)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or str(hf_home() / "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def cache_name() -> str:
    """The cache as the user set it, for messages."""
    if os.environ.get("HF_HUB_CACHE"):
        return f"HF_HUB_CACHE={hub_cache()}"
    return f"HF_HOME={hf_home()}" + ("" if os.environ.get("HF_HOME") else " (the default: HF_HOME is not set)")


# ---- local folder or hub id ---------------------------------------------------------------------------------

def is_hub_id(name: str) -> bool:
    """A hub id, not a folder: no such local path, not written as a path, and valid as a repo id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if resolve_path(name).exists() or name.startswith(("/", ".", "~", "assets/")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _in_folder(folder: Path) -> Callable[[str], Path | None]:
    return lambda f: folder / f if (folder / f).is_file() else None


def _in_cache(repo: str) -> Callable[[str], Path | None]:
    from huggingface_hub import try_to_load_from_cache

    def find(f: str) -> Path | None:
        p = try_to_load_from_cache(repo, f, cache_dir=hub_cache())  # refs/main -> snapshots/<commit>/f; no network
        return Path(p) if isinstance(p, str) else None
    return find


def local_folder(name: str) -> Path:
    """Where `name`'s files are on this node: the folder itself, or a hub id's snapshot in the cache (offline);
    `name` as a path when neither (callers then see missing files, as before)."""
    if is_hub_id(name):
        config = _in_cache(name)("config.json")
        if config is not None:
            return config.parent
    return Path(name)


def config_source(r: Recipe) -> Path:
    """Where the model's config.json comes from, without the hub: planning and the family check read it before
    any download."""
    if r.model.init_config:
        return resolve_path(r.model.init_config)
    name = r.model.name_or_path or ""
    local = resolve_path(name)
    if local is not None and (local / "config.json").exists():
        return local / "config.json"
    shipped = public_config(name)  # the public config, shipped (families.py): planning needs no download
    if shipped is not None:
        return shipped
    made_by = producing_recipe(local) if local is not None else None
    if made_by:  # another recipe's published model, not trained yet (DPO after SFT): the same shape as its start
        return config_source(load_recipe(made_by))
    raise ModelConfigError(
        f"model.name_or_path '{name}': no local folder with a config.json and no shipped config for it. "
        "Download the model (or just its config.json) into a folder and point model.name_or_path at it.")


def family_of_recipe(r: Recipe):
    """The recipe's family (families.py) from its config (init_config, a local folder, or a shipped public
    config); None when the config is not on this machine yet (a hub model before `make fetch`: the worker checks
    before it loads)."""
    try:
        return of_config(config_source(r))
    except ModelConfigError:
        return None


CONTENT_SAMPLES = 16  # blocks read from each weight file's data for weights_fingerprint
CONTENT_BLOCK = 1 << 16


def weights_fingerprint(folder: Path) -> str:
    """Which weights these are, by content and wherever they lie: the sha256 of config.json, each safetensors file's
    name and header (every tensor's name, dtype, shape and offsets) and CONTENT_SAMPLES blocks spread over its data,
    so a copy in another node's cache or a re-download keys the same and a retrained model (every value moved)
    does not. Seconds at 8B (a few MiB read of 16 GB), not the minutes a whole-file hash takes. A folder of .bin
    weights (save_pretrained's older format) is keyed the same way on its files' sampled bytes."""
    import hashlib
    import struct

    folder = Path(folder)
    h = hashlib.sha256()
    if (folder / CONFIG).exists():
        h.update((folder / CONFIG).read_bytes())
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        size = f.stat().st_size
        with f.open("rb") as fh:
            if f.suffix == ".safetensors":
                n = struct.unpack("<Q", fh.read(8))[0]
                h.update(f.name.encode() + fh.read(n))
                start = 8 + n
            else:  # a pickle/zip: no header to read apart, its bytes sampled like a safetensors file's data
                h.update(f.name.encode() + str(size).encode())
                start = 0
            step = max(CONTENT_BLOCK, (size - start) // CONTENT_SAMPLES)
            for off in range(start, size, step):
                fh.seek(off)
                h.update(fh.read(CONTENT_BLOCK))
    return h.hexdigest()


def missing_model_files(find: Callable[[str], Path | None], where: str) -> list[str]:
    """What from_pretrained needs that `find` does not have: config.json, the weights (one file, or an index and
    every shard it lists)."""
    missing = [] if find(CONFIG) else [CONFIG]
    for single, index in WEIGHTS:
        if find(single):
            return missing
        idx = find(index)
        if idx:
            return missing + [s for s in shards(idx, where) if not find(s)]
    return missing + [f"{WEIGHTS[0][0]} (or {WEIGHTS[0][1]} and its shards)"]


def shards(index: Path, where: str) -> list[str]:
    """The weight files a sharded checkpoint's index lists."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise WeightsError(f"{where}: {index} is not a valid weight index (a JSON object with a 'weight_map'); "
                           "delete it and download the model again.") from None


def missing_tokenizer_files(find: Callable[[str], Path | None]) -> list[str]:
    return [] if any(find(f) for f in TOKENIZER_ANY) else [" or ".join(TOKENIZER_ANY)]


def _fix(r: Recipe) -> str:
    return (f"run `make fetch RECIPE={r.name}` (or `sbatch slurm/prepare.sbatch {r.name}`) on a node with internet "
            "first")


def _check_folder(r: Recipe, key: str, name: str, model: bool, tokenizer: bool) -> None:
    folder = resolve_path(name)
    if not folder.is_dir():
        made_by = producing_recipe(folder)
        if made_by:  # another recipe's published model (DPO after SFT): train that one first
            raise WeightsError(f"{key}: folder {folder} not found: it is recipe {made_by}'s published model. Run "
                               f"`make data finetune RECIPE={made_by}` first (`make demo RECIPE={r.name}` does), or "
                               f"point {key} at another model folder.")
        hint = " `make setup` builds it." if folder.is_relative_to(REPO_ROOT / "assets") else ""
        raise WeightsError(f"{key}: folder {folder} not found.{hint} Point {key} at a folder with the model's "
                           f"files, or at a hub id (then `make fetch RECIPE={r.name}` downloads it).")
    find = _in_folder(folder)
    missing = (missing_model_files(find, key) if model else []) + (missing_tokenizer_files(find) if tokenizer else [])
    if missing:
        raise WeightsError(f"{key}: folder {folder} has no {', '.join(missing)}. Point {key} at a folder written "
                           "by save_pretrained (config.json, model.safetensors or its index and shards, tokenizer "
                           "files), or at a hub id.")


def _missing_in_cache(repo: str, model: bool, tokenizer: bool, where: str) -> tuple[list[str], bool]:
    """(missing files, whether anything of the repo is cached at all)."""
    find = _in_cache(repo)
    missing = (missing_model_files(find, where) if model else []) + (missing_tokenizer_files(find) if tokenizer else [])
    anything = any(find(f) for f in [CONFIG, *TOKENIZER_ANY, *(w for pair in WEIGHTS for w in pair)])
    return missing, anything


def _roles(r: Recipe) -> list[tuple[str, str, bool, bool]]:
    """(key, name, is the model, is the tokenizer) per distinct source; one entry when both are the same."""
    m, t = r.model.name_or_path, r.model.tokenizer
    if m and m == t:
        return [("model.name_or_path", m, True, True)]
    return ([("model.name_or_path", m, True, False)] if m else []) + [("model.tokenizer", t, False, True)]


# ---- the preflight ------------------------------------------------------------------------------------------

def require_weights(r: Recipe) -> None:
    """Everything the workers will load from the model and tokenizer sources is on this node: never the network."""
    for key, name, model, tokenizer in _roles(r):
        if not is_hub_id(name):
            _check_folder(r, key, name, model, tokenizer)
            continue
        missing, anything = _missing_in_cache(name, model, tokenizer, key)
        if not anything:
            raise WeightsError(f"{key} '{name}' is not in the local Hugging Face cache ({cache_name()}): {_fix(r)}; "
                               "compute nodes do not download.")
        if missing:
            raise WeightsError(f"{key} '{name}' is only partly in the local Hugging Face cache ({cache_name()}), "
                               f"missing {', '.join(missing)}: {_fix(r)}; it completes the download.")


# ---- zerotune fetch -----------------------------------------------------------------------------------------

def _download(r: Recipe, key: str, repo: str, patterns: list[str], revision: str | None = None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    page = f"{constants.ENDPOINT}/{repo}"
    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=hub_cache(), allow_patterns=patterns))
    except GatedRepoError:
        raise WeightsError(f"{key} '{repo}' is a gated model and this node's Hugging Face token cannot read it: "
                           f"accept the licence on {page} (logged in), then `hf auth login` (or set HF_TOKEN) "
                           f"here and run `make fetch RECIPE={r.name}` again.") from None
    except RepositoryNotFoundError:
        raise WeightsError(f"{key} '{repo}': no such model on the Hub ({page}), or it is private and this node's "
                           "token cannot see it: check the id, or `hf auth login` (or set HF_TOKEN).") from None
    except LocalEntryNotFoundError as e:  # no answer from the Hub, and the cache does not have it
        cause = e.__cause__
        why = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}".rstrip(": ") \
            if cause else str(e).splitlines()[0]
        raise WeightsError(f"{key} '{repo}' cannot be downloaded: the Hugging Face Hub ({constants.ENDPOINT}) "
                           f"did not answer ({why}) and it is not in the cache ({cache_name()}). Run `make fetch "
                           f"RECIPE={r.name}` on a node with internet.") from None
    except HfHubHTTPError as e:
        raise WeightsError(f"{key} '{repo}': the Hub refused the download ({str(e).splitlines()[0]}).") from None


def _fetch_repo(r: Recipe, key: str, repo: str, model: bool, tokenizer: bool) -> Path:
    """Config, tokenizer files and the weight index first; then exactly the weights the index lists."""
    patterns = (MODEL_FILES if model else []) + (TOKENIZER_FILES if tokenizer else [])
    snapshot = _download(r, key, repo, patterns)
    if model:
        index = snapshot / WEIGHTS[0][1]
        weights = shards(index, key) if index.is_file() else [WEIGHTS[0][0]]
        # revision = the commit the first call resolved: both halves come from the same snapshot
        snapshot = _download(r, key, repo, weights, revision=snapshot.name)
    missing, _ = _missing_in_cache(repo, model, tokenizer, key)
    if missing:
        raise WeightsError(f"{key} '{repo}' is still incomplete in the cache after the download, missing "
                           f"{', '.join(missing)}. If the Hub has no safetensors weights for it (fetch takes "
                           "safetensors only), save the model with save_pretrained into a folder and point "
                           f"{key} at it; otherwise run `make fetch RECIPE={r.name}` again on a node with internet.")
    return snapshot


def _size(folder: Path) -> tuple[int, int]:
    files = [f for f in folder.rglob("*") if f.is_file()]  # snapshot entries are symlinks into blobs/: followed
    return len(files), sum(f.stat().st_size for f in files)


def fetch(r: Recipe) -> int:
    """`zerotune fetch RECIPE`: the recipe's hub model and tokenizer into the Hugging Face cache, checked."""
    from huggingface_hub import constants

    local, hub = [], []
    if r.model.name_or_path is None:
        local.append(f"the model is initialised at random from model.init_config ({r.model.init_config})")
    for key, name, model, tokenizer in _roles(r):
        if is_hub_id(name):
            hub.append((key, name, model, tokenizer))
            continue
        _check_folder(r, key, name, model, tokenizer)
        local.append(f"{key} is the local folder {name}")
    if not hub:
        print(f"fetch: nothing to fetch for {r.name}: {'; '.join(local)}.", flush=True)
        return 0

    print(f"fetch: {r.name}: into the Hugging Face cache {hub_cache()}", flush=True)
    for key, repo, model, tokenizer in hub:
        what = " and ".join(w for w, on in (("config + safetensors weights", model), ("tokenizer", tokenizer)) if on)
        missing, anything = _missing_in_cache(repo, model, tokenizer, key)
        if not missing:  # complete: no request at all, so this also works where the node has no internet
            snapshot = next(p for p in map(_in_cache(repo), [CONFIG, *TOKENIZER_ANY]) if p).parent
            print(f"fetch: {key} '{repo}': already in the cache (not compared with the Hub)", flush=True)
        elif constants.is_offline_mode():  # set for this process: no request would leave it
            has = f"lacks {', '.join(missing)}" if anything else "does not have it"
            raise WeightsError(f"{key} '{repo}' cannot be downloaded: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is "
                               f"set, and the cache ({cache_name()}) {has}. Run `make fetch RECIPE={r.name}` without "
                               "it, on a node with internet.")
        else:
            print(f"fetch: {key} '{repo}': {what}", flush=True)
            snapshot = _fetch_repo(r, key, repo, model, tokenizer)
        n, size = _size(snapshot)
        print(f"fetch: {repo} -> {snapshot}: {n} files, {size:,} bytes ({size / 2**30:.2f} GiB)", flush=True)
    for line in local:
        print(f"fetch: {line}: nothing to fetch for it", flush=True)

    same = hub_cache().resolve() == (SLURM_HF_HOME / "hub").resolve()
    print(f"fetch: done. Training checks these files offline: the nodes that train must share this file system and "
          f"use the same cache ({cache_name()})." + ("" if same or os.environ.get("HF_HUB_CACHE") else
          f" Note: slurm/env.sh gives SLURM jobs HF_HOME={SLURM_HF_HOME} unless HF_HOME is exported when you "
          "submit: export this one there too, or fetch through slurm/prepare.sbatch."), flush=True)
    print(f"next: prepare the data (make data RECIPE={r.name}; slurm/prepare.sbatch does it right after fetching), "
          f"then train (make finetune RECIPE={r.name}, or sbatch ... slurm/finetune.sbatch {r.name})", flush=True)
    return 0
