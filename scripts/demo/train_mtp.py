"""Train the demo model's multi-token-prediction (MTP) head.

The head drafts tokens for speculative decoding: from the main model's final
hidden state at position i (after its final norm, what lm_head reads) and the
embedding of the token at i + 1, it predicts the token at i + 2. Its layout is
the one Qwen3-Next and Qwen3.5 checkpoints use on the Hub, applied to the demo's
Qwen3-MoE (config.json gains ``"mtp_num_hidden_layers": 1``):

    x_i      = mtp.fc([pre_fc_norm_embedding(embed(t_{i+1})) ; pre_fc_norm_hidden(h_i)])
    y        = mtp.layers.0(x)          # one Qwen3-MoE decoder layer, causal, RoPE position i
    logits_i = lm_head(mtp.norm(y_i))   # the main model's (tied) embedding

``mtp.fc`` is [D, 2D] without bias (embedding half first), the three norms are
plain RMSNorms, and ``mtp.layers.0.*`` is named like ``model.layers.{l}.*``
(per-expert Hub names). At inference a second draft step feeds
``mtp.norm(y)`` back as the hidden state with the previous draft token; this
script trains the first step only.

The main model stays frozen. Training distils it: the target of logits_i is
the main model's own distribution at position i + 1 (which predicts
t_{i+2}), because a greedy draft is accepted exactly when it equals the main
model's argmax there. Everything runs in fp32 on the main model as the shipped
bf16 file holds it (weight matrices rounded to bf16; norms and routers f32).

From the repository root, with the Python of train_demo.py (torch,
transformers 5.x, safetensors, tokenizers)::

    python scripts/demo/train_demo.py corpus      # the corpus and its split, if not there
    python scripts/demo/train_mtp.py hf           # .cache/demo/hf + tokenizer from demo.colibri
    nice -n 10 python scripts/demo/train_mtp.py train   # ~25 min, then export + report

and, where colibri is installed (needs numpy only)::

    python scripts/demo/train_mtp.py check        # engine logits vs transformers on the rebuilt folder

and ``train_mtp.py verify`` (numpy and safetensors only) recomputes the
reference below with an independent float64 NumPy forward pass.

``hf`` is only needed when ``.cache/demo/hf`` does not exist (the full
pipeline of train_demo.py exports it); it rebuilds the Hugging Face folder from
the shipped file, whose matrices are the bf16-rounded trained weights.

``train`` sizes its learning-rate decay by the clock (``--budget-minutes``)
and prints the ``--decay-start``/``--steps`` that rerun it exactly; the run is
deterministic for a given machine and thread count (seeded initialisation,
windows drawn from a generator seeded with the step number, torch's
deterministic algorithms). It then writes

* ``.cache/demo/hf-mtp/``: the main model's tensors (bit-exact with the
  shipped file once converted to bf16) plus the ``mtp.*`` tensors, every one
  rounded to bf16 so a bf16 conversion holds exactly the weights measured;
* ``.cache/demo/report/mtp.json``: held-out agreement with the main model's
  argmax (the expected acceptance of a first greedy draft), accuracy against
  the true token two ahead, KL, the training history;
* ``.cache/demo/report/mtp_reference.npz``: ``ids`` (64 held-out tokens) and
  ``logits`` [63, V], the MTP logits of positions 0..62 teacher-forced, in
  fp32 from the bf16 weights, for the engine's test.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_demo as td  # noqa: E402

DEMO_FILE = td.ROOT / "python" / "colibri" / "data" / "demo.colibri"
HF_MTP = td.CACHE / "hf-mtp"
MTP_CKPT = td.CKPT / "mtp"
HF_CHECK = td.REPORT / "hf_check.npz"
REFERENCE_TOKENS = 64


# ------------------------------------------------------------ hf from demo.colibri


def _read_colibri(path: Path):
    """(metadata, {name: f32 array}) of a .colibri file holding f32/bf16 tensors."""
    import numpy as np

    raw = path.read_bytes()
    magic, version, flags, meta_len, data_off = struct.unpack_from("<8sIIQQ", raw, 0)
    assert magic == b"COLIBRI\0" and version == 1 and flags == 0, (magic, version, flags)
    meta = json.loads(raw[32 : 32 + meta_len])
    out = {}
    for t in meta["tensors"]:
        buf = raw[data_off + t["offset"] : data_off + t["offset"] + t["nbytes"]]
        if t["dtype"] == "f32":
            a = np.frombuffer(buf, dtype="<f4").copy()
        elif t["dtype"] == "bf16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"{t['name']}: dtype {t['dtype']} not handled")
        out[t["name"]] = a.reshape(t["shape"])
    return meta, out


def _hub_name(name: str) -> str:
    """The Qwen3-MoE Hub name of a .colibri tensor name."""
    fixed = {
        "embed": "model.embed_tokens.weight",
        "final_norm": "model.norm.weight",
        "lm_head": "lm_head.weight",
    }
    if name in fixed:
        return fixed[name]
    _, layer, rest = name.split(".", 2)
    p = f"model.layers.{layer}"
    parts = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn.wq": "self_attn.q_proj",
        "attn.wk": "self_attn.k_proj",
        "attn.wv": "self_attn.v_proj",
        "attn.wo": "self_attn.o_proj",
        "attn.q_norm": "self_attn.q_norm",
        "attn.k_norm": "self_attn.k_norm",
        "moe.router": "mlp.gate",
    }
    if rest in parts:
        return f"{p}.{parts[rest]}.weight"
    if rest.startswith("moe.experts."):
        _, _, e, which = rest.split(".")
        return f"{p}.mlp.experts.{e}.{which}_proj.weight"
    raise SystemExit(f"no Hub name for {name}")


def cmd_hf(args) -> None:
    """Rebuild .cache/demo/hf (and the tokenizer folder) from the shipped file."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    meta, tensors = _read_colibri(DEMO_FILE)
    src = meta["source"]
    td.HF.mkdir(parents=True, exist_ok=True)
    td.TOKDIR.mkdir(parents=True, exist_ok=True)
    state = {_hub_name(n): torch.from_numpy(a) for n, a in tensors.items()}
    # The trained checkpoint was f32 (config "dtype": "float32"); its matrices
    # come back as their bf16 roundings, norms and routers exactly.
    save_file(state, td.HF / "model.safetensors", metadata={"format": "pt"})
    (td.HF / "config.json").write_text(json.dumps(src["config"], indent=2) + "\n")
    GenerationConfig(**td.GENERATION_CONFIG).save_pretrained(td.HF)
    for d in (td.HF, td.TOKDIR):
        (d / "tokenizer.json").write_text(json.dumps(src["tokenizer"], ensure_ascii=False, indent=2))
        (d / "tokenizer_config.json").write_text(
            json.dumps(src["tokenizer_config"], indent=2, ensure_ascii=False) + "\n"
        )
    print(f"wrote {td.HF} ({len(state)} tensors) and {td.TOKDIR}")

    # Load it back with transformers: every tensor used, none missing.
    model = Qwen3MoeForCausalLM.from_pretrained(td.HF, dtype=torch.float32).eval()
    sd = model.state_dict()
    gu = sd["model.layers.0.mlp.experts.gate_up_proj"]
    F = meta["config"]["moe"]["expert_ffn_dim"]
    assert torch.equal(gu[1, :F], state["model.layers.0.mlp.experts.1.gate_proj.weight"])
    assert torch.equal(gu[1, F:], state["model.layers.0.mlp.experts.1.up_proj.weight"])
    # Logits on the first held-out window, for `check` (the engine side).
    ids = td._heldout_windows(255)[0]
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].numpy()
    td.REPORT.mkdir(parents=True, exist_ok=True)
    np.savez(HF_CHECK, ids=ids.numpy().astype(np.int64), logits=logits)
    print(f"wrote {HF_CHECK}: transformers logits of {len(ids)} held-out tokens")


def cmd_check(args) -> None:
    """Engine vs transformers on the rebuilt folder's logits (run with colibri installed)."""
    import numpy as np

    import colibri

    ref = np.load(HF_CHECK)
    got = colibri.Engine(str(DEMO_FILE)).logits(ref["ids"])
    want = ref["logits"]
    diff = np.abs(got - want)
    rel = diff.max() / np.abs(want).max()
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    print(
        f"{len(ref['ids'])} tokens: max |diff| {diff.max():.2e}, relative {rel:.1e}, "
        f"argmax agreement {agree:.4f}"
    )


# ------------------------------------------------------------------------ the head


def _build_head(config):
    """The MTP head as torch modules, named so its state dict maps onto the Hub names."""
    import torch
    from torch import nn
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRMSNorm

    D, eps = config.hidden_size, config.rms_norm_eps

    class MtpHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2 * D, D, bias=False)
            self.pre_fc_norm_embedding = Qwen3MoeRMSNorm(D, eps)
            self.pre_fc_norm_hidden = Qwen3MoeRMSNorm(D, eps)
            # layer_idx 0: the MoE/dense choice of layer 0 (every demo layer is MoE).
            self.layers = nn.ModuleList([Qwen3MoeDecoderLayer(config, 0)])
            self.norm = Qwen3MoeRMSNorm(D, eps)

        def forward(self, next_embeds, hidden, position_embeddings):
            """next_embeds, hidden: [B, T, D] -> mtp.norm(y): [B, T, D]."""
            e, h = self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)
            x = self.fc(torch.cat([e, h], -1))  # [B, T, D]: embedding half first
            # No mask: with sdpa, transformers' attention is causal over the sequence.
            y = self.layers[0](x, attention_mask=None, position_embeddings=position_embeddings)
            return self.norm(y)

    return MtpHead()


def _load_main():
    """The frozen main model as the shipped bf16 file holds it, fp32 compute."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(td.HF, dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_(False)
            # colibri keeps norms and routers f32; every other matrix is bf16.
            if p.ndim >= 2 and not name.endswith("mlp.gate.weight"):
                p.copy_(p.to(torch.bfloat16).float())
    return model


def _init_head(head, main, seed: int) -> None:
    """The last main layer's weights, fc = [0 | I] + small noise, norms at 1."""
    import torch

    D = main.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.layers[0].load_state_dict(main.model.layers[-1].state_dict())
        w = torch.cat([torch.zeros(D, D), torch.eye(D)], dim=1)
        head.fc.weight.copy_(w + 1e-3 * torch.randn(D, 2 * D, generator=g))
        for norm in (head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.norm):
            norm.weight.fill_(1.0)


def _main_pass(main, x):
    """Frozen main model on token windows x [B, T]: (h [B, T, D] post final norm, logits [B, T, V])."""
    import torch

    with torch.no_grad():
        h = main.model(input_ids=x).last_hidden_state
        return h, main.lm_head(h)


def _head_logits(head, main, x, h):
    """MTP logits [B, T-1, V] for positions 0..T-2 (row i predicts x[:, i+2])."""
    import torch

    T = x.shape[1]
    pos = torch.arange(T - 1)[None].expand(x.shape[0], -1)
    emb = main.model.embed_tokens(x[:, 1:])
    pe = main.model.rotary_emb(emb, position_ids=pos)
    return main.lm_head(head(emb, h[:, :-1], pe))


def _distill_loss(student, teacher_logits):
    """Soft cross-entropy against the teacher's distribution, per position (mean)."""
    import torch

    t = torch.softmax(teacher_logits, -1)
    return -(t * torch.log_softmax(student, -1)).sum(-1).mean()


class _Eval:
    """Held-out windows with the main model's outputs computed once."""

    def __init__(self, main, windows, batch: int) -> None:
        import torch

        self.windows, self.batch = windows, batch
        self.h, self.teacher_logp = [], []
        for i in range(0, len(windows), batch):
            h, logits = _main_pass(main, windows[i : i + batch])
            self.h.append(h)
            self.teacher_logp.append(torch.log_softmax(logits[:, 1:], -1))

    def run(self, head, main) -> dict:
        import torch

        head.eval()
        n = agree = true_hit = true_n = main_true = 0
        kl = ce_true = 0.0
        with torch.no_grad():
            for k, i in enumerate(range(0, len(self.windows), self.batch)):
                x = self.windows[i : i + self.batch]
                logp = torch.log_softmax(_head_logits(head, main, x, self.h[k]), -1)  # [B, T-1, V]
                tlogp = self.teacher_logp[k]  # main at positions 1..T-1
                draft, want = logp.argmax(-1), tlogp.argmax(-1)
                agree += (draft == want).sum().item()
                n += draft.numel()
                kl += (tlogp.exp() * (tlogp - logp)).sum().item()
                # Against the true token two ahead (rows 0..T-3).
                tgt = x[:, 2:]
                true_hit += (draft[:, :-1] == tgt).sum().item()
                main_true += (want[:, :-1] == tgt).sum().item()
                ce_true -= logp[:, :-1].gather(-1, tgt[..., None]).sum().item()
                true_n += tgt.numel()
        head.train()
        return {
            "agreement_with_main_argmax": agree / n,
            "accuracy_vs_true_next_next": true_hit / true_n,
            "main_accuracy_vs_true_next": main_true / true_n,
            "kl_main_to_mtp": kl / n,
            "ce_vs_true_next_next": ce_true / true_n,
            "positions": n,
        }


# ------------------------------------------------------------------------ training


def cmd_train(args) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    MTP_CKPT.mkdir(parents=True, exist_ok=True)

    main = _load_main()
    ids, starts = td._encode_split("train")
    valid = td._heldout_windows(args.seq_len)[:: args.eval_stride]
    evaluator = _Eval(main, valid, args.eval_batch)
    print(f"train tokens {len(ids)}, held-out windows {len(valid)} (every {args.eval_stride}th)", flush=True)

    torch.manual_seed(td.SEED)
    head = _build_head(main.config)
    _init_head(head, main, td.SEED)
    n_params = sum(p.numel() for p in head.parameters())
    print(f"MTP head: {n_params} parameters", flush=True)
    decay = [p for p in head.parameters() if p.ndim >= 2]
    no_decay = [p for p in head.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    if (args.decay_start is None) != (args.steps is None):
        raise SystemExit("give both --decay-start and --steps, or neither")
    sched = {"start": 0, "decay_start": args.decay_start, "total": args.steps}

    def batch_at(s: int):
        # Windows of seq_len + 1 tokens at paragraph starts, a function of the step only.
        n = args.seq_len + 1
        ok = starts[starts + n <= len(ids)]
        g = np.random.default_rng([td.SEED, 1000003, s])
        pick = ok[g.integers(0, len(ok), size=args.batch)]
        return torch.tensor(np.stack([ids[p : p + n] for p in pick]), dtype=torch.long)

    history = [{"step": 0, "minutes": 0.0, **evaluator.run(head, main)}]
    print(f"== step 0 (init)  {_fmt(history[-1])}", flush=True)
    best = history[-1]["agreement_with_main_argmax"]
    torch.save({"head": head.state_dict(), "step": 0}, MTP_CKPT / "best.pt")

    budget = args.budget_minutes * 60
    t0 = time.time()
    step, run_loss, run_n = 0, 0.0, 0
    head.train()
    while sched["total"] is None or step < sched["total"]:
        el = time.time() - t0
        if sched["decay_start"] is None and el >= (1 - args.decay_frac) * budget:
            sched.update(decay_start=step, total=step + round(step * args.decay_frac / (1 - args.decay_frac)))
            print(
                f"decay: steps {sched['decay_start']} .. {sched['total']} (rerun with "
                f"--decay-start {sched['decay_start']} --steps {sched['total']})",
                flush=True,
            )
        for group in opt.param_groups:
            group["lr"] = td._lr_at(step, args, sched)
        x = batch_at(step)
        h, teacher = _main_pass(main, x)
        loss = _distill_loss(_head_logits(head, main, x, h), teacher[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), args.clip)
        opt.step()
        step += 1
        run_loss += loss.item()
        run_n += 1
        el = time.time() - t0
        if step % args.log_every == 0:
            print(
                f"step {step:5d}  soft-ce {run_loss / run_n:.4f}  lr {td._lr_at(step - 1, args, sched):.2e}  "
                f"{el / 60:.1f} min  {step * args.batch * args.seq_len / el:.0f} tok/s",
                flush=True,
            )
        done = sched["total"] is not None and step >= sched["total"]
        if step % args.eval_every == 0 or done:
            m = evaluator.run(head, main)
            history.append(
                {
                    "step": step,
                    "minutes": (time.time() - t0) / 60,
                    "train_soft_ce": run_loss / run_n,
                    "lr": td._lr_at(step - 1, args, sched),
                    **m,
                }
            )
            run_loss, run_n = 0.0, 0
            print(f"== step {step}  {_fmt(m)}", flush=True)
            if m["agreement_with_main_argmax"] > best:
                best = m["agreement_with_main_argmax"]
                torch.save({"head": head.state_dict(), "step": step}, MTP_CKPT / "best.pt")
    minutes = (time.time() - t0) / 60
    run = {"args": vars(args), "schedule": sched, "minutes": minutes, "history": history}
    torch.save({"head": head.state_dict(), "step": step, "run": run}, MTP_CKPT / "last.pt")
    (MTP_CKPT / "history.json").write_text(json.dumps(run, indent=1))
    print(
        f"done: {step} steps, {minutes:.1f} min; rerun exactly with: nice -n 10 python "
        f"scripts/demo/train_mtp.py train --decay-start {sched['decay_start']} --steps {sched['total']}"
        + "".join(f" --{k} {getattr(args, k)}" for k in ("lr", "warmup") if getattr(args, k) != DEFAULTS[k]),
        flush=True,
    )
    cmd_export(args)


def _fmt(m: dict) -> str:
    return (
        f"agree {m['agreement_with_main_argmax']:.4f}  true+2 {m['accuracy_vs_true_next_next']:.4f}  "
        f"KL {m['kl_main_to_mtp']:.4f}"
    )


# ------------------------------------------------------------------------ export


def _bf16(t):
    import torch

    return t.to(torch.bfloat16).float()


def _head_hub_tensors(head, config) -> dict:
    """The head's tensors under their Hub names, per expert, each rounded to bf16."""
    out = {}
    F = config.moe_intermediate_size
    for name, t in head.state_dict().items():
        t = _bf16(t.detach()).contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            p = "mtp." + name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :F].contiguous()
                out[f"{p}{e}.up_proj.weight"] = t[e, F:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            p = "mtp." + name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out["mtp." + name] = t
    return out


def cmd_export(args) -> None:
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(args.threads)
    ck = torch.load(MTP_CKPT / f"{args.which}.pt", weights_only=False)
    last = torch.load(MTP_CKPT / "last.pt", weights_only=False)
    run = last["run"]
    main = _load_main()
    head = _build_head(main.config)
    head.load_state_dict(ck["head"])
    # The head as exported: every tensor rounded to bf16.
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(_bf16(p))
    head.eval()
    mtp_tensors = _head_hub_tensors(head, main.config)

    # Main tensors: the folder's own, with matrices rounded as the bf16 file holds them.
    main_tensors = load_file(td.HF / "model.safetensors")
    for name, t in main_tensors.items():
        if t.ndim >= 2 and not name.endswith("mlp.gate.weight"):
            main_tensors[name] = _bf16(t)
    HF_MTP.mkdir(parents=True, exist_ok=True)
    save_file({**main_tensors, **mtp_tensors}, HF_MTP / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((td.HF / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (HF_MTP / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (HF_MTP / name).write_bytes((td.HF / name).read_bytes())

    # Full held-out split.
    valid = td._heldout_windows(args.seq_len)
    metrics = _Eval(main, valid, args.eval_batch).run(head, main)
    print(f"held-out ({len(valid)} windows): {_fmt(metrics)}", flush=True)

    # The engine test's reference: one held-out window of 64 tokens.
    ids = valid[len(valid) // 3, :REFERENCE_TOKENS][None]
    with torch.no_grad():
        h, _ = _main_pass(main, ids)
        ref = _head_logits(head, main, ids, h)[0].numpy()
    np.savez(td.REPORT / "mtp_reference.npz", ids=ids[0].numpy().astype(np.int64), logits=ref)

    nbytes_bf16 = {
        "mtp": sum(2 * t.numel() for t in mtp_tensors.values()),
        "main": sum(2 * t.numel() for t in main_tensors.values()),
    }
    report = {
        "checkpoint": args.which,
        "step": ck["step"],
        "heldout": {"windows": len(valid), "window_tokens": args.seq_len + 1, **metrics},
        "parameters": {
            "mtp": sum(t.numel() for t in mtp_tensors.values()),
            "main": sum(t.numel() for t in main_tensors.values()),
        },
        "bytes_if_all_bf16": nbytes_bf16,
        "reference": {"tokens": REFERENCE_TOKENS, "window": len(valid) // 3, "rows": int(ref.shape[0])},
        "train": run,
    }
    (td.REPORT / "mtp.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "train"}, indent=1))
    print(f"wrote {HF_MTP}, {td.REPORT / 'mtp.json'}, {td.REPORT / 'mtp_reference.npz'}")


# ------------------------------------------------------------------------ verify


def cmd_verify(args) -> None:
    """Recompute mtp_reference.npz in float64 NumPy from hf-mtp's Hub-named
    tensors, independently of transformers and of the training code."""
    import numpy as np
    from safetensors.numpy import load_file

    w = {k: v.astype(np.float64) for k, v in load_file(HF_MTP / "model.safetensors").items()}
    cfg = json.loads((HF_MTP / "config.json").read_text())
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    H, Hkv, Dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    top_k = cfg["num_experts_per_tok"]

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    def rope(x):  # [T, heads, Dh], rotate-half pairs (i, i + Dh/2), position = row
        ang = np.arange(x.shape[0])[:, None] * theta ** (-np.arange(0, Dh, 2) / Dh)[None]
        cos, sin = (
            np.cos(np.concatenate([ang, ang], -1))[:, None],
            np.sin(np.concatenate([ang, ang], -1))[:, None],
        )
        return x * cos + np.concatenate([-x[..., Dh // 2 :], x[..., : Dh // 2]], -1) * sin

    def layer(x, p: str):  # x [T, D]
        T = x.shape[0]
        a = rms(x, w[p + "input_layernorm.weight"])
        q = rope(
            rms((a @ w[p + "self_attn.q_proj.weight"].T).reshape(T, H, Dh), w[p + "self_attn.q_norm.weight"])
        )
        k = rope(
            rms(
                (a @ w[p + "self_attn.k_proj.weight"].T).reshape(T, Hkv, Dh), w[p + "self_attn.k_norm.weight"]
            )
        )
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(T, Hkv, Dh)
        att = np.zeros((T, H, Dh))
        for h in range(H):
            g = h // (H // Hkv)
            s = np.where(np.tri(T, dtype=bool), q[:, h] @ k[:, g].T / np.sqrt(Dh), -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            att[:, h] = (s / s.sum(-1, keepdims=True)) @ v[:, g]
        x = x + att.reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, w[p + "post_attention_layernorm.weight"])
        score = m @ w[p + "mlp.gate.weight"].T
        prob = np.exp(score - score.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(T):
            pick = np.argsort(-prob[t])[:top_k]
            for e, g in zip(pick, prob[t, pick] / prob[t, pick].sum()):
                e_ = f"{p}mlp.experts.{e}."
                gate, up = w[e_ + "gate_proj.weight"] @ m[t], w[e_ + "up_proj.weight"] @ m[t]
                out[t] += g * (w[e_ + "down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up))
        return x + out

    ref = np.load(td.REPORT / "mtp_reference.npz")
    ids, emb = ref["ids"], w["model.embed_tokens.weight"]
    x = emb[ids]
    for i in range(cfg["num_hidden_layers"]):
        x = layer(x, f"model.layers.{i}.")
    h = rms(x, w["model.norm.weight"])
    e = rms(emb[ids[1:]], w["mtp.pre_fc_norm_embedding.weight"])
    xm = np.concatenate([e, rms(h[:-1], w["mtp.pre_fc_norm_hidden.weight"])], -1) @ w["mtp.fc.weight"].T
    logits = rms(layer(xm, "mtp.layers.0."), w["mtp.norm.weight"]) @ emb.T
    want = ref["logits"]
    d = np.abs(logits - want).max()
    print(
        f"mtp_reference.npz ({want.shape[0]} rows) vs float64 NumPy: max |diff| {d:.2e} "
        f"({d / np.abs(want).max():.1e} of the largest logit), "
        f"argmax equal {float((logits.argmax(-1) == want.argmax(-1)).mean()):.3f}"
    )


# --------------------------------------------------------------------------- main

DEFAULTS = {"lr": 2e-3, "warmup": 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("hf")
    sub.add_parser("check")
    sub.add_parser("verify")
    for name in ("train", "export"):
        p = sub.add_parser(name)
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--seq-len", type=int, default=256, help="MTP positions per window")
        p.add_argument("--eval-batch", type=int, default=16)
        p.add_argument("--which", default="last", choices=["best", "last"], help="checkpoint to export")
    p = sub.choices["train"]
    p.add_argument("--budget-minutes", type=float, default=25.0, help="clock budget that decides the decay")
    p.add_argument("--decay-frac", type=float, default=0.2)
    p.add_argument("--decay-start", type=int, default=None, help="rerun: step the decay starts at")
    p.add_argument("--steps", type=int, default=None, help="rerun: total steps")
    p.add_argument("--batch", type=int, default=8, help="windows per step")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-stride", type=int, default=4)
    args = ap.parse_args()
    os.chdir(td.ROOT)
    commands = {
        "hf": cmd_hf,
        "check": cmd_check,
        "train": cmd_train,
        "export": cmd_export,
        "verify": cmd_verify,
    }
    commands[args.cmd](args)


if __name__ == "__main__":
    main()
