"""The command line, run as a user would: a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import GOLDEN


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", *args], capture_output=True, text=True, timeout=120
    )


def test_convert_then_info(tmp_path):
    out = tmp_path / "m.colibri"
    r = run("convert", str(GOLDEN / "qwen2_moe"), "-o", str(out), "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "bf16" in r.stdout
    r = run("info", str(out))
    assert r.returncode == 0, r.stderr
    assert "Qwen2MoeForCausalLM" in r.stdout and "active per token" in r.stdout
    assert "\nkernels " in r.stdout and "COLIBRI_ISA" in r.stdout


def test_kernel_table_is_reported_and_colibri_isa_is_followed():
    code = "import json, colibri; print(json.dumps(colibri.kernels()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    best = json.loads(r.stdout)
    assert best["active"] == best["available"][-1] and best["available"][0] == "scalar"
    env = {**os.environ, "COLIBRI_ISA": "scalar"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert json.loads(r.stdout)["active"] == "scalar" and r.stderr == ""
    env["COLIBRI_ISA"] = "sse9"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert json.loads(r.stdout)["active"] == best["active"]
    assert "COLIBRI_ISA=sse9 is not one of" in r.stderr


def test_existing_output_is_a_one_line_error(tmp_path):
    out = tmp_path / "m.colibri"
    out.write_text("keep me")
    r = run("convert", str(GOLDEN / "mixtral"), "-o", str(out))
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "already exists" in r.stderr
    assert "Traceback" not in r.stderr
    assert out.read_text() == "keep me"
    r = run("convert", str(GOLDEN / "mixtral"), "-o", str(out), "--force", "-q")
    assert r.returncode == 0 and r.stdout == ""


def test_bad_file_and_bad_arguments(tmp_path):
    r = run("info", str(tmp_path / "nope.colibri"))
    assert r.returncode == 1 and "no such file" in r.stderr and "Traceback" not in r.stderr
    r = run("convert", str(GOLDEN / "mixtral"))
    assert r.returncode == 2 and "--output" in r.stderr
    r = run("convert", "--help")
    assert r.returncode == 0 and "--dtype" in r.stdout


# ---------------------------------------------------------------------------
# generate, chat, info, help


def run_in(args: list[str], stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
        env=dict(env or os.environ, PYTHONIOENCODING="utf-8"),
        encoding="utf-8",
    )


def one_line_error(r: subprocess.CompletedProcess, status: int, needle: str) -> None:
    assert r.returncode == status, (r.returncode, r.stderr)
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", [[], ["convert"], ["generate"], ["chat"], ["info"]])
def test_every_command_has_help(command):
    r = run(*command, "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: colibri")
    if command == ["generate"] or command == ["chat"]:
        for flag in ("--demo", "--temperature", "--top-k", "--top-p", "--min-p", "--seed", "--stop"):
            assert flag in r.stdout
    if command == ["info"]:
        assert "--tensors" in r.stdout


def test_generate_streams_what_the_api_returns(llama):
    path = llama.path
    opts = dict(max_new_tokens=12, ignore_eos=True)
    want = llama.generate("Once upon a time", **opts)
    r = run_in(["generate", path, "Once upon a time", "-n", "12", "--ignore-eos"])
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n" and r.stderr == ""
    # The prompt from stdin (without echo's newline); options after the prompt.
    r = run_in(["generate", path, "-n", "12", "--ignore-eos"], stdin="Once upon a time\n")
    assert r.returncode == 0 and r.stdout == want + "\n"
    r = run_in(["generate", path, "-", "--ignore-eos", "-n", "12", "--echo"], stdin="Once upon a time")
    assert r.stdout == "Once upon a time" + want + "\n"


def test_generate_sampling_flags_and_verbose(llama):
    flags = dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.01, repetition_penalty=1.1, seed=11)
    flags.update(presence_penalty=0.2, frequency_penalty=0.1, max_new_tokens=15)
    argv = ["generate", llama.path, "The bird", "--ignore-eos", "-v"]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    r = run_in(argv)
    assert r.returncode == 0, r.stderr
    assert r.stdout == llama.generate("The bird", ignore_eos=True, **flags) + "\n"
    assert "prompt" in r.stderr and "tok/s" in r.stderr and "finish: length" in r.stderr
    full = llama.generate("The bird", max_new_tokens=20, ignore_eos=True)
    stop = full[5:8]
    r = run_in(["generate", llama.path, "The bird", "-n", "20", "--ignore-eos", "--stop", stop, "-v"])
    assert r.stdout == full[: full.find(stop)] + "\n"
    assert "stop string" in r.stderr


def test_generate_from_a_checkpoint_folder_uses_the_cache(tmp_path, llama):
    from conftest import make_text_checkpoint

    src = make_text_checkpoint("mixtral", tmp_path / "hf", "llama")
    env = dict(os.environ, COLIBRI_CACHE=str(tmp_path / "cache"))
    for _ in range(2):
        r = run_in(["generate", str(src), "Once upon a time", "-n", "6", "--ignore-eos"], env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout == llama.generate("Once upon a time", max_new_tokens=6, ignore_eos=True) + "\n"
    assert len(list((tmp_path / "cache").glob("*.colibri"))) == 1


def test_generate_errors_are_one_line(tmp_path, converted, llama):
    one_line_error(run_in(["generate", str(converted("mixtral")), "hello"]), 1, "no tokenizer")
    one_line_error(run_in(["generate"]), 2, "give a model")
    one_line_error(run_in(["generate", llama.path], stdin=""), 2, "prompt is empty")
    one_line_error(run_in(["generate", llama.path, "hi", "--top-p", "3"]), 1, "top_p")
    one_line_error(run_in(["generate", llama.path, "hi", "--temperature", "warm"]), 2, "--temperature")
    one_line_error(run_in(["generate", llama.path, "hi", "--bogus"]), 2, "--bogus")
    one_line_error(run_in(["generate", llama.path, "a", "b"]), 2, "too many arguments")
    one_line_error(run_in(["generate", str(tmp_path / "nope.colibri"), "hi"]), 1, "no such file")
    junk = tmp_path / "junk.colibri"
    junk.write_bytes(b"\0" * 64)
    one_line_error(run_in(["generate", str(junk), "hi"]), 1, "magic")
    one_line_error(run_in(["chat", str(converted("mixtral"))]), 1, "no chat template")
    one_line_error(run_in(["info"]), 2, "model")


def test_chat_keeps_the_history(chatml):
    opts = dict(max_new_tokens=8, ignore_eos=True)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    first = chatml.chat(history, **opts)
    history += [{"role": "assistant", "content": str(first)}, {"role": "user", "content": "and then?"}]
    second = chatml.chat(history, **opts)
    r = run_in(
        ["chat", chatml.path, "--system", "Be brief.", "-n", "8", "--ignore-eos", "-v"],
        stdin="hello\n\nand then?\n",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{first}\n{second}\n"
    # -v reports each turn; the second prompt holds the whole conversation.
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[prompt")]
    n_tokens = len(chatml.tokenize(chatml.apply_chat_template(history), add_special_tokens=False))
    assert len(lines) == 2 and lines[1].startswith(f"[prompt {n_tokens} tokens")
    # /reset forgets it.
    r = run_in(
        ["chat", chatml.path, "-n", "8", "--ignore-eos"], stdin="hello\n/reset\nhello\n/exit\nignored\n"
    )
    alone = chatml.chat([{"role": "user", "content": "hello"}], **opts)
    assert r.stdout == f"{alone}\n{alone}\n"


def test_info_lists_tensors(llama):
    r = run_in(["info", llama.path, "--tensors"])
    assert r.returncode == 0, r.stderr
    for key in ("architecture", "weights", "active per token", "context", "tokenizer", "chat template"):
        assert key in r.stdout
    assert str(llama.context_length) in r.stdout
    names = [name for name, _, _, _ in llama.tensors()]
    listed = [ln.split()[0] for ln in r.stdout.split("\ntensor", 1)[1].splitlines()[1:] if ln.strip()]
    assert listed == names
    r = run_in(["info", llama.path, "--json", "--tensors"])
    info = json.loads(r.stdout)
    assert info["file_bytes"] == os.path.getsize(llama.path) == llama.file_size
    assert [t["name"] for t in info["tensors"]] == names
    assert info["parameters"]["total"] > info["parameters"]["active_per_token"] > 0


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_ctrl_c_while_waiting_for_input_exits_cleanly(llama, command):
    p = subprocess.Popen(
        [sys.executable, "-m", "colibri", command, llama.path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(1.5)  # started and blocked reading stdin
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_interactive_chat_in_a_terminal(chatml):
    """A real terminal: the >>> prompt, a reply, Ctrl-C cutting nothing, Ctrl-D leaving."""
    main, sub = os.openpty()
    p = subprocess.Popen(
        [sys.executable, "-m", "colibri", "chat", chatml.path, "-n", "6", "--ignore-eos"],
        stdin=sub,
        stdout=sub,
        stderr=sub,
        close_fds=True,
    )
    os.close(sub)
    seen = b""

    def read_until(token: bytes, timeout: float = 30) -> bytes:
        nonlocal seen
        end = time.time() + timeout
        while token not in seen and time.time() < end:
            try:
                seen += os.read(main, 4096)
            except OSError:
                break
        assert token in seen, seen
        before, _, seen = seen.partition(token)
        return before

    read_until(b">>> ")
    os.write(main, b"hello\n")
    reply = read_until(b">>> ").decode("utf-8", "replace")
    want = chatml.chat([{"role": "user", "content": "hello"}], max_new_tokens=6, ignore_eos=True)
    assert reply.replace("\r\n", "\n").strip("\n").endswith(str(want).strip("\n").replace("\r\n", "\n"))
    os.write(main, b"\x04")  # Ctrl-D
    assert p.wait(timeout=30) == 0
    os.close(main)


def test_info_tells_attention_kind_kv_bytes_and_source(tmp_path):
    out = tmp_path / "ds.colibri"
    assert run("convert", str(GOLDEN / "deepseek_v3"), "-o", str(out)).returncode == 0
    r = run_in(["info", str(out), "--json"])
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    cfg = json.loads((GOLDEN / "deepseek_v3" / "config.json").read_text())
    assert info["attention"].startswith("MLA")
    assert f"latent {cfg['kv_lora_rank']}" in info["attention"]
    # The latent and the rotated key per layer, f32 (an unquantised model).
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    per_token = cfg["num_hidden_layers"] * width * 4
    assert info["kv_cache"] == {"dtype": "f32", "bytes_per_token": per_token, "bytes_per_sequence": 0}
    assert info["source_format"] == cfg.get("torch_dtype", cfg.get("dtype", "unknown"))
    # Every tensor is counted once; three of nine experts are active per MoE layer.
    assert info["parameters"]["total"] > info["parameters"]["active_per_token"]
    gpt = tmp_path / "g.colibri"
    assert run("convert", str(GOLDEN / "gpt_oss_mxfp4"), "-o", str(gpt)).returncode == 0
    r = run_in(["info", str(gpt)])
    assert r.returncode == 0, r.stderr
    assert "sinks" in r.stdout and "sliding window" in r.stdout and "mxfp4" in r.stdout


def test_info_tells_the_mamba2_state_per_sequence(tmp_path):
    out = tmp_path / "n.colibri"
    assert run("convert", str(GOLDEN / "nemotron_h"), "-o", str(out)).returncode == 0
    r = run_in(["info", str(out), "--json"])
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["attention"].startswith("Mamba2 on 3 of 5 layers (6 heads x 8, 2 groups, state 16, conv 4)")
    # Per Mamba2 layer, float32: the convolution's last 3 inputs of 48 + 2·2·16 channels and 6 [16, 8]
    # states; per attention layer and token, 2 kv heads of 12 keys and 12 values.
    assert info["kv_cache"]["bytes_per_sequence"] == 3 * (3 * 112 + 6 * 16 * 8) * 4
    assert info["kv_cache"]["bytes_per_token"] == 2 * 2 * 24 * 4


def test_info_tells_deepseek_v4s_pooled_state_by_piece(tmp_path):
    out = tmp_path / "v4.colibri"
    assert run("convert", str(GOLDEN / "deepseek_v4"), "-o", str(out)).returncode == 0
    r = run_in(["info", str(out), "--json"])
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["attention"].startswith("pooled") and "1 heavy layers" in info["attention"]
    kv = info["kv_cache"]
    pieces = kv["pooled_pieces"]
    # Fixture: head_dim 16, index_head_dim 10, window 6; layers heavy (8), light (4), window, light (4).
    assert pieces["window"] == {"per_token": 0, "per_sequence": 4 * 4 * 6 * 16}
    assert pieces["pool_entries"]["per_token"] == 16 * 4 // 8 + 2 * (16 * 4 // 4)
    assert pieces["index_keys"]["per_token"] == 2 * (10 * 4 // 4)
    # The pieces are the whole state: the engine's own totals.
    assert kv["bytes_per_token"] == sum(p["per_token"] for p in pieces.values())
    assert kv["bytes_per_sequence"] == sum(p["per_sequence"] for p in pieces.values())
    r = run_in(["info", str(out)])
    assert r.returncode == 0 and "pooled state" in r.stdout and "index_keys" in r.stdout


def test_mmap_flag_sets_where_the_weights_live():
    base = ["stats", "--demo", "Emma was", "--max-new-tokens", "2"]
    r = run(*base, "--mmap", "off")
    assert r.returncode == 0, r.stderr
    assert "weights: copied, as asked" in r.stdout
    r = run(*base, "--mmap", "on")
    assert r.returncode == 0, r.stderr
    assert "weights: mapped, as asked" in r.stdout
    r = run(*base, "--mmap", "sideways")
    assert r.returncode != 0 and "--mmap" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--replicas", "2"], "--replicas needs --ray"),
        (["--autoscale", "1:2"], "--autoscale needs --ray"),
        (["--threads-per-replica", "2"], "--threads-per-replica needs --ray"),
        (["--ray", "--replicas", "2", "--autoscale", "1:2"], "not both"),
        (["--ray", "--replicas", "0"], "--replicas must be at least 1"),
        (["--stages", "2"], "--stages needs --ray"),
        (["--ray", "--stages", "0"], "--stages must be at least 1"),
        (["--ray", "--stages", "2", "--ram", "1GB"], "give no --ram, or serve a folder of stage files"),
        (["--ray", "--threads-per-replica", "0"], "--threads-per-replica must be at least 1"),
        (["--ray", "--autoscale", "4"], "MIN:MAX"),
        (["--ray", "--autoscale", "3:2"], "MIN <= MAX"),
        (["--ray", "--autoscale", "0:0"], "MAX >= 1"),
        (["--ray", "--threads", "2"], "--threads-per-replica instead of --threads"),
    ],
)
def test_serve_ray_flags_are_checked_before_anything_starts(flags, needle, capsys):
    from colibri.cli import main

    assert main(["serve", "--demo", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("colibri serve: error:") and err.count("\n") == 1


def test_serve_ray_without_ray_names_the_extra(monkeypatch, capsys):
    from colibri.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert main(["serve", "--demo", "--ray"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'colibri-moe[ray]'" in err and err.count("\n") == 1
