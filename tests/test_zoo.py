"""The zoo: tokenizer, corpus, training command, evaluation helpers and the shipped pair."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specdecode.zoo import corpus as zcorpus
from specdecode.zoo import evaluate as zeval
from specdecode.zoo import train as ztrain
from specdecode.zoo.tokenizer import SP_WHITESPACE, Tokenizer, train_sentencepiece

from specdecode import zoo

PAIR = "pycode"
HAVE_PAIR = PAIR in zoo.available()
# A missing pair also fails test_pair_is_installed_with_the_package, so these skips hide nothing.
NO_TOKENIZER = "the pycode tokenizer is not installed"
needs_pair = pytest.mark.skipif(not HAVE_PAIR, reason="the pycode weights are not installed")


# ----------------------------------------------------------------------------- shipped pair


def test_pair_is_installed_with_the_package():
    # The weights ship inside the wheel: a missing pair is a packaging bug, not a skip.
    assert PAIR in zoo.available()
    d = zoo.path(PAIR)
    assert "site-packages" in str(d) or "dist-packages" in str(d), d
    total = sum(f.stat().st_size for f in d.rglob("*.safetensors"))
    assert 0 < total <= 25 * 2**20


def test_load_arguments_are_checked():
    with pytest.raises(ValueError, match="name"):
        zoo.load("no-such-pair")
    with pytest.raises(TypeError, match="name"):
        zoo.load(3)


@pytest.fixture(scope="module")
def pair():
    return zoo.load(PAIR)


@needs_pair
def test_pair_sizes_and_cost(pair):
    target, draft, tok = pair
    n_target = sum(p.numel() for p in {id(p): p for p in target.parameters()}.values())
    assert n_target >= 5_000_000
    assert tok.vocab_size <= 8192
    assert target.config.vocab_size == draft.config.vocab_size == tok.vocab_size
    tc = json.loads((zoo.path(PAIR) / "target" / "config.json").read_text())
    dc = json.loads((zoo.path(PAIR) / "draft" / "config.json").read_text())
    for ctx in (1, 512, tc["max_position_embeddings"]):
        assert ztrain.flops_per_token(dc, ctx) <= 0.25 * ztrain.flops_per_token(tc, ctx)


@needs_pair
def test_pair_predicts_python(pair):
    # A trained pair: low loss on a stdlib-like snippet, and the draft agrees with the target
    # on many greedy tokens (untrained models would sit near ln(8192) = 9 nats and ~0 agreement;
    # the shipped pair measures 2.53 / 2.78 nats and 53% here).
    target, draft, tok = pair
    text = (
        "import os\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n"
        "    for name in argv:\n        with open(name) as f:\n            print(f.read())\n"
        "    return 0\n\n\nif __name__ == '__main__':\n    sys.exit(main())\n"
    )
    ids = torch.tensor([tok.encode(text, bos=True)])
    with torch.no_grad():
        t = target.forward_train(ids[:, :-1])
        d = draft.forward_train(ids[:, :-1])
    t_loss = torch.nn.functional.cross_entropy(t[0], ids[0, 1:]).item()
    d_loss = torch.nn.functional.cross_entropy(d[0], ids[0, 1:]).item()
    assert t_loss < 3.0 and d_loss < 3.5 and t_loss < d_loss, (t_loss, d_loss)
    assert (t.argmax(-1) == d.argmax(-1)).float().mean().item() > 0.4


@needs_pair
def test_target_loads_in_transformers_with_same_logits(pair):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    target, _, tok = pair
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(zoo.path(PAIR) / "target"), dtype=torch.float32
    ).eval()
    ids = torch.tensor([tok.encode("def add(a, b):\n    return a + b\n", bos=True)])
    with torch.no_grad():
        ours = target.forward_train(ids)
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


@needs_pair
def test_manifest_is_shipped_and_consistent():
    m = json.loads((zoo.path(PAIR) / zcorpus.MANIFEST_NAME).read_text())
    files = m["files"]
    assert [f["path"] for f in files] == sorted(f["path"] for f in files)
    assert m["num_files"] == len(files) > 100
    h = zcorpus.Corpus(Path("."), tuple(zcorpus.CorpusFile(**f) for f in files)).combined_hash()
    assert h == m["combined_sha256"]
    assert all(zcorpus.is_heldout(f["path"]) == f["heldout"] for f in files)
    assert not any(part in zcorpus.EXCLUDED_DIRS for f in files for part in f["path"].split("/"))


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok():
    if HAVE_PAIR:
        return zoo.load_tokenizer(PAIR)
    pytest.skip(reason=NO_TOKENIZER)


@needs_pair
def test_tokenizer_round_trips_heldout_stdlib_files(tok):
    c = zcorpus.Corpus.collect()
    texts = list(c.texts(heldout=True))
    assert texts, "no held-out files found in this interpreter's stdlib"
    for text in texts:
        ids = tok.encode(text)
        assert max(ids) < tok.vocab_size
        assert tok.decode(ids) == text


@needs_pair
@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters=SP_WHITESPACE, codec="utf-8")))
def test_tokenizer_round_trips_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


@needs_pair
def test_tokenizer_keeps_indentation_and_special_ids(tok):
    code = "class A:\n\tdef f(self):\n        return  1  \n\n\n  # é ∑ 🐍\r\n"
    assert tok.decode(tok.encode(code)) == code
    ids = tok.encode(code, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3
    assert tok.decode(ids) == code  # specials are dropped
    # Indentation runs are single tokens, not one token per space.
    assert len(tok.encode("        return")) <= 2


@needs_pair
def test_tokenizer_validates(tok):
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="text"):
        tok.encode("a" + SP_WHITESPACE)
    with pytest.raises(ValueError, match="text: not valid Unicode at character 1"):
        tok.encode("a\udcffb")
    with pytest.raises(ValueError, match="ids"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="ids"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="ids"):
        tok.decode("12")  # not read as ids 1 and 2
    with pytest.raises(TypeError, match="ids"):
        tok.decode([100.9])
    with pytest.raises(TypeError, match="token_id"):
        tok.id_to_piece(2.9)
    assert tok.decode(torch.tensor(tok.encode("x = 1"))) == tok.decode(tok.encode("x = 1"))
    assert tok.id_to_piece(np.int64(5)) == tok.id_to_piece(5)
    with pytest.raises(FileNotFoundError, match="model_path"):
        Tokenizer("/nonexistent/tokenizer.model")


# ----------------------------------------------------------------------------- corpus


def _fake_stdlib(root: Path) -> Path:
    """A small tree shaped like a stdlib: real stdlib files under names in both splits."""
    src = zcorpus.stdlib_root()
    sources = [src / n for n in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py")]
    names, i = [], 0
    while sum(zcorpus.is_heldout(n) for n in names) < 1 or len(names) < 8:
        name = f"pkg{i % 3}/mod{i}.py"
        if len(names) < 8 or zcorpus.is_heldout(name):
            names.append(name)
        i += 1
    for j, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(sources[j % len(sources)].read_bytes())
    for skipped in ("site-packages/x.py", "test/test_x.py", "pkg0/tests/t.py", "pkg0/notes.txt"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("x = 1\n")
    (root / "latin1.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped
    return root


def test_corpus_collects_sorted_hashed_and_split(tmp_path):
    root = _fake_stdlib(tmp_path)
    c = zcorpus.Corpus.collect(root)
    paths = [f.path for f in c.files]
    assert paths == sorted(paths) and len(paths) >= 8
    assert not any(p.startswith(("site-packages", "test/")) or "/tests/" in p for p in paths)
    assert "latin1.py" not in paths
    assert any(f.heldout for f in c.files) and not all(f.heldout for f in c.files)
    m = c.manifest()
    assert m["combined_sha256"] == zcorpus.Corpus.collect(root).combined_hash()
    (root / paths[0]).write_text("changed = True\n")
    assert zcorpus.Corpus.collect(root).combined_hash() != m["combined_sha256"]


def test_heldout_split_depends_only_on_the_path():
    names = [f"a/b{i}.py" for i in range(2000)]
    frac = np.mean([zcorpus.is_heldout(n) for n in names])
    assert 0.02 < frac < 0.09
    assert [zcorpus.is_heldout(n) for n in names] == [zcorpus.is_heldout(n) for n in names]


def test_sentencepiece_training_is_deterministic_and_lossless(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    texts = list(zcorpus.Corpus.collect(root).texts())
    train_sentencepiece(texts, tmp_path / "a.model", vocab_size=512)
    train_sentencepiece(texts, tmp_path / "b.model", vocab_size=512)
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    t = Tokenizer(tmp_path / "a.model")
    assert t.vocab_size == 512
    unseen = "def ünïcode():\n\treturn '→ 🐍'  \n"
    for text in texts + [unseen]:
        assert t.decode(t.encode(text)) == text


# ----------------------------------------------------------------------------- training command


def _train_args(tmp_path: Path, run: str, *extra: str) -> list:
    return [
        "--model",
        "tiny",
        "--run-dir",
        str(tmp_path / run),
        "--data-dir",
        str(tmp_path / "data"),
        "--corpus-root",
        str(tmp_path / "lib"),
        "--steps",
        "8",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--warmup",
        "2",
        "--log-every",
        "2",
        "--eval-every",
        "4",
        "--eval-windows",
        "4",
        "--lr",
        "3e-3",
        *extra,
    ]


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
def test_train_command_logs_checkpoints_and_resumes_exactly(tmp_path, keep_threads, capsys):
    from safetensors.torch import load_file

    _fake_stdlib(tmp_path / "lib")
    # The command itself, as a user runs it.
    cmd = [sys.executable, "-m", "specdecode.zoo.train", *_train_args(tmp_path, "full")]
    full = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert full.returncode == 0, full.stderr
    log = [json.loads(line) for line in (tmp_path / "full" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4, 6, 8]
    assert all("train_loss" in r for r in log) and "heldout_loss" in log[-1]
    assert log[-1]["train_loss"] < log[0]["train_loss"]
    final = tmp_path / "full" / "final"
    for name in ("config.json", "model.safetensors", "tokenizer.model", "corpus_manifest.json"):
        assert (final / name).is_file(), name

    # Interrupted at step 3 and resumed: the same weights and log as the uninterrupted run.
    assert ztrain.main(_train_args(tmp_path, "part", "--stop-after", "3")) == 0
    assert not (tmp_path / "part" / "final").exists()
    capsys.readouterr()
    assert "pass --resume" in _one_line_exit_2(ztrain.main, _train_args(tmp_path, "part"), capsys)
    assert ztrain.main(_train_args(tmp_path, "part", "--resume")) == 0
    a = load_file(str(final / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)
    relog = [
        json.loads(line) for line in (tmp_path / "part" / "log.jsonl").read_text().splitlines()
    ]
    for r, q in zip(log, relog):
        assert r["step"] == q["step"] and r["train_loss"] == q["train_loss"]

    # A resume with a changed schedule is refused, naming the argument.
    capsys.readouterr()
    argv = _train_args(tmp_path, "part", "--resume", "--lr", "1e-3")
    assert "--resume: --lr was 0.003, now 0.001" in _one_line_exit_2(ztrain.main, argv, capsys)

    # Export: float16 copies of both models with the tokenizer, manifest and logs; they load.
    from specdecode.zoo import export as zexport

    out = tmp_path / "pair"
    assert zexport.main(["--target", str(final), "--draft", str(final), "--out", str(out)]) == 0
    for name in ("tokenizer.model", "corpus_manifest.json", "target_log.jsonl", "draft_log.jsonl"):
        assert (out / name).is_file(), name
    half = load_file(str(out / "target" / "model.safetensors"))
    assert all(v.dtype == torch.float16 for v in half.values())
    for k in half:
        torch.testing.assert_close(half[k], a[k].half(), atol=0, rtol=0)

    # Distillation from the trained model starts at the teacher's own weights: KL = 0.
    dist = _train_args(
        tmp_path, "dist", "--distill-from", str(final), "--init-from", str(final), "--steps", "2"
    )
    assert ztrain.main([*dist, "--log-every", "1"]) == 0
    first = json.loads((tmp_path / "dist" / "log.jsonl").read_text().splitlines()[0])
    assert first["train_loss"] == pytest.approx(0.0, abs=1e-5)


def test_train_arguments_are_checked(capsys):
    base = ["--model", "tiny", "--run-dir", "x"]
    for extra in (["--steps", "0"], ["--distill-alpha", "2"], ["--seq-len", "4096"]):
        with pytest.raises(SystemExit):
            ztrain.parse_args(base + extra)
        assert extra[0] in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ztrain.parse_args(["--model", "huge", "--run-dir", "x"])
    assert "--model" in capsys.readouterr().err


def test_lr_schedule_and_distill_loss():
    args = ztrain.parse_args(
        ["--model", "tiny", "--run-dir", "x", "--steps", "100", "--warmup", "10", "--seq-len", "8"]
    )
    lrs = [ztrain.lr_at(s, args) for s in range(100)]
    assert lrs[0] == pytest.approx(args.lr / 10) and lrs[9] == pytest.approx(args.lr)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(args.min_lr, rel=0.01)
    logits = torch.randn(2, 3, 7)
    labels = torch.randint(0, 7, (2, 3))
    assert ztrain.distill_loss(logits, logits, labels, 1.0, 2.0).item() == pytest.approx(
        0, abs=1e-6
    )
    other = torch.randn(2, 3, 7)
    assert ztrain.distill_loss(logits, other, labels, 1.0, 1.0).item() > 0
    ce = ztrain.lm_loss(logits, labels).item()
    assert ztrain.distill_loss(logits, logits, labels, 0.5, 1.0).item() == pytest.approx(ce / 2)


def test_batches_depend_only_on_seed_and_step():
    stream = torch.arange(1000)
    a = ztrain.batch_at(stream, 7, 5, 4, 16)
    assert torch.equal(a, ztrain.batch_at(stream, 7, 5, 4, 16))
    assert not torch.equal(a, ztrain.batch_at(stream, 7, 6, 4, 16))
    assert a.shape == (4, 17) and torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 16).long())


def test_flops_per_token_counts_lm_head_and_attention():
    cfg = dict(
        hidden_size=4,
        intermediate_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=2,
        num_hidden_layers=3,
        vocab_size=10,
    )
    # q 4x4, k/v 4x2 each, o 4x4, mlp 3 x 4x8, attention 2 * 2 * 4 * ctx, head 4x10.
    per_layer = 2 * (16 + 8 + 8 + 16 + 96) + 4 * 4 * 5
    assert ztrain.flops_per_token(cfg, 5) == 3 * per_layer + 2 * 40


# ----------------------------------------------------------------------------- evaluation


def test_chain_accept_lengths_match_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(0, 12), rng.randint(1, 5)
        match = np.array([rng.random() < 0.7 for _ in range(n)], dtype=bool)
        got = zeval.chain_accept_lengths(match, k)
        want = []
        for t in range(n - k + 1):
            a = 0
            while a < k and match[t + a]:
                a += 1
            want.append(a)
        assert got.tolist() == want
        steps = zeval.simulate_steps(match, k)
        assert sum(a + 1 for a in steps) <= n + 1
        assert all(0 <= a <= k for a in steps)


def test_cached_greedy_generation_matches_recomputation():
    torch.manual_seed(0)
    model = ztrain.build_model(ztrain.MODEL_PRESETS["tiny"]).eval()
    ids = torch.randint(4, 512, (3, 7))
    cached = zeval.greedy_generate(model, ids, 12)
    full = zeval.greedy_generate(model, ids, 12, use_cache=False)
    assert cached.shape == (3, 19) and torch.equal(cached, full)
    assert torch.equal(cached[:, :7], ids)


def test_chain_stats_of_a_model_against_itself_accept_everything():
    torch.manual_seed(0)
    model = ztrain.build_model(ztrain.MODEL_PRESETS["tiny"]).eval()
    prompts = torch.randint(4, 512, (2, 5))
    stats = zeval.chain_stats(model, model, prompts, 20, ks=(4,))
    assert stats["4"]["mean_accepted"] == 4.0 and stats["greedy_agreement_on_target_text"] == 1.0

    class Shifted(torch.nn.Module):
        """Agrees with ``model`` except where its greedy token is even."""

        def forward_train(self, ids):
            logits = model.forward_train(ids)
            top = logits.argmax(-1, keepdim=True)
            bump = torch.zeros_like(logits).scatter_(-1, (top + 1) % 512, 1e3)
            return logits + bump * (top % 2 == 0)

    seqs = zeval.greedy_generate(model, prompts, 20)
    want = (seqs[:, 5:] % 2 == 1).float().mean().item()
    stats = zeval.chain_stats(model, Shifted(), prompts, 20, ks=(4,))
    assert stats["greedy_agreement_on_target_text"] == pytest.approx(want)
    assert stats["4"]["mean_accepted"] < 4.0


# ----------------------------------------------------------------------------- path errors


def _one_line_exit_2(main, argv: list, capsys) -> str:
    """``main(argv)`` ends with exit code 2 and one ``PROG: error:`` line, no traceback."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], err
    return lines[0]


def test_existing_path_checks_name_what_is_wrong(tmp_path):
    """existing_dir / existing_file: FileNotFoundError for a missing path (or a missing file in
    the directory), ValueError for the wrong kind; each message names what the path is for."""
    from specdecode.zoo._paths import existing_dir, existing_file

    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    assert existing_dir(str(tmp_path / "d"), "--x") == tmp_path / "d"
    assert existing_file(str(tmp_path / "f"), "--x") == tmp_path / "f"
    for check in (existing_dir, existing_file):
        with pytest.raises(FileNotFoundError) as info:
            check(tmp_path / "nope", "--x")
        assert str(info.value) == f"--x {tmp_path / 'nope'} does not exist"
    with pytest.raises(ValueError) as info:
        existing_dir(tmp_path / "f", "--x")
    assert str(info.value) == f"--x {tmp_path / 'f'} is not a directory"
    with pytest.raises(ValueError) as info:
        existing_file(tmp_path / "d", "--x")
    assert str(info.value) == f"--x {tmp_path / 'd'} is not a file"
    with pytest.raises(FileNotFoundError) as info:
        existing_dir(tmp_path / "d", "--x", ("a.json", "b.json"))
    assert str(info.value) == f"--x {tmp_path / 'd'} has no a.json, b.json"


@pytest.fixture
def run_final(tmp_path) -> Path:
    """A stand-in for a training run's ``final/``: a tiny model, tokenizer bytes and manifest."""
    final = tmp_path / "run" / "final"
    torch.manual_seed(0)
    ztrain.build_model(ztrain.MODEL_PRESETS["tiny"]).save_pretrained(str(final))
    (final / ztrain.TOKENIZER_NAME).write_bytes(b"tokenizer")
    (final / zcorpus.MANIFEST_NAME).write_text("{}\n")
    return final


@pytest.fixture
def locked(monkeypatch):
    """``locked(path)``: ``os.access`` reports ``path`` as not writable (permission bits alone
    cannot do that for root, who runs the tests in some environments)."""
    import os

    real = os.access
    paths = set()

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and Path(path).resolve() in paths:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    return lambda path: paths.add(Path(path).resolve())


def test_export_path_errors_are_one_line(run_final, tmp_path, capsys, locked):
    from specdecode.zoo import export as zexport

    def export(target, draft, out) -> str:
        argv = ["--target", str(target), "--draft", str(draft), "--out", str(out)]
        return _one_line_exit_2(zexport.main, argv, capsys)

    out = tmp_path / "pair"
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    line = export(tmp_path / "nope", run_final, out)
    assert line.startswith("python -m specdecode.zoo.export: error: target directory")
    assert "does not exist" in line
    assert "draft directory" in export(run_final, tmp_path / "file", out)
    assert "is not a directory" in export(run_final, tmp_path / "file", out)
    line = export(tmp_path / "empty", run_final, out)
    assert "has no config.json, tokenizer.model, corpus_manifest.json" in line
    assert "is not a directory" in export(run_final, run_final, tmp_path / "file")
    line = export(run_final, run_final, tmp_path / "file" / "pair")
    assert f"cannot be created: {tmp_path / 'file'} is not a directory" in line
    (tmp_path / "locked").mkdir()
    locked(tmp_path / "locked")
    line = export(run_final, run_final, tmp_path / "locked" / "pair")
    assert f"is not writable (in {tmp_path / 'locked'})" in line
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "model.safetensors", ztrain.TOKENIZER_NAME):
        (other / name).write_bytes((run_final / name).read_bytes())
    (other / ztrain.TOKENIZER_NAME).write_bytes(b"another tokenizer")
    assert "different tokenizers" in export(run_final, other, out)
    (other / ztrain.TOKENIZER_NAME).write_bytes(b"tokenizer")
    (other / "model.safetensors").unlink()
    assert "model.safetensors" in export(run_final, other, out)
    assert not out.exists()  # every error came before anything was written

    # The library function raises what the command reports.
    with pytest.raises(FileNotFoundError, match="target directory .* does not exist"):
        zexport.export_pair(tmp_path / "nope", run_final, out, torch.float16)
    with pytest.raises(ValueError, match="output directory .* is not a directory"):
        zexport.export_pair(run_final, run_final, tmp_path / "file", torch.float16)
    with pytest.raises(ValueError, match="model directory .* is not a directory"):
        zexport.export_model(tmp_path / "file", out / "target", torch.float16)


def test_export_of_valid_runs_writes_the_pair(run_final, tmp_path, capsys):
    from specdecode.zoo import export as zexport

    out = tmp_path / "new" / "pair"
    argv = ["--target", str(run_final), "--draft", str(run_final), "--out", str(out)]
    assert zexport.main(argv) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}")
    for name in ("target/config.json", "draft/model.safetensors", "tokenizer.model"):
        assert (out / name).is_file(), name
    assert (out / zcorpus.MANIFEST_NAME).read_text() == "{}\n"


def test_train_path_errors_are_one_line(run_final, tmp_path, capsys, locked):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    base = ["--model", "tiny", "--seq-len", "32", "--run-dir"]
    line = _one_line_exit_2(ztrain.main, [*base, str(tmp_path / "file")], capsys)
    assert line == f"{ztrain.PROG}: error: --run-dir {tmp_path / 'file'} is not a directory"
    line = _one_line_exit_2(ztrain.main, [*base, str(tmp_path / "file" / "run")], capsys)
    assert "--run-dir" in line and "cannot be created" in line
    run = str(tmp_path / "new")
    for extra, expected in (
        (["--data-dir", str(tmp_path / "file")], "--data-dir"),
        (["--corpus-root", str(tmp_path / "nope")], "--corpus-root"),
        (["--init-from", str(tmp_path / "empty")], "--init-from"),
        (["--distill-from", str(tmp_path / "nope")], "--distill-from"),
    ):
        line = _one_line_exit_2(ztrain.main, [*base, run, *extra], capsys)
        assert expected in line, line
    locked(tmp_path / "empty")
    line = _one_line_exit_2(ztrain.main, [*base, str(tmp_path / "empty")], capsys)
    assert "is not writable" in line
    assert not (tmp_path / "new").exists()

    with pytest.raises(FileNotFoundError, match="corpus root .* does not exist"):
        zcorpus.Corpus.collect(tmp_path / "nope")
    with pytest.raises(ValueError, match="data directory .* is not a directory"):
        ztrain.prepare_data(tmp_path / "file", 512, tmp_path / "empty")


@needs_pair
def test_evaluate_path_errors_are_one_line(run_final, tmp_path, capsys):
    (tmp_path / "heldout.npy").write_text("not numpy")
    good = {
        "--target": run_final,
        "--draft": run_final,
        "--tokenizer": zoo.path(PAIR) / ztrain.TOKENIZER_NAME,
        "--heldout": tmp_path / "heldout.npy",
    }
    for option, value, expected in (
        ("--target", tmp_path / "nope", "does not exist"),
        ("--draft", run_final / "config.json", "is not a directory"),
        ("--tokenizer", run_final, "is not a file"),
        ("--heldout", tmp_path / "nope.npy", "does not exist"),
        ("--out", tmp_path / "nope" / "eval.json", f"the directory {tmp_path / 'nope'} does not"),
        ("--out", tmp_path, "is a directory"),
        ("--tokenizer", tmp_path / "heldout.npy", "is not a sentencepiece model"),
        ("--heldout", run_final / "config.json", "is not a .npy token stream"),
    ):
        argv = [str(x) for kv in {**good, option: value}.items() for x in kv]
        line = _one_line_exit_2(zeval.main, argv, capsys)
        assert line.startswith(f"python -m specdecode.zoo.evaluate: error: {option} ")
        assert expected in line, line


def _usage_error(main, argv: list, capsys) -> str:
    """``main(argv)`` ends as argparse's usage error: exit code 2, the usage block and one
    ``PROG: error:`` line, no traceback; returns that line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert err.startswith("usage: ") and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_evaluate_numeric_options_are_usage_errors(tmp_path, capsys):
    # The paths do not exist: a bad number is refused before any path is looked at.
    paths = [f"--{name}={tmp_path / name}" for name in ("target", "draft", "tokenizer", "heldout")]
    prog = "python -m specdecode.zoo.evaluate"
    for option, value, expected in (
        ("--seq-len", "0", "expected an int >= 1, got 0"),
        ("--seq-len", "x", "expected an int >= 1, got 'x'"),
        ("--max-windows", "0", "expected an int >= 1, got 0"),
        ("--prompts", "-1", "expected an int >= 1, got -1"),
        ("--prompt-len", "0", "expected an int >= 1, got 0"),
        ("--new-tokens", "7", "expected an int >= 8, got 7"),  # the longest chain measured
        ("--sample-tokens", "-1", "expected an int >= 0, got -1"),
        ("--threads", "0", "expected an int >= 1, got 0"),
    ):
        line = _usage_error(zeval.main, [*paths, option, value], capsys)
        assert line == f"{prog}: error: argument {option}: {expected}"
    line = _usage_error(zeval.main, [*paths, "--seq-len", "16", "--prompt-len", "18"], capsys)
    assert line == f"{prog}: error: argument --prompt-len: 18 exceeds --seq-len + 1 = 17"


@needs_pair
def test_evaluate_inputs_that_do_not_fit_the_options_are_one_line(
    run_final, tmp_path, capsys, monkeypatch, keep_threads
):
    """A held-out stream shorter than one window, of the wrong shape or type or vocabulary, or
    lengths past the models' max length: one error line naming the option, before any
    measurement; a stream of exactly one window is measured."""
    measured = []
    real_pair_stats = zeval.pair_stats

    def pair_stats(*args, **kwargs):
        measured.append(1)
        return real_pair_stats(*args, **kwargs)

    monkeypatch.setattr(zeval, "pair_stats", pair_stats)
    streams = {
        "short": np.arange(16, dtype=np.uint16),
        "window": np.arange(17, dtype=np.uint16),
        "2d": np.zeros((2, 40), dtype=np.uint16),
        "float": np.zeros(40, dtype=np.float32),
        "vocab": np.full(40, 512, dtype=np.int64),  # the tiny model's vocabulary is 512
        "long": np.arange(200, dtype=np.uint16),
    }
    for name, array in streams.items():
        np.save(tmp_path / f"{name}.npy", array)
    tokenizer = zoo.path(PAIR) / ztrain.TOKENIZER_NAME

    def argv(stream, *extra, model=run_final):
        return [
            *("--target", str(model), "--draft", str(model), "--tokenizer", str(tokenizer)),
            *("--heldout", str(tmp_path / f"{stream}.npy"), "--seq-len", "16"),
            *("--max-windows", "2", "--prompts", "1", "--prompt-len", "8", "--new-tokens", "8"),
            *extra,
        ]

    prog = "python -m specdecode.zoo.evaluate: error: "
    for args, expected in (
        (
            argv("short", "--no-samples"),
            f"--heldout {tmp_path / 'short.npy'} holds 16 tokens, fewer than one window of "
            "--seq-len 16 + 1",
        ),
        (argv("2d", "--no-samples"), "expected a 1-D integer array, got a 2-D uint16 array"),
        (argv("float", "--no-samples"), "expected a 1-D integer array, got a 1-D float32 array"),
        (argv("vocab", "--no-samples"), "holds token id 512, outside the models' vocabulary"),
        (
            argv("long", "--no-samples", "--seq-len", "100"),
            "--seq-len 100 exceeds the models' max length 64",
        ),
        (
            argv("long", "--no-samples", "--prompt-len", "17", "--new-tokens", "48"),
            "--prompt-len 17 + --new-tokens 48 exceed the models' max length 64",
        ),
        (argv("long"), f"--tokenizer {tokenizer} has 8192 pieces, more than the target's"),
        (
            argv("long", "--sample-tokens", "1020", model=zoo.path(PAIR) / "target"),
            "--sample-tokens 1020 after the longest sample prompt",
        ),
    ):
        line = _one_line_exit_2(zeval.main, args, capsys)
        assert line.startswith(prog) and expected in line, line
    assert not measured
    assert zeval.main(argv("window", "--no-samples")) == 0
    result = json.loads(capsys.readouterr().out)
    assert measured and result["pair"]["positions"] == 16


def test_train_numeric_options_are_usage_errors(tmp_path, capsys):
    run = tmp_path / "run"
    base = ["--model", "tiny", "--run-dir", str(run)]
    prog = f"{ztrain.PROG}: error: argument"
    for option, value, expected in (
        ("--steps", "0", "expected an int >= 1, got 0"),
        ("--batch-size", "-2", "expected an int >= 1, got -2"),
        ("--seq-len", "0", "expected an int >= 1, got 0"),
        ("--seq-len", "4096", "4096 exceeds the tiny model's max_position_embeddings 64"),
        ("--lr", "0", "expected a finite float > 0, got 0.0"),
        ("--lr", "nan", "expected a finite float > 0, got nan"),
        ("--min-lr", "-0.5", "expected a finite float >= 0, got -0.5"),
        ("--warmup", "-1", "expected an int >= 0, got -1"),
        ("--weight-decay", "inf", "expected a finite float >= 0, got inf"),
        ("--clip", "0", "expected a finite float > 0, got 0.0"),
        ("--threads", "0", "expected an int >= 1, got 0"),
        ("--log-every", "0", "expected an int >= 1, got 0"),
        ("--eval-every", "0", "expected an int >= 1, got 0"),
        ("--eval-windows", "0", "expected an int >= 1, got 0"),
        ("--checkpoint-minutes", "-1", "expected a finite float >= 0, got -1.0"),
        ("--stop-after", "0", "expected an int >= 1, got 0"),
        ("--distill-alpha", "2", "expected a float in [0, 1], got 2.0"),
        ("--distill-temperature", "0", "expected a finite float > 0, got 0.0"),
        ("--distill-temperature", "x", "expected a finite float > 0, got 'x'"),
    ):
        line = _usage_error(ztrain.main, [*base, option, value], capsys)
        assert line == f"{prog} {option}: {expected}"
    assert not run.exists()


def test_train_resume_errors_are_one_line_before_any_work(tmp_path, capsys):
    """A missing checkpoint with --resume, a checkpoint without --resume, and a checkpoint whose
    options differ from the command line's: one error line, exit 2, before the data is built."""
    _fake_stdlib(tmp_path / "lib")
    run, data = tmp_path / "run", tmp_path / "data"
    argv = _train_args(tmp_path, "run")
    prog = f"{ztrain.PROG}: error: "
    line = _one_line_exit_2(ztrain.main, [*argv, "--resume"], capsys)
    assert line == f"{prog}--resume: no checkpoint at {run / 'checkpoint.pt'}"
    run.mkdir()
    saved = vars(ztrain.parse_args(argv))
    torch.save({"args": saved}, run / "checkpoint.pt")
    line = _one_line_exit_2(ztrain.main, argv, capsys)
    assert line == f"{prog}{run / 'checkpoint.pt'} exists: pass --resume or use a new --run-dir"
    for extra, expected in (
        (["--lr", "1e-3"], "--lr was 0.003, now 0.001"),
        (["--seq-len", "16"], "--seq-len was 32, now 16"),
        (["--model", "draft"], "--model was tiny, now draft"),
    ):
        line = _one_line_exit_2(ztrain.main, [*argv, "--resume", *extra], capsys)
        assert line == f"{prog}--resume: {expected}"
    assert not data.exists() and sorted(run.iterdir()) == [run / "checkpoint.pt"]
