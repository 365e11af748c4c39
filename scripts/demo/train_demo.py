"""Train the demo model that ships inside the Python package.

The demo model is a small Qwen3-MoE (8 experts, top-2) with a byte-level BPE
tokenizer, trained from scratch on Jane Austen's six novels as packaged by
Debian (``r-cran-janeaustenr``, MIT; the novels themselves are in the public
domain). docs/demo_model.md records the corpus, the configuration, the training
run and the results.

Everything runs on a CPU. Reproduce the shipped model end to end from the
repository root with a Python that has torch, transformers (5.x), safetensors,
tokenizers and, for the plot, matplotlib (Debian's apt-get and dpkg-deb fetch
and unpack the corpus)::

    python scripts/demo/train_demo.py all

which runs, in order::

    train_demo.py corpus      # apt-get download r-cran-janeaustenr, extract + split the novels
    train_demo.py calibration # the default calibration text of `colibri calibrate` (from the training split)
    train_demo.py tokenizer   # train the 4096-token byte-level BPE on the training split
    train_demo.py train --decay-start 275 --steps 344                 # phase 1
    train_demo.py train --extend --lr 2e-3 --warmup 20 --aux-coef 0.01 \
                        --decay-start 533 --steps 596                 # phase 2
    train_demo.py export      # best checkpoint -> Hugging Face folder .cache/demo/hf
    train_demo.py report      # held-out loss, routing, samples, reference logits, plot

then, with colibri installed::

    colibri convert .cache/demo/hf -o python/colibri/data/demo.colibri --dtype bf16 --force
    python scripts/demo/check_engine.py    # engine vs transformers, samples

Run training under ``nice``; the shipped run took 65 minutes on 2 shared cores.

``scripts/demo/train_mtp.py`` then trains the model's multi-token-prediction
head for speculative decoding (its docstring lists the commands).

Every artefact goes under ``.cache/demo/`` (git-ignored): ``corpus/`` (the
.deb, the extracted text, train/valid splits, token caches), ``tokenizer/``,
``ckpt/`` (``last.pt``, written at every evaluation so an interrupted run
still leaves a usable model and ``train`` resumes from it; ``best.pt``, the
lowest held-out loss), ``hf/`` (the exported model) and ``report/``.

Schedule. Training is one or more phases of a warmup-stable-decay schedule.
Without ``--decay-start``/``--steps`` a phase decides its decay by the clock
(``--budget-minutes``, ``--decay-frac``) and prints the numbers that rerun it
exactly; that is how the two phases above were sized (44 and 20 minute
budgets). The run is deterministic for a given machine and thread count:
fixed seeds, training windows drawn from a generator seeded with the step
number, and torch's deterministic algorithms.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "demo"
CORPUS = CACHE / "corpus"
TOKDIR = CACHE / "tokenizer"
CKPT = CACHE / "ckpt"
HF = CACHE / "hf"
REPORT = CACHE / "report"

DEB_PACKAGE = "r-cran-janeaustenr"
RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"
# The novels in the package, in publication order.
NOVELS = [
    ("sensesensibility", "Sense and Sensibility"),
    ("prideprejudice", "Pride and Prejudice"),
    ("mansfieldpark", "Mansfield Park"),
    ("emma", "Emma"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
]
HELDOUT_FRACTION = 0.05  # the last 5% of each novel's paragraphs

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
SEED = 1234

MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=192,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    intermediate_size=512,  # dense MLP size; unused, every layer is MoE
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=True,
    attention_bias=False,
    attention_dropout=0.0,
    use_sliding_window=False,
    initializer_range=0.02,
    router_aux_loss_coef=0.002,
    output_router_logits=False,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
)

# The training phases of the shipped model (see the module docstring).
SHIPPED_PHASES = [
    ["--decay-start", "275", "--steps", "344"],
    ["--lr", "2e-3", "--warmup", "20", "--aux-coef", "0.01", "--decay-start", "533", "--steps", "596"],
]

GENERATION_CONFIG = dict(
    do_sample=True,
    temperature=0.8,
    top_k=40,
    top_p=0.95,
    max_new_tokens=64,
    eos_token_id=0,
    pad_token_id=0,
)


# --------------------------------------------------------------------------- corpus


def _paragraphs(lines: list[str]) -> list[str]:
    """Join the Gutenberg line-wrapped text into paragraphs of plain prose."""
    out, cur = [], []
    for line in lines + [""]:
        line = (line or "").strip()
        if line:
            cur.append(line)
        elif cur:
            text = " ".join(cur)
            text = text.replace("_", "")  # Gutenberg's _italics_ markers
            text = re.sub(r"\s+", " ", text).strip()
            if text:
                out.append(text)
            cur = []
    return out


def split_novel(paras: list[str]) -> tuple[list[str], list[str]]:
    """(training, held-out) paragraphs of one novel: the held-out part is its
    tail, whole paragraphs, at least HELDOUT_FRACTION of the characters."""
    total = sum(len(p) for p in paras)
    cut, acc = len(paras), 0
    while cut > 0 and acc < HELDOUT_FRACTION * total:
        cut -= 1
        acc += len(paras[cut])
    return paras[:cut], paras[cut:]


def cmd_corpus(args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import rdata

    CORPUS.mkdir(parents=True, exist_ok=True)
    debs = sorted(CORPUS.glob(f"{DEB_PACKAGE}_*.deb"))
    if not debs:
        subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=CORPUS, check=True)
        debs = sorted(CORPUS.glob(f"{DEB_PACKAGE}_*.deb"))
    deb = debs[-1]
    pkg = CORPUS / "pkg"
    if pkg.exists():
        shutil.rmtree(pkg)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(pkg)], check=True)
    objects = rdata.read_lazyload(pkg / RDATA)

    books = {"train": [], "valid": []}
    stats = []
    for key, title in NOVELS:
        paras = _paragraphs(list(objects[key]))
        train, valid = split_novel(paras)
        total = sum(len(p) for p in paras)
        acc = sum(len(p) for p in valid)
        books["train"].append({"title": title, "paragraphs": train})
        books["valid"].append({"title": title, "paragraphs": valid})
        stats.append((title, len(paras), total, total - acc, acc))
    for split, items in books.items():
        (CORPUS / f"{split}.json").write_text(json.dumps(items, ensure_ascii=False))
        with open(CORPUS / f"{split}.txt", "w", encoding="utf-8") as f:
            for book in items:
                f.write("\n".join(book["paragraphs"]) + "\n")
    info = {
        "package": DEB_PACKAGE,
        "deb": deb.name,
        "sha256": _sha256(deb),
        "novels": [
            {"title": t, "paragraphs": n, "chars": c, "train_chars": tr, "valid_chars": va}
            for t, n, c, tr, va in stats
        ],
    }
    (CORPUS / "info.json").write_text(json.dumps(info, indent=2))
    for t, n, c, tr, va in stats:
        print(f"{t:24s} {n:6d} paragraphs {c:9d} chars  train {tr:9d}  valid {va:7d}")


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------ tokenizer


CALIBRATION_TEXT = ROOT / "python" / "colibri" / "data" / "calibration.txt"
CALIBRATION_CHARS = 12_000  # per novel: about 3,000 demo tokens each, 18k in all


def cmd_calibration(args) -> None:
    """The default calibration text of `colibri calibrate` (shipped in the
    package): from each novel's training split, whole paragraphs starting
    40% of the way in, until CALIBRATION_CHARS characters. Training text,
    never the held-out tails that scripts/accuracy.py measures on."""
    books = json.loads((CORPUS / "train.json").read_text(encoding="utf-8"))
    out = []
    for book in books:
        paras = book["paragraphs"]
        i, n = int(0.4 * len(paras)), 0
        while i < len(paras) and n < CALIBRATION_CHARS:
            out.append(paras[i])
            n += len(paras[i])
            i += 1
    CALIBRATION_TEXT.write_text("\n".join(out) + "\n", encoding="utf-8")
    print(f"wrote {CALIBRATION_TEXT} ({sum(len(p) for p in out)} characters, {len(out)} paragraphs)")


def cmd_tokenizer(args) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS],
        # All 256 byte symbols are in the vocabulary, so any UTF-8 text encodes
        # without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS / "train.txt")], trainer)
    assert tok.token_to_id(EOS) == 0
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()

    TOKDIR.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(TOKDIR)
    _finish_tokenizer_config(TOKDIR / "tokenizer_config.json")
    for stale in CORPUS.glob("*.tokens.npz"):  # token caches of an older tokenizer
        stale.unlink()

    text = (CORPUS / "valid.txt").read_text(encoding="utf-8")
    ids = tok.encode(text).ids
    assert tok.decode(ids) == _nfc(text), "round trip failed"
    print(
        f"vocab {tok.get_vocab_size()}; held-out text: {len(text)} chars -> {len(ids)} tokens "
        f"({len(text) / len(ids):.2f} chars/token)"
    )


# The model never saw a conversation: "chat" just lays the messages out as
# paragraphs of prose and lets the model continue.
CHAT_TEMPLATE = "{%- for message in messages %}{{ message['content'] | trim }}{{ '\\n' }}{%- endfor %}"


def _finish_tokenizer_config(path: Path) -> None:
    cfg = json.loads(path.read_text())
    # No BOS: text is encoded as is (like Qwen3); each novel ends with EOS.
    cfg["bos_token"] = None
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    # The class name transformers 4 and 5 both know.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _nfc(s: str) -> str:
    import unicodedata

    return unicodedata.normalize("NFC", s)


# ------------------------------------------------------------------------- data


def _load_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKDIR / "tokenizer.json"))


def _encode_split(split: str):
    """Token stream of a split and the start offset of every paragraph in it.

    Paragraphs end with a newline; each novel ends with EOS.
    """
    import numpy as np

    cache = CORPUS / f"{split}.tokens.npz"
    if cache.exists():
        z = np.load(cache)
        return z["ids"], z["starts"]
    tok = _load_tokenizer()
    books = json.loads((CORPUS / f"{split}.json").read_text())
    ids, starts = [], []
    for book in books:
        encs = tok.encode_batch([p + "\n" for p in book["paragraphs"]])
        for e in encs:
            starts.append(len(ids))
            ids.extend(e.ids)
        ids.append(0)
    ids = np.asarray(ids, dtype=np.int32)
    starts = np.asarray(starts, dtype=np.int64)
    np.savez(cache, ids=ids, starts=starts)
    return ids, starts


# ------------------------------------------------------------------------ model


def _build_model():
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    cfg = Qwen3MoeConfig(**MODEL_CONFIG)
    model = Qwen3MoeForCausalLM(cfg)
    return model


def _param_counts(model) -> dict:
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert = expert // cfg.num_experts
    active = total - expert + per_expert * cfg.num_experts_per_tok
    return {
        "total": total,
        "experts": expert,
        "active_per_token": active,
        "embedding": cfg.vocab_size * cfg.hidden_size,
    }


def _lr_at(step: int, args, sched: dict) -> float:
    """One phase of a warmup-stable-decay schedule.

    Linear warmup from ``sched["start"]`` over ``--warmup`` steps, constant
    ``--lr``, then linear decay to ``--min-lr`` from ``sched["decay_start"]`` to
    ``sched["total"]`` (both None until the run decides them).
    """
    k = step - sched["start"]
    if k < args.warmup:
        return args.lr * (k + 1) / args.warmup
    if sched["decay_start"] is None or step < sched["decay_start"]:
        return args.lr
    frac = (step - sched["decay_start"]) / max(1, sched["total"] - sched["decay_start"])
    return args.lr + (args.min_lr - args.lr) * min(1.0, frac)


def _evaluate(model, windows, batch: int) -> float:
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = windows[i : i + batch]
            out = model(input_ids=x[:, :-1])
            logp = torch.log_softmax(out.logits.float(), dim=-1)
            nll = -logp.gather(-1, x[:, 1:, None]).squeeze(-1)
            total += nll.sum().item()
            count += nll.numel()
    model.train()
    return total / count


def _heldout_windows(seq_len: int):
    """The held-out token stream cut into consecutive windows of seq_len + 1 tokens."""
    import numpy as np
    import torch

    ids, _ = _encode_split("valid")
    n = (len(ids) - 1) // seq_len
    w = [ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    return torch.tensor(np.stack(w), dtype=torch.long)


def cmd_train(args) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    CKPT.mkdir(parents=True, exist_ok=True)

    ids, starts = _encode_split("train")
    # Every 4th held-out window (all six novels) keeps evaluation cheap; the
    # report scores the whole held-out split.
    valid = _heldout_windows(args.seq_len)[:: args.eval_stride]
    print(f"train tokens {len(ids)}, paragraph starts {len(starts)}, held-out windows {len(valid)}")

    model = _build_model()
    print("parameters:", _param_counts(model))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    # A run is one or more phases. Each phase warms up, holds --lr, and decays
    # to --min-lr. The decay is either given (a rerun: --decay-start, --steps)
    # or decided once, by the clock: when (1 - decay_frac) of the phase's time
    # budget is used, the decay starts and lasts decay_frac / (1 - decay_frac)
    # times the phase's steps so far. `train` starts phase 1 (or resumes the
    # current phase from ckpt/last.pt); `train --extend` starts a new phase from
    # the end of the previous one, keeping weights and optimizer moments.
    if (args.decay_start is None) != (args.steps is None):
        raise SystemExit("give both --decay-start and --steps, or neither")
    step, history, phases, best, elapsed0 = 0, [], [], float("inf"), 0.0
    last = CKPT / "last.pt"
    if args.extend and (args.fresh or not last.exists()):
        raise SystemExit("--extend continues ckpt/last.pt; there is none to continue")
    if last.exists() and not args.fresh:
        ck = torch.load(last, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, history, best, elapsed0 = ck["step"], ck["history"], ck["best"], ck["elapsed"]
        phases = ck["phases"]
        print(f"resumed at step {step}, phases {phases}")
    aux_coef = model.config.router_aux_loss_coef if args.aux_coef is None else args.aux_coef
    if not phases or args.extend:
        phases.append(
            {
                "start": step,
                "decay_start": None,
                "total": None,
                "elapsed0": elapsed0,
                "lr": args.lr,
                "min_lr": args.min_lr,
                "warmup": args.warmup,
                "aux_coef": aux_coef,
                "budget_minutes": args.budget_minutes,
            }
        )
    sched = phases[-1]
    if args.decay_start is not None:
        sched.update(decay_start=args.decay_start, total=args.steps)
    if sched["total"] is not None and step >= sched["total"]:
        raise SystemExit(f"phase already finished at step {step}; use --extend to train further")

    def seq_len_at(s: int) -> int:
        # The decay phase trains on windows twice as long (same tokens per step)
        # so the model also knows positions up to the full context.
        if sched["decay_start"] is not None and s >= sched["decay_start"]:
            return args.long_seq_len
        return args.seq_len

    # The windows of a step are a function of the seed and the step only. They
    # start at paragraph starts so the model also learns how prose begins.
    def batch_at(s: int):
        n = seq_len_at(s)
        rows = args.batch * args.seq_len // n
        ok = starts[starts + n + 1 <= len(ids)]
        g = np.random.default_rng([SEED, s])
        pick = ok[g.integers(0, len(ok), size=rows)]
        return torch.tensor(np.stack([ids[p : p + n + 1] for p in pick]), dtype=torch.long)

    budget = args.budget_minutes * 60
    t0 = time.time() - elapsed0  # minutes are counted over the whole run
    step0, t_run = step, time.time()
    run_ce, run_aux, run_n = 0.0, 0.0, 0
    model.train()
    while sched["total"] is None or step < sched["total"]:
        el = time.time() - t0
        if sched["decay_start"] is None and el - sched["elapsed0"] >= (1 - args.decay_frac) * budget:
            done_steps = step - sched["start"]
            sched.update(
                decay_start=step, total=step + round(done_steps * args.decay_frac / (1 - args.decay_frac))
            )
            print(
                f"decay: steps {sched['decay_start']} .. {sched['total']} (rerun this phase with "
                f"--decay-start {sched['decay_start']} --steps {sched['total']})",
                flush=True,
            )
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, args, sched)
        x = batch_at(step)
        out = model(input_ids=x[:, :-1], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss = ce + aux_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        run_ce += ce.item()
        run_aux += out.aux_loss.item()
        run_n += 1

        el = time.time() - t0
        if step % args.log_every == 0:
            print(
                f"step {step:5d}  ce {run_ce / run_n:.4f}  aux {run_aux / run_n:.4f}  "
                f"lr {_lr_at(step - 1, args, sched):.2e}  seq {x.shape[1] - 1}  {el / 60:.1f} min  "
                f"{(step - step0) * args.batch * args.seq_len / (time.time() - t_run):.0f} tok/s",
                flush=True,
            )
        done = sched["total"] is not None and step >= sched["total"]
        over = args.max_minutes and el / 60 > args.max_minutes
        if step % args.eval_every == 0 or done or over:
            vl = _evaluate(model, valid, args.batch)
            el = time.time() - t0
            history.append(
                {
                    "step": step,
                    "train_loss": run_ce / max(1, run_n),
                    "aux_loss": run_aux / max(1, run_n),
                    "heldout_loss": vl,
                    "lr": _lr_at(step - 1, args, sched),
                    "minutes": el / 60,
                }
            )
            run_ce, run_aux, run_n = 0.0, 0.0, 0
            print(f"== step {step}  held-out loss {vl:.4f}  ppl {math.exp(vl):.2f}", flush=True)
            if vl < best:
                best = vl
                torch.save({"model": model.state_dict(), "step": step, "heldout_loss": vl}, CKPT / "best.pt")
            state = {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "phases": phases,
                "history": history,
                "best": best,
                "elapsed": el,
                "args": vars(args),
            }
            torch.save(state, CKPT / "last.tmp")
            os.replace(CKPT / "last.tmp", last)
            (CKPT / "history.json").write_text(
                json.dumps({"phases": phases, "args": vars(args), "history": history}, indent=1)
            )
        if over:
            print(f"stopping at step {step}: past --max-minutes {args.max_minutes}")
            break
    print(
        f"done: step {step}, {(time.time() - t0) / 60:.1f} min, best held-out loss {best:.4f} "
        f"(ppl {math.exp(best):.2f}), phases {phases}"
    )


# ------------------------------------------------------------------------ export


def cmd_export(args) -> None:
    import torch
    from transformers import GenerationConfig

    ck = torch.load(CKPT / f"{args.which}.pt", weights_only=False)
    model = _build_model()
    model.load_state_dict(ck["model"])
    if HF.exists():
        shutil.rmtree(HF)
    model.save_pretrained(HF)
    GenerationConfig(**GENERATION_CONFIG).save_pretrained(HF)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKDIR / name, HF / name)
    print(f"exported {args.which}.pt (step {ck['step']}) to {HF}")
    for p in sorted(HF.iterdir()):
        print(f"  {p.name:28s} {p.stat().st_size:10d}")


# ------------------------------------------------------------------------ report


def cmd_report(args) -> None:
    import numpy as np
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    REPORT.mkdir(parents=True, exist_ok=True)
    model = Qwen3MoeForCausalLM.from_pretrained(HF, dtype=torch.float32).eval()
    tok = _load_tokenizer()
    counts = _param_counts(model)
    seq_len = args.seq_len

    # Held-out loss over the whole held-out split.
    valid = _heldout_windows(seq_len)
    vl = _evaluate(model, valid, args.batch)
    vl_long = _evaluate(model, _heldout_windows(2 * seq_len), max(1, args.batch // 2))
    ids, _ = _encode_split("valid")
    text_chars = len((CORPUS / "valid.txt").read_text(encoding="utf-8"))
    n_pred = valid.shape[0] * seq_len

    # Routing: which experts each layer picks over the held-out text.
    E, K, L = model.config.num_experts, model.config.num_experts_per_tok, model.config.num_hidden_layers
    hist = np.zeros((L, E), dtype=np.int64)
    with torch.no_grad():
        for i in range(0, len(valid), args.batch):
            out = model(input_ids=valid[i : i + args.batch, :-1], output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                top = torch.topk(torch.softmax(logits.float(), -1), K, dim=-1).indices
                hist[layer] += np.bincount(top.flatten().numpy(), minlength=E)
    frac = hist / hist.sum(axis=1, keepdims=True)
    ent = -(frac * np.log(np.where(frac > 0, frac, 1))).sum(axis=1)

    # Reference logits for the engine parity check (check_engine.py).
    seqs = [valid[j, :n].tolist() for j, n in ((0, 64), (len(valid) // 2, 200), (len(valid) - 1, 256))]
    # Two references: the f32 model, and the same model with every weight
    # matrix rounded to bf16 (what a --dtype bf16 file holds; norms and the
    # router stay f32 in colibri, as here).
    rounded = Qwen3MoeForCausalLM.from_pretrained(HF, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.ndim >= 2 and not name.endswith("gate.weight"):
                p.copy_(p.to(torch.bfloat16).float())
        ref = [model(input_ids=torch.tensor([s])).logits[0].numpy() for s in seqs]
        ref_bf16 = [rounded(input_ids=torch.tensor([s])).logits[0].numpy() for s in seqs]
    del rounded
    np.savez(
        REPORT / "reference_logits.npz",
        **{f"ids{i}": np.asarray(s, dtype=np.int64) for i, s in enumerate(seqs)},
        **{f"logits{i}": r for i, r in enumerate(ref)},
        **{f"logits_bf16_{i}": r for i, r in enumerate(ref_bf16)},
    )

    # Samples from transformers, for comparison with the engine's.
    prompt = "Once upon a time"
    pid = torch.tensor([tok.encode(prompt).ids])
    samples = {}
    with torch.no_grad():
        g = model.generate(pid, max_new_tokens=48, do_sample=False)
        samples["greedy"] = tok.decode(g[0].tolist())
        for seed in (1, 2, 3):
            torch.manual_seed(seed)
            g = model.generate(pid, max_new_tokens=48, do_sample=True, temperature=0.8, top_k=40, top_p=0.95)
            samples[f"sampled seed {seed}"] = tok.decode(g[0].tolist())

    hist_file = CKPT / "history.json"
    run = json.loads(hist_file.read_text()) if hist_file.exists() else {"history": []}
    history = run["history"]
    report = {
        "parameters": counts,
        "heldout": {
            "loss": vl,
            "perplexity": math.exp(vl),
            "tokens_scored": n_pred,
            "chars_per_token": text_chars / len(ids),
            "bits_per_char": vl / math.log(2) / (text_chars / len(ids)),
            f"loss_windows_of_{2 * seq_len}": vl_long,
        },
        "routing": {
            "counts": hist.tolist(),
            "fraction": frac.round(4).tolist(),
            "entropy": ent.round(4).tolist(),
            "log_E": math.log(E),
        },
        "samples": samples,
        "phases": run.get("phases"),
        "train_args": run.get("args"),
        "history": history,
    }
    (REPORT / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(json.dumps({k: v for k, v in report.items() if k != "history"}, indent=1, ensure_ascii=False))

    if history:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not available; no plot")
            return
        fig, ax = plt.subplots(figsize=(5.5, 3.2), dpi=110)
        steps = [h["step"] for h in history]
        ax.plot(steps, [h["train_loss"] for h in history], label="train (mean since last eval)")
        ax.plot(steps, [h["heldout_loss"] for h in history], label="held-out")
        for ph in run.get("phases") or []:
            if ph["start"] > 0:
                ax.axvline(ph["start"], color="grey", ls="--", lw=0.8)
            if ph["decay_start"] is not None:
                ax.axvspan(ph["decay_start"], ph["total"], color="grey", alpha=0.12, lw=0)
        ax.set_xlabel("step (shaded: learning-rate decay; dashed: new phase)")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title("colibri demo model: Qwen3-MoE on Jane Austen")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(ROOT / "docs" / "demo_loss.png")
        print("wrote docs/demo_loss.png")


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("corpus")
    sub.add_parser("calibration")
    sub.add_parser("tokenizer")
    sub.add_parser("all")
    p = sub.add_parser("train")
    p.add_argument(
        "--budget-minutes",
        type=float,
        default=44.0,
        help="wall-clock budget that decides when the decay phase starts",
    )
    p.add_argument("--decay-frac", type=float, default=0.2)
    p.add_argument("--decay-start", type=int, default=None, help="rerun: step the decay starts at")
    p.add_argument("--steps", type=int, default=None, help="rerun: total steps")
    p.add_argument("--batch", type=int, default=8, help="rows of --seq-len tokens per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--long-seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-stride", type=int, default=4)
    p.add_argument("--max-minutes", type=float, default=0.0, help="hard stop (0: none)")
    p.add_argument("--fresh", action="store_true", help="ignore ckpt/last.pt")
    p.add_argument("--extend", action="store_true", help="start a new phase after ckpt/last.pt")
    p.add_argument(
        "--aux-coef",
        type=float,
        default=None,
        help="load-balancing loss weight (default: the config's router_aux_loss_coef)",
    )
    p = sub.add_parser("export")
    p.add_argument("--which", default="best", choices=["best", "last"])
    p = sub.add_parser("report")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()

    if args.cmd == "all":
        cmd_corpus(args)
        cmd_tokenizer(args)
        for phase in SHIPPED_PHASES:
            cmd_train(
                ap.parse_args(["train", "--fresh" if phase is SHIPPED_PHASES[0] else "--extend", *phase])
            )
        cmd_export(ap.parse_args(["export"]))
        cmd_report(ap.parse_args(["report"]))
    else:
        {
            "corpus": cmd_corpus,
            "calibration": cmd_calibration,
            "tokenizer": cmd_tokenizer,
            "train": cmd_train,
            "export": cmd_export,
            "report": cmd_report,
        }[args.cmd](args)


if __name__ == "__main__":
    main()
