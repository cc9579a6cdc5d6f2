"""The documentation's code runs as written, and the command line works."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import requires_cuda

ROOT = Path(__file__).resolve().parent.parent


def _python_blocks(text, fence):
    if fence == "md":
        return re.findall(r"```python\n(.*?)```", text, flags=re.S)
    blocks = []
    for match in re.finditer(r"\.\. code-block:: python\n\n((?:   .*\n|\n)+)", text):
        lines = [line[3:] if line.startswith("   ") else line for line in
                 match.group(1).splitlines()]
        blocks.append("\n".join(lines))
    return blocks


def test_readme_example_runs():
    blocks = _python_blocks((ROOT / "README.md").read_text(), "md")
    assert blocks, "the README has a Python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_tutorial_runs_in_order():
    blocks = _python_blocks((ROOT / "docs" / "tutorial.rst").read_text(), "rst")
    assert len(blocks) >= 5
    scope = {}
    for block in blocks:
        exec(compile(block, "docs/tutorial.rst", "exec"), scope)


def _printed_comments(block):
    """What each ``print(...)`` line of ``block`` is documented to print: its trailing
    comment, or the comment line right after it."""
    lines = block.splitlines()
    expected = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("print("):
            _, sep, comment = line.partition("  # ")
            if not sep:
                comment = lines[i + 1].strip().removeprefix("# ")
            expected.append(comment.strip())
    return expected


# Compiles the kernels of seven functions: 89-94 s on 2 cores with an empty kernel cache,
# about 2 s with a warm one (docs/performance.rst, "Mask and score functions").
@pytest.mark.slow
def test_custom_masks_and_scores_page_runs_in_order(capsys):
    blocks = _python_blocks((ROOT / "docs" / "custom.rst").read_text(), "rst")
    assert len(blocks) >= 8
    scope = {}
    for block in blocks:
        exec(compile(block, "docs/custom.rst", "exec"), scope)
        printed = capsys.readouterr().out.splitlines()
        assert printed == _printed_comments(block), block


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "numattn", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


@pytest.mark.last
@pytest.mark.slow  # a process of its own; the doctest of run_demo runs the demo in this one
def test_cli_demo_runs_and_checks_every_step():
    result = _cli("demo", "--batch", "3", "--new-tokens", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tokens/s" in result.stdout
    assert "PASS" in result.stdout


@pytest.mark.last
@pytest.mark.slow  # a process of its own; the doctest of run_checks runs the same checks
def test_cli_check_passes_on_cpu():
    result = _cli("check", "--cpu-only")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
    assert re.search(r"^\d+ passed, 0 failed$", result.stdout, flags=re.M)


@pytest.mark.last
@pytest.mark.slow
def test_bench_decode_script_runs_a_case_on_one_thread():
    script = ROOT / "benchmarks" / "bench_decode.py"
    result = subprocess.run(
        [sys.executable, str(script), "--case", "2,4,2,300,16", "--repeat", "1",
         "--threads", "1"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 threads" in result.stdout
    assert re.search(r"^B=2 H=4/2 N=300 D=16 .* \d+%", result.stdout, flags=re.M)
    result = subprocess.run([sys.executable, str(script), "--threads", "0"],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 2 and "--threads: must be at least 1, got 0" in result.stderr


@pytest.mark.slow
@requires_cuda
def test_gpu_check_script_runs_end_to_end(capsys):
    """benchmarks/gpu_check.py, the one command to run when a GPU is lent, gets through its
    check and its benchmark table (tiny shapes here), and counts partitions as integers for
    the full-size shapes too."""
    import importlib.util

    from numattn import MHAConfig
    from numattn.core.device import require_cuda

    path = ROOT / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--tiny"]) == 0
    printed = capsys.readouterr().out
    assert "check: all ok" in printed and "of copy bw" in printed and "of GEMM" in printed
    assert "store_kv into a bfloat16 device cache" in printed and "FAIL" not in printed
    for num_keys in (4096, 32768):
        parts = gpu_check._auto_partitions(require_cuda(), num_keys, 8 * 8, MHAConfig())
        assert type(parts) is int and parts >= 1


@pytest.mark.parametrize("script, flag", [
    ("bench_cross.py", "--repeat"), ("bench_decode.py", "--repeat"),
    ("bench_flash.py", "--repeat"), ("bench_multi_query.py", "--repeat"),
    ("bench_overhead.py", "--rounds"), ("gpu_check.py", "--repeat"),
    ("import_time.py", "--runs"),
])
def test_benchmark_scripts_refuse_a_count_of_zero(script, flag):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), flag, "0"],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 2 and "must be at least 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_reports_failures(monkeypatch):
    from numattn.tools import check

    monkeypatch.setattr(check, "TOLERANCE", {k: -1.0 for k in check.TOLERANCE})
    rows = check.run_checks(cuda=False)
    assert rows and not any(row.passed for row in rows)


@pytest.mark.last
@pytest.mark.slow
def test_cli_bench_quick_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    result = _cli("bench", "--quick", "--only", "decode B=8", "--repeat", "1",
                  "--json", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    import json

    data = json.loads(path.read_text())
    assert data["limits"]["gemm_gflops"] > 0 and data["limits"]["read_gbs"] > 0
    assert [r["name"] for r in data["results"]] == ["decode B=8 N=1024"]
    row = data["results"][0]
    assert row["rate"] > 0 and row["limit"] > 0
    assert row["fraction_of_limit"] == pytest.approx(row["rate"] / row["limit"])


def test_cli_bench_refuses_outputs_it_could_not_write_before_running(tmp_path):
    result = _cli("bench", "--quick", "--json", str(tmp_path / "missing" / "bench.json"))
    assert result.returncode == 2 and "--json" in result.stderr
    assert "no such directory" in result.stderr and "Traceback" not in result.stderr
    assert "machine:" not in result.stdout  # no case ran


def test_bench_plot_without_matplotlib_is_refused_up_front(tmp_path, monkeypatch):
    import importlib.util

    from numattn.tools import bench

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    plot = str(tmp_path / "bench.png")
    assert "needs matplotlib" in bench._output_problem(None, plot)
    assert bench._output_problem(str(tmp_path / "bench.json"), None) is None
    assert "--plot" in bench._output_problem(None, str(tmp_path / "no" / "bench.png"))


def test_interleaved_medians_times_every_callable_in_each_round():
    from numattn.tools.bench import interleaved_medians

    calls = []
    medians = interleaved_medians(
        [lambda: calls.append("a"), lambda: calls.append("b")], repeat=3, warmup=1
    )
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert len(medians) == 2 and all(m >= 0 for m in medians)


def test_interleaved_times_rotate_the_order_and_keep_rounds_aligned():
    from numattn.tools.bench import interleaved_times

    calls = []
    times = interleaved_times(
        [lambda: calls.append("a"), lambda: calls.append("b"), lambda: calls.append("c")],
        repeat=3, warmup=0, rotate=True,
    )
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [len(t) for t in times] == [3, 3, 3]


# The bandwidth probe of the bench tool is a parallel kernel of its own: slow to compile.
@pytest.mark.slow
def test_read_all_fn_reads_the_requested_bytes():
    from numattn.tools.bench import read_all_fn

    read_all, nbytes = read_all_fn(megabytes=8, threads=2)
    assert 0.99 * 8 * 2**20 < nbytes <= 8 * 2**20
    assert read_all() == nbytes  # every word it counts read once (the words are all 1)


@pytest.mark.slow
@pytest.mark.parametrize("num_words, threads", [(8 * 105, 1), (10**5, 1), (10**5 + 7, 2),
                                                (2**20, 3)])
def test_read_probe_streams_stay_in_range(num_words, threads):
    # plain Python slices come out short where a stream would run past the array (the
    # compiled kernel does not check), and the compiled kernel sums the same words
    import numpy as np

    from numattn.core.jit import cpu_jit
    from numattn.tools.bench import READ_STREAMS, _read_words, _stream_words

    words = np.ones(num_words, dtype=np.int64)
    expected = threads * READ_STREAMS * _stream_words(num_words, threads)
    assert expected > 0
    assert _read_words(words, threads) == expected
    assert cpu_jit(_read_words, parallel=True)(words, threads) == expected


def test_cli_usage_errors():
    result = _cli("nonsense")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["demo", "--batch", "0"], "--batch: must be at least 1, got 0"),
    (["demo", "--new-tokens", "1"], "--new-tokens: must be at least 2, got 1"),
    (["demo", "--batch", "two"], "'two' is not an integer"),
    (["bench", "--repeat", "0"], "--repeat: must be at least 1"),
    (["bench", "--quick", "--only", "no such case"], "no benchmark case matches"),
])
def test_cli_bad_arguments_are_usage_errors(args, message):
    result = _cli(*args)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_run_demo_rejects_an_empty_batch():
    from numattn.tools.demo import run_demo

    with pytest.raises(ValueError, match="batch >= 1"):
        run_demo(batch=0)


@pytest.mark.parametrize("flag", ["--help"])
def test_cli_help(flag):
    result = _cli(flag)
    assert result.returncode == 0 and "check" in result.stdout and "demo" in result.stdout
