"""Conversion: a Hugging Face checkpoint folder (or a ``.colibri`` file) into
one ``.colibri`` file, done by the native converter.

The conversion cache behind ``Engine.from_pretrained`` calls it, and so do
``colibri.convert`` and the CLI; it imports neither the engine nor the cache.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Union

from . import _colibri
from ._errors import InvalidInputError

PathLike = Union[str, "os.PathLike[str]"]


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    dtype: str | None = None,
    imatrix: PathLike | None = None,
    force: bool = False,
    progress: bool | None = None,
    keep_mtp: bool | None = None,
) -> dict[str, Any]:
    """Converts a Hugging Face checkpoint folder into one ``.colibri`` file,
    or re-encodes a ``.colibri`` file into another weight type.

    Args:
        src: folder with ``config.json`` and ``*.safetensors`` (sharded or not),
            and usually the tokenizer files, which are embedded too; or a
            ``.colibri`` file, whose tensors are decoded to f32 and encoded
            again in ``dtype`` (config, tokenizer, chat template and
            generation defaults are kept). Re-encoding cannot restore
            precision the file no longer has: from an already quantised file
            the second rounding adds to the first, so quantise from the
            highest-precision file you have.
        dst: output file. Refused if it exists, unless ``force=True``.
        dtype: storage type of the weight matrices: one of
            :func:`colibri.supported_dtypes` for all of them; a recipe from
            :func:`colibri.recipes` (``"q4_1-mix"`` ...); or ``class=type``
            pairs (``"experts=q4_1,experts_down=q8_0,default=q8_0"``; classes
            ``embed``, ``lm_head``, ``attn``, ``ffn``, ``shared``,
            ``experts``, ``experts_down``). ``None`` keeps the source's own
            type (``q8_0`` for FP8 checkpoints, whose type colibri does not
            store; ``mxfp4`` for MXFP4 ones; ``q4_0`` for compressed-tensors
            int4 ones). Norms, biases and the router are always f32.
        imatrix: an importance matrix from :meth:`Engine.calibrate` (or
            ``colibri calibrate``) of the same model: the quantisers then
            minimise the error weighted by each column's mean squared
            activation. Refused with a clear error if it was made for
            another model.
        progress: draw a progress bar on stderr (default: when stderr is a terminal).
        keep_mtp: keep the checkpoint's multi-token-prediction layer, which
            drafts tokens for ``speculative="mtp"`` (DeepSeek-V3 and GLM-4.5's
            ``num_nextn_predict_layers`` layer, Qwen3-Next and Qwen3.5's
            ``mtp.*``). ``None`` keeps it when it adds at most 5% to the
            file; ``True`` is an error for a checkpoint without one.

    Returns a summary: ``path``, ``architecture``, ``dtype``, ``recipe``,
    ``tensors``, ``bytes``; with an importance matrix, ``weighted``:
    (matrices it weighted, quantised matrices it had nothing for); with a
    compressed-tensors int4 source, ``int4``: ``tensors``, ``groups`` (of 32
    values), ``requantised`` (groups whose scale is not an f16 value, so not
    copied exactly into q4_0) and ``widened`` (tensors with a scale beyond
    f16's range, stored in f32).
    A failed or interrupted conversion leaves no file behind.
    """
    if progress is None:
        progress = sys.stderr.isatty()
    imatrix = None if imatrix is None else os.fspath(imatrix)
    summary = _colibri.convert_checkpoint(
        os.fspath(src),
        os.fspath(dst),
        dtype=dtype,
        force=bool(force),
        progress=bool(progress),
        imatrix=imatrix,
        keep_mtp=keep_mtp,
    )
    return dict(summary)


__all__ = ["convert"]


def split(
    model: PathLike,
    stages: int,
    *,
    out: PathLike | None = None,
    shares: list[float] | None = None,
    force: bool = False,
    progress: bool | None = None,
    dry_run: bool = False,
) -> list[dict[str, Any]]:
    """Cuts a ``.colibri`` file into one stage file per pipeline stage, for
    :class:`colibri.ray.Engine` on machines that cannot each hold the whole
    model (on disk or in memory).

    Each stage file holds a contiguous range of the decoder layers (the
    first also the embedding, the last also the final norm and head) with
    the whole model's config, tokenizer and chat template. Its bytes are the
    whole file's, so a pipeline over stage files gives the same results as
    one over the whole file. Copy each file to the machine that runs its
    stage; every machine keeps them in the same folder.

    Args:
        model: a whole-model ``.colibri`` file.
        stages: how many stage files to write.
        out: the folder to write into, made if missing (default: the
            model's own folder).
            Files are named ``<model>.stage-<i>-of-<stages>.colibri``.
        shares: relative sizes of the stages (say, each machine's memory in
            GB), one per stage; the layers are split by weight bytes in
            these proportions (default: equal).
        force: replace stage files that exist (otherwise refused before
            anything is written).
        progress: draw a progress bar per file on stderr (default: when
            stderr is a terminal).
        dry_run: only compute the plan; write nothing.

    Returns one dict per stage: ``path``, ``layers`` (start, end) and
    ``bytes`` (the file's size; with ``dry_run``, the weights' bytes).
    An interrupted split removes the file it was writing.
    """
    src = os.fspath(model)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise InvalidInputError(f"stages must be a positive integer, got {stages!r}")
    if shares is not None and len(shares) != stages:
        raise InvalidInputError(f"shares: one per stage ({stages}), got {len(shares)}")
    plan = _colibri.stage_plan(src, [float(s) for s in shares] if shares else [1.0] * stages)
    folder = os.fspath(out) if out is not None else (os.path.dirname(os.path.abspath(src)))
    if dry_run:
        per_layer, embed, head = _colibri.stage_bytes(src)
        n = len(per_layer)
        stem = os.path.splitext(os.path.basename(src))[0]
        return [
            {
                "path": os.path.join(folder, f"{stem}.stage-{i + 1}-of-{len(plan)}.colibri"),
                "layers": (a, b),
                "bytes": sum(per_layer[a:b]) + embed * (a == 0) + head * (b == n),
            }
            for i, (a, b) in enumerate(plan)
        ]
    if progress is None:
        progress = sys.stderr.isatty()
    written = _colibri.split_model(src, folder, plan, force=bool(force), progress=bool(progress))
    return [{"path": os.fspath(p), "layers": (a, b), "bytes": n} for p, a, b, n in written]
