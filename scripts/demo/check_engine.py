"""Check the converted demo model with the colibri engine.

Run it in the environment where colibri is installed (it needs numpy and the
``tokenizers`` package, not torch), after ``train_demo.py report`` has written
``.cache/demo/report/reference_logits.npz``::

    python scripts/demo/check_engine.py [MODEL.colibri ...]

For every model file (default: the shipped ``python/colibri/data/demo.colibri``)
it prints

* the largest absolute logit difference against transformers in f32, and
  against transformers with the weight matrices rounded to bf16 (the fair
  reference for a bf16 file), on three held-out sequences, and whether the
  argmax agrees at every position;
* a greedy continuation of "Once upon a time" (and whether it equals the
  greedy continuation transformers produced in the report) and three sampled
  ones, decoded with the demo tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

import colibri

ROOT = Path(__file__).resolve().parents[2]
REF = ROOT / ".cache" / "demo" / "report" / "reference_logits.npz"
REPORT = ROOT / ".cache" / "demo" / "report" / "report.json"
TOKENIZER = ROOT / ".cache" / "demo" / "hf" / "tokenizer.json"
DEFAULT = ROOT / "python" / "colibri" / "data" / "demo.colibri"


def main(paths: list[str]) -> None:
    ref = np.load(REF)
    hf_greedy = json.loads(REPORT.read_text())["samples"]["greedy"]
    tok = Tokenizer.from_file(str(TOKENIZER))
    n = len([k for k in ref.files if k.startswith("ids")])
    for path in paths or [str(DEFAULT)]:
        engine = colibri.Engine(path)
        print(f"== {engine}")
        for i in range(n):
            ids = ref[f"ids{i}"]
            got = engine.logits(ids)
            for name in (f"logits{i}", f"logits_bf16_{i}"):
                want = ref[name]
                diff = np.abs(got - want)
                span = float(want.max() - want.min())
                agree = float((got.argmax(-1) == want.argmax(-1)).mean())
                print(
                    f"  seq {i} ({len(ids):3d} tokens) vs {name:14s} max |diff| {diff.max():.2e} "
                    f"(mean {diff.mean():.1e}, {diff.max() / span:.1e} of the logit range), "
                    f"argmax agreement {agree:.3f}"
                )
        prompt = tok.encode("Once upon a time").ids
        # Token ids in and out, decoded here; temperature=0 is greedy (left
        # out, the engine samples with the model's generation_config defaults).
        out = engine.generate(prompt, max_new_tokens=48, temperature=0.0)
        text = tok.decode(prompt + list(out))
        same = "same as transformers" if text == hf_greedy else "DIFFERS from transformers"
        print(f"  greedy ({same}): {text!r}")
        for seed in (1, 2, 3):
            out = engine.generate(prompt, max_new_tokens=48, temperature=0.8, top_k=40, top_p=0.95, seed=seed)
            print(f"  T=0.8 top_k=40 top_p=0.95 seed {seed}: {tok.decode(prompt + list(out))!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
