"""What scripts/accuracy.py and scripts/llamacpp_quants.py measure with, so
both score a quantised model on the same text in the same way.

- inputs: the bundled demo model, the English prose written for these
  scripts, token windows, seeded random sequences, and the Austen corpus the
  demo model was trained on, split exactly as scripts/demo/train_demo.py
  split it;
- measures: log-softmax in float64 and the per-position comparison of two
  logit arrays (top-1 agreement, KL, cross-entropy), summed so that several
  sequences pool.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from demo import rdata, train_demo

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "python" / "colibri" / "data" / "demo.colibri"

# Prose for the demo model, in the register of the novels it was trained on.
# Written for these scripts; none of it comes from the corpus.
PROSE = [
    "The morning was fine, and Mrs. Harcourt, who had not left the house for three days, "
    "declared that she would walk as far as the village before dinner. Her daughters were "
    "not consulted; they were told. Eleanor put down her book without a word, but her "
    "sister Lucy, who had promised herself a quiet hour at the piano, could not help "
    "observing that the lane would be very dirty after so much rain.",
    '"Dirty or clean, it is the only lane we have," said her mother, "and I will not be '
    "kept at home by a little mud. Mr. Pembroke walks it every day, and he is never the "
    'worse for it." Lucy thought that Mr. Pembroke was seldom the worse for anything, but '
    "she kept the thought to herself and went upstairs for her bonnet.",
    "They had not gone a quarter of a mile before they met the very gentleman of whom they "
    "had been speaking. He was riding slowly towards the house, and when he saw them he "
    "got down at once and walked beside them, leading his horse. He asked after their "
    "health with great civility, spoke of the weather, of the state of the roads, and of "
    "a new family that was expected at the Hall before the end of the month.",
    "Eleanor listened with more attention than she wished to show. A new family at the "
    "Hall must mean new acquaintance, and new acquaintance, in a neighbourhood so small, "
    "could not be a matter of indifference to anybody. Her mother asked every question "
    "that civility allowed, and one or two that it did not; Mr. Pembroke answered them "
    "all with perfect good humour, and knew, as it turned out, very little.",
    "When they parted at the corner of the churchyard, Mrs. Harcourt was in excellent "
    "spirits. She had learned that the family was large, that there was a son of about "
    "six and twenty, and that the father had a good income and no particular wish to "
    "spend it in London. It was enough to occupy her for the rest of the walk, and for "
    "the whole of the evening, and very probably for the rest of the week.",
    "Lucy, for her part, was more interested in a letter which she had found waiting on "
    "the hall table. It was from her aunt in Bath, and it contained an invitation to "
    "spend a month there in the spring. She read it twice over before she showed it to "
    "her sister, and then she could not decide whether she was more pleased to be asked "
    "or more afraid that her mother would refuse to let her go.",
]


# --------------------------------------------------------------------------- measures


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, other: np.ndarray, targets: np.ndarray | None = None) -> dict[str, float]:
    """Per-position comparison of two logit arrays of shape (T, V), summed.

    Returns sums (not means) so that several sequences can be pooled:
    ``positions``, ``agree`` (argmax equal), ``kl`` (sum over positions of
    KL(p_ref || p_other)), ``kl_max``, and with ``targets`` (the actual next
    token of each position, -1 for none) ``nll_ref``, ``nll_other``, ``scored``.
    """
    lr, lo = log_softmax(ref), log_softmax(other)
    kl = (np.exp(lr) * (lr - lo)).sum(axis=-1)
    out = {
        "positions": float(len(ref)),
        "agree": float((ref.argmax(axis=-1) == other.argmax(axis=-1)).sum()),
        "kl": float(kl.sum()),
        "kl_max": float(kl.max()),
    }
    if targets is not None:
        ok = targets >= 0
        rows = np.nonzero(ok)[0]
        out["nll_ref"] = float(-lr[rows, targets[ok]].sum())
        out["nll_other"] = float(-lo[rows, targets[ok]].sum())
        out["scored"] = float(ok.sum())
    return out


def pool(parts: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            total[k] = max(total.get(k, v), v) if k == "kl_max" else total.get(k, 0.0) + v
    return total


# --------------------------------------------------------------------------- inputs


def windows(ids: list[int], size: int, minimum: int = 16) -> list[list[int]]:
    out = [ids[i : i + size] for i in range(0, len(ids), size)]
    return [w for w in out if len(w) >= minimum]


def random_sequences(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=length).tolist() for _ in range(count)]


def austen_source(source: str, work: Path) -> Path:
    """The janeaustenr data (an R lazy-load database, without its suffix) from
    ``source``: ``"download"`` (``apt-get download r-cran-janeaustenr`` into
    ``work``, once), a path to that .deb (unpacked into ``work``, once), or a
    directory the package is unpacked or installed under."""
    work.mkdir(parents=True, exist_ok=True)
    if source == "download":
        debs = sorted(work.glob(f"{train_demo.DEB_PACKAGE}_*.deb"))
        if not debs:
            # apt-get's progress goes to stderr, keeping stdout for the tables.
            subprocess.run(
                ["apt-get", "download", train_demo.DEB_PACKAGE], cwd=work, check=True, stdout=sys.stderr
            )
            debs = sorted(work.glob(f"{train_demo.DEB_PACKAGE}_*.deb"))
        source = str(debs[-1])
    src = Path(source)
    if src.suffix == ".deb":
        pkg = work / "pkg"
        if not pkg.exists():
            subprocess.run(["dpkg-deb", "-x", str(src), str(pkg)], check=True)
        src = pkg
    # Either the root of an unpacked package or an installed R library.
    candidates = [src / train_demo.RDATA, src / "data" / "Rdata", src / "janeaustenr" / "data" / "Rdata"]
    found = next((c for c in candidates if c.with_suffix(".rdx").exists()), None)
    if found is None:
        raise SystemExit(f"no janeaustenr data under {src}")
    return found


def austen_novels(source: str, work: Path) -> list[tuple[str, str, list[str], list[str]]]:
    """(key, title, training paragraphs, held-out paragraphs) for each novel
    (``source`` as for :func:`austen_source`)."""
    objects = rdata.read_lazyload(austen_source(source, work))
    out = []
    for key, title in train_demo.NOVELS:
        train, held = train_demo.split_novel(train_demo._paragraphs(list(objects[key])))
        out.append((key, title, train, held))
    return out


def austen_heldout(source: str, work: Path) -> list[tuple[str, str]]:
    """(title, held-out text) for each novel: text the demo model never trained on."""
    return [(title, "\n".join(held) + "\n") for _key, title, _train, held in austen_novels(source, work)]
