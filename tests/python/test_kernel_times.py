"""bench/kernel_times.py without a GPU: names shortened as ncu prints them (anonymous namespaces,
parameters; template arguments kept), units to µs, the round's kernels counted by the per-round
kernel and the others set apart, and the errors it names."""

from __future__ import annotations

import pytest
from script_loader import ROOT, load

kt = load(ROOT / "bench" / "kernel_times.py", "kernel_times")

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"\n')
DISPATCH = "epmoe::cuda::(anonymous namespace)::dispatch_kernel(epmoe::cuda::RoundParams)"
GEMM = ("void epmoe::cuda::experts::wgmma::(anonymous namespace)::packed_gemm_kernel"
        "<(epmoe::Precision)1, 64, true>(epmoe::cuda::experts::wgmma::(anonymous namespace)::Args)")
PREPARE = "void epmoe::cuda::experts::prepare_kernel<float>(int)"


def csv_file(tmp_path, rows):
    lines = ["==PROF== Connected to process 1\n", HEADER]
    for i, (name, unit, value) in enumerate(rows):
        lines.append(f'"{i}","1","epmoe","h","{name}","1","7","(256, 1, 1)","(8, 1, 1)","0",'
                     f'"9.0","Command line profiler metrics","gpu__time_duration.sum","{unit}",'
                     f'"{value}"\n')
    path = tmp_path / "k.csv"
    path.write_text("".join(lines))
    return path


def test_names_lose_scopes_and_parameters_and_keep_template_arguments():
    assert kt.short_name(DISPATCH) == "dispatch_kernel"
    assert kt.short_name(GEMM) == "packed_gemm_kernel<(Precision)1, 64, true>"
    assert kt.short_name(PREPARE) == "prepare_kernel<float>"
    # as ncu 2025.3 printed them on an H200 (session 23): "<unnamed>" with its "<" cut off
    assert kt.short_name("unnamed>::dispatch_kernel(RoundParams)") == "dispatch_kernel"
    gemm = "void wgmma::<unnamed>::packed_gemm_kernel<1, 64, 0>(wgmma::<unnamed>::Args)"
    assert kt.short_name(gemm) == "packed_gemm_kernel<1, 64, 0>"


def test_units_become_microseconds(tmp_path):
    path = csv_file(tmp_path, [(DISPATCH, "nsecond", "5,120"), (GEMM, "msecond", "0.03"),
                               (PREPARE, "usecond", "7")])
    assert kt.read_times(path) == [("dispatch_kernel", pytest.approx(5.12)),
                                   ("packed_gemm_kernel<(Precision)1, 64, true>",
                                    pytest.approx(30.0)),
                                   ("prepare_kernel<float>", pytest.approx(7.0))]


def test_a_round_is_counted_by_its_per_round_kernel(tmp_path):
    rows = [(PREPARE, "usecond", "100")]
    for gemm_us in ("30", "34"):  # two rounds: dispatch once, the GEMM twice a round
        rows += [(DISPATCH, "usecond", "5"), (GEMM, "usecond", gemm_us),
                 (GEMM, "usecond", "10")]
    text = kt.table(kt.read_times(csv_file(tmp_path, rows)), "dispatch_kernel")
    lines = text.splitlines()
    assert lines[0].startswith("2 rounds")
    gemm = next(line for line in lines if "packed_gemm_kernel" in line).split()
    assert gemm[-3:] == ["2.0", "21.0", "42.0"]  # launches per round, µs each, µs per round
    assert "every kernel of the round" in lines[-3] and lines[-3].split()[-1] == "47.0"
    assert lines[-2] == "other kernels (launches, us each):"
    assert lines[-1].split()[-2:] == ["1", "100.0"]


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(SystemExit, match="unknown unit 'furlong'"):
        kt.read_times(csv_file(tmp_path, [(DISPATCH, "furlong", "1")]))
    times = kt.read_times(csv_file(tmp_path, [(GEMM, "usecond", "1")]))
    with pytest.raises(SystemExit, match="no kernel named dispatch_kernel"):
        kt.table(times, "dispatch_kernel")
