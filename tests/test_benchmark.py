"""specdecode.benchmark: a tiny configuration end to end (tiny random models saved in the Hugging
Face layout, loaded by both libraries), the table's structure and the greedy identity check."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import pytest
import torch
from specdecode.models import ModelConfig, Transformer

from specdecode import benchmark

VOCAB = 300


def _tiny(seed: int, layers: int, hidden: int) -> Transformer:
    config = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
    )
    torch.manual_seed(seed)
    return Transformer(config).eval()


class _ByteTokenizer:
    path = "bytes"

    def encode(self, text: str) -> list[int]:
        return [1] + [4 + b for b in text.encode("utf-8")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("pair")
    _tiny(1, 2, 64).save_pretrained(root / "target")
    _tiny(2, 1, 32).save_pretrained(root / "draft")
    return benchmark._Models(
        name="tiny random pair",
        target_dir=str(root / "target"),
        draft_dir=str(root / "draft"),
        ours_target=benchmark._load_ours(str(root / "target")),
        ours_draft=benchmark._load_ours(str(root / "draft")),
        hf_target=benchmark._load_hf(str(root / "target")),
        hf_draft=benchmark._load_hf(str(root / "draft")),
        tokenizer=_ByteTokenizer(),
    )


def test_prompts_are_real_and_distinct():
    he = benchmark.humaneval_prompts(3)
    assert len(he) == 3 and len(set(he)) == 3
    assert all("def " in p for p in he)
    assert len(benchmark.humaneval_prompts(1000)) == 164
    prose, sources = benchmark.prose_prompts(4)
    assert len(prose) == 4 and len(set(prose)) == 4 and sources
    assert all(len(p) > 200 and " " in p for p in prose)


def test_count_identical():
    assert benchmark.count_identical([[1, 2], [3]], [[1, 2], [3]]) == 2
    assert benchmark.count_identical([[1, 2], [3]], [[1, 5], [3]]) == 1
    with pytest.raises(ValueError, match="outputs"):
        benchmark.count_identical([[1]], [[1], [2]])


def test_config_validation():
    with pytest.raises(ValueError, match="datasets"):
        benchmark.BenchConfig(datasets=("wiki",)).validate()
    with pytest.raises(ValueError, match="num_prompts"):
        benchmark.BenchConfig(num_prompts=0).validate()
    with pytest.raises(TypeError, match="repeats"):
        benchmark.BenchConfig(repeats=1.5).validate()
    with pytest.raises(ValueError, match="batch_sizes"):
        benchmark.BenchConfig(batch_sizes=(0,)).validate()
    with pytest.raises(ValueError, match="model"):
        benchmark.BenchConfig(model="/nonexistent/dir").validate()


@pytest.mark.parametrize(
    "change, message",
    [
        # inf passed `t >= 0` and failed only in the engine, after the transformers rows ran.
        (dict(temperatures=(0.0, float("inf"))), "temperatures: expected finite numbers >= 0"),
        (dict(temperatures=(float("nan"),)), "temperatures: expected finite numbers >= 0"),
        (dict(temperatures=("1",)), "temperatures: expected finite numbers >= 0"),
        (dict(seed=-1), r"seed: expected an int in \[0, 2\*\*62\), got -1"),
        # Prompt i runs with seed + i, which the engine refuses past int64.
        (dict(seed=2**63 - 1), r"seed: expected an int in \[0, 2\*\*62\)"),
    ],
)
def test_config_validation_of_temperatures_and_seed(change, message):
    with pytest.raises(ValueError, match=message):
        benchmark.BenchConfig(**change).validate()
    benchmark.BenchConfig(temperatures=(0, 0.5, 2), seed=0).validate()


@pytest.mark.slow
def test_tiny_run_table_and_identity(models, tmp_path):
    torch.set_num_threads(1)
    config = benchmark.BenchConfig(
        num_prompts=2, max_new_tokens=8, repeats=1, batch_sizes=(1, 8), max_prompt_tokens=48
    )
    rows, meta = benchmark.run_benchmark(config, models=models, quiet=True)
    # Batch 8 over 2 prompts runs as (and is reported as) one batch of 2.
    assert {r.batch for r in rows if r.library == "specdecode"} == {1, 2}
    per_panel = len(benchmark.HF_METHODS) + 2 * len(benchmark.SPECDECODE_METHODS)
    assert len(rows) == 2 * 2 * per_panel
    for r in rows:
        assert r.tokens_per_s > 0 and len(r.runs_tokens_per_s) == 1
        assert r.new_tokens == 2 * 8  # no stop token: every row does the same work
        assert r.speedup_hf is not None and r.speedup_hf > 0
        assert (r.speedup_ours is not None) == (r.library == "specdecode")
        if r.library == "specdecode" and r.method != "autoregressive":
            assert 0 <= r.acceptance <= 1
        assert r.tokens_per_step >= 1 - 1e-9 if r.library == "specdecode" else r.tokens_per_step > 0
        if r.temperature == 0:
            # Greedy speculative decoding must reproduce the autoregressive tokens.
            assert r.identical == (2, 2), (r.library, r.method, r.batch)
        else:
            assert r.identical is None
    ar = [r for r in rows if r.library == "specdecode" and r.method == "autoregressive"]
    assert all(abs(r.tokens_per_step - 1) < 1e-9 and r.speedup_ours == 1 for r in ar)
    table = benchmark.format_table(rows).splitlines()
    assert table[0] == "| " + " | ".join(benchmark.TABLE_COLUMNS) + " |"
    assert len(table) == 2 + len(rows)
    assert all(line.count("|") == len(benchmark.TABLE_COLUMNS) + 1 for line in table)
    assert any("| 2/2 |" in line for line in table)
    paths = benchmark.write_outputs(rows, meta, tmp_path / "out", "test", plot=True)
    png = tmp_path / "out" / "tokens_per_s.png"
    assert png in paths and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(saved["rows"]) == len(rows)
    assert "greedy identical" in (tmp_path / "out" / "results.md").read_text()


def test_identity_check_reports_a_mismatch(models, monkeypatch):
    """A drafter path that changes the output must show up as non-identical."""
    real = benchmark._run_ours

    def corrupted(models_, method, prompts, batch, temperature, new, seed):
        seconds, outs, *rest = real(models_, method, prompts, batch, temperature, new, seed)
        if method == "cacheback":
            outs = [[(t + 1) % VOCAB for t in o] for o in outs]
        return (seconds, outs, *rest)

    monkeypatch.setattr(benchmark, "_run_ours", corrupted)
    config = benchmark.BenchConfig(
        datasets=("humaneval",),
        num_prompts=2,
        max_new_tokens=4,
        repeats=1,
        batch_sizes=(1,),
        temperatures=(0.0,),
        hf=False,
    )
    rows, _ = benchmark.run_benchmark(config, models=models, quiet=True)
    by_method = {r.method: r.identical for r in rows}
    assert by_method["cacheback"] == (0, 2)
    assert by_method["model chain"] == (2, 2)


def test_identity_check_covers_every_timed_pass(models, monkeypatch):
    """Every timed pass counts in tokens/s, so each pass's output is checked: only the first
    timed pass's used to be, and a later pass that went wrong still reported n/n."""
    real = benchmark._run_ours
    calls = {"cacheback": 0, "autoregressive": 0}

    def later_pass_corrupted(models_, method, prompts, batch, temperature, new, seed):
        seconds, outs, *rest = real(models_, method, prompts, batch, temperature, new, seed)
        if method in calls:
            calls[method] += 1
            if calls[method] == 3:  # warm-up, first timed pass, then this one
                outs = [outs[0], [(t + 1) % VOCAB for t in outs[1]]]
        return (seconds, outs, *rest)

    monkeypatch.setattr(benchmark, "_run_ours", later_pass_corrupted)
    config = benchmark.BenchConfig(
        datasets=("humaneval",),
        num_prompts=2,
        max_new_tokens=4,
        repeats=2,
        batch_sizes=(1,),
        temperatures=(0.0,),
        hf=False,
    )
    rows, _ = benchmark.run_benchmark(config, models=models, quiet=True)
    by_method = {r.method: r for r in rows}
    assert by_method["cacheback"].identical == (1, 2)
    assert by_method["model chain"].identical == (2, 2)
    # Without transformers rows the reference row's passes are checked against its first one.
    assert by_method["autoregressive"].identical == (1, 2)
    assert by_method["autoregressive"].reference == "its own first pass"


def test_tokens_per_step_and_acceptance_cover_every_timed_pass(models, monkeypatch):
    """They came from the first timed pass alone, beside a tokens/s over all passes; a
    CostAwareBudget cuts drafts by measured times, so passes differ."""
    passes = {}
    # (target passes, accepted, offered) of the warm-up and the two timed passes.
    counts = [(1, 0, 0), (2, 3, 4), (6, 1, 4)]

    def fake(models_, method, prompts, batch, temperature, new, seed):
        i = passes[method] = passes.get(method, -1) + 1
        outs = [[5] * new for _ in prompts]
        return (1.0, outs, new * len(prompts), *counts[i])

    monkeypatch.setattr(benchmark, "_run_ours", fake)
    config = benchmark.BenchConfig(
        datasets=("humaneval",),
        num_prompts=2,
        max_new_tokens=4,
        repeats=2,
        batch_sizes=(1,),
        temperatures=(0.0,),
        hf=False,
    )
    rows, _ = benchmark.run_benchmark(config, models=models, quiet=True)
    cacheback = next(r for r in rows if r.method == "cacheback")
    assert cacheback.new_tokens == 8  # per pass
    assert cacheback.tokens_per_step == 16 / 8  # was 8 / 2
    assert cacheback.acceptance == 4 / 8  # was 3 / 4
    assert cacheback.identical == (2, 2)


def test_repeated_datasets_and_temperatures_run_once(models, monkeypatch):
    """As a repeated batch size runs once; they used to give every row twice."""
    monkeypatch.setattr(
        benchmark,
        "_run_ours",
        lambda models_, method, prompts, batch, temperature, new, seed: (
            1.0,
            [[5] * new for _ in prompts],
            new * len(prompts),
            new * len(prompts),
            0,
            0,
        ),
    )
    config = benchmark.BenchConfig(
        datasets=("humaneval", "humaneval"),
        num_prompts=1,
        max_new_tokens=2,
        repeats=1,
        batch_sizes=(1, 1),
        temperatures=(0.0, 1, -0.0, 1.0),
        hf=False,
    )
    rows, _ = benchmark.run_benchmark(config, models=models, quiet=True)
    keys = [(r.dataset, r.temperature, r.method, r.batch) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * len(benchmark.SPECDECODE_METHODS)


def test_report_says_how_many_prompts_ran():
    """The header repeated --num-prompts although HumanEval has only 164 problems."""
    meta = dict(
        model="m",
        target_dir="t",
        draft_dir="d",
        tokenizer="tok",
        date="today",
        machine="x86_64",
        cpus=2,
        torch="2",
        torch_threads=1,
        transformers=None,
        config=dataclasses.asdict(benchmark.BenchConfig(num_prompts=200)),
        prompt_tokens={"humaneval": [100] * 164, "prose": [150] * 200},
    )
    report = benchmark.format_report([], meta, "specdecode bench --num-prompts 200")
    assert "200 prompts per dataset" not in report
    assert "prompts: humaneval 164, prose 200 (200 asked for" in report
    meta["prompt_tokens"] = {"humaneval": [100] * 200}
    report = benchmark.format_report([], meta, "specdecode bench --num-prompts 200")
    assert "200 prompts per dataset, 128 new tokens each" in report


class _WrongTokenizer(_ByteTokenizer):
    path = "another model's tokenizer"

    def encode(self, text: str) -> list[int]:
        return super().encode(text) + [VOCAB + 7]


def test_tokenizer_outside_the_vocabulary_is_a_value_error_before_any_row(models):
    """transformers' rows used to end in an IndexError traceback from the embedding."""
    config = benchmark.BenchConfig(
        datasets=("humaneval",),
        num_prompts=1,
        max_new_tokens=2,
        repeats=1,
        batch_sizes=(1,),
        temperatures=(0.0,),
    )
    wrong = dataclasses.replace(models, tokenizer=_WrongTokenizer())
    with pytest.raises(ValueError, match=f"tokenizer: .* gives token id {VOCAB + 7} "):
        benchmark.run_benchmark(config, models=wrong, quiet=True)


def test_cli_parses_bench_options():
    from specdecode.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "--num-prompts", "2", "--batch-sizes", "1,4", "--temperatures", "0"]
    )
    assert isinstance(args, argparse.Namespace)
    config = benchmark.config_from_args(args)
    assert config.num_prompts == 2 and config.batch_sizes == (1, 4)
    assert config.temperatures == (0.0,)
    with pytest.raises(ValueError, match="batch-sizes"):
        benchmark.config_from_args(build_parser().parse_args(["bench", "--batch-sizes", "a"]))


def test_command_reports_bad_options_without_a_traceback(capsys):
    assert benchmark.main(["--model", "/nonexistent/dir", "--quiet"]) == 2
    assert "model: '/nonexistent/dir' does not exist" in capsys.readouterr().err
    assert benchmark.main(["--num-prompts", "0", "--quiet"]) == 2
    assert "num_prompts" in capsys.readouterr().err
    threads = torch.get_num_threads()
    assert benchmark.main(["--threads", "0", "--quiet"]) == 2  # was a ValueError traceback
    assert "--threads: expected >= 1, got 0" in capsys.readouterr().err
    assert torch.get_num_threads() == threads


def _no_run(*args, **kwargs):
    raise AssertionError("the benchmark ran although its outputs cannot be written")


def test_unwritable_output_folder_is_reported_before_the_run(tmp_path, monkeypatch, capsys):
    """write_outputs used to fail with an OSError traceback after every row had run."""
    monkeypatch.setattr(benchmark, "run_benchmark", _no_run)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert benchmark.main(["--out", str(blocker / "results"), "--quiet"]) == 2
    assert f"--out: cannot write to {str(blocker / 'results')!r}" in capsys.readouterr().err


def test_a_run_that_fails_leaves_no_output_folder_behind(tmp_path, monkeypatch, capsys):
    """The output folder is checked before the run and made when the outputs are written: a run
    that fails in between leaves no empty folders (nor their missing parents) behind."""

    def failing_run(*args, **kwargs):
        raise ValueError("the run failed")

    monkeypatch.setattr(benchmark, "run_benchmark", failing_run)
    out = tmp_path / "new" / "results"
    assert benchmark.main(["--out", str(out), "--quiet", "--no-plot"]) == 2
    assert "the run failed" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    # An existing folder stays.
    out.mkdir(parents=True)
    assert benchmark.main(["--out", str(out), "--quiet", "--no-plot"]) == 2
    assert out.is_dir() and not any(out.iterdir())


def test_missing_matplotlib_is_reported_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(benchmark, "run_benchmark", _no_run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert benchmark.main(["--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "pip install matplotlib, or pass --no-plot" in capsys.readouterr().err
