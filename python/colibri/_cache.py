"""The conversion cache behind ``Engine.from_pretrained``.

A Hugging Face folder is converted once into
``<cache>/<folder name>-<path hash>-<dtype>-<content key>.colibri``. The
content key hashes the folder's file names, sizes and modification times, the
requested dtype and the colibri version, so an edited checkpoint or a new
colibri converts again; the older file of the same folder and dtype is then
removed. Conversion writes a temporary file and renames it, so a reader never
sees half a file and two processes converting at once both end up with a
complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ._colibri import __version__
from ._convert import convert
from ._errors import ColibriIOError, ModelNotFoundError, OutputExistsError


def cache_root(cache_dir: Any = None) -> Path:
    """``cache_dir``, else ``$COLIBRI_CACHE``, else ``~/.cache/colibri``."""
    if cache_dir is not None:
        return Path(os.fspath(cache_dir))
    env = os.environ.get("COLIBRI_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "colibri"


def source_key(src: Path, dtype: str | None) -> str:
    """Hash of what a conversion of ``src`` depends on."""
    files = []
    for p in sorted(src.iterdir()):
        if p.name.startswith(".") or not p.is_file():
            continue
        st = p.stat()  # follows symlinks: Hub snapshots link to blobs
        files.append([p.name, st.st_size, st.st_mtime_ns])
    material = {"colibri": __version__, "dtype": dtype or "auto", "files": files}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def cached_conversion(src: Path, *, dtype: str | None, cache_dir: Any, progress: bool | None) -> Path:
    """The cached conversion of ``src``, converting first if there is none."""
    if not src.exists():
        raise ModelNotFoundError(f"{src}: no such file or directory")
    if not src.is_dir():
        raise ModelNotFoundError(f"{src}: not a checkpoint folder or a .colibri file")
    root = cache_root(cache_dir)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", src.resolve().name) or "model"
    where = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:8]
    stem = f"{name}-{where}-{dtype or 'auto'}"
    out = root / f"{stem}-{source_key(src, dtype)}.colibri"
    if out.is_file():
        return out
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ColibriIOError(f"{root}: cannot create the cache folder: {e.strerror}") from None
    try:
        convert(src, out, dtype=dtype, progress=progress)
    except OutputExistsError:
        pass  # another process finished the same conversion first
    for old in root.glob(f"{stem}-*.colibri"):
        if old != out:
            try:
                old.unlink()
            except OSError:
                pass  # in use elsewhere (Windows) or already gone: harmless
    return out


#: What a conversion reads from a Hub repository (weights, configs, tokenizer, chat template).
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_repo_id(name: str) -> bool:
    """``org/name`` (or a bare legacy ``name``) that is not a path here."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not Path(name).exists()


def hub_snapshot(repo_id: str, revision: str | None, progress: bool | None) -> Path:
    """The local folder of ``repo_id`` at ``revision`` from the Hugging Face
    cache, downloaded first unless it is there (``huggingface_hub``'s own
    conventions: ``HF_HOME`` / ``HF_HUB_CACHE`` for the cache, ``HF_HUB_OFFLINE=1``
    to never touch the network, ``HF_TOKEN`` for gated repositories)."""
    try:
        import huggingface_hub
        from huggingface_hub import errors
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:
        raise ModelNotFoundError(
            f"{repo_id}: no such file or folder here; to fetch it from the Hugging Face Hub, "
            "install huggingface_hub (pip install 'colibri-moe[hub]')"
        ) from None
    where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=HUB_FILES,
            library_name="colibri-moe",
            library_version=__version__,
            tqdm_class=_silent_tqdm() if progress is False else None,
        )
    except errors.LocalEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"{where}: not a file or folder here, not in the Hugging Face cache, and cannot be "
            f"downloaded now (offline: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')!r}, "
            f"or no network): {e}"
        ) from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
        raise ModelNotFoundError(f"{where}: not a file or folder here, and not on the Hub: {e}") from None
    except HfHubHTTPError as e:
        raise ColibriIOError(f"{where}: the Hub answered with an error: {e}") from None
    return Path(str(folder))


def _silent_tqdm() -> Any:
    """huggingface_hub's own progress bar class (tqdm), switched off."""
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    class Silent(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    return Silent
