"""`python -m lattice_mlx.doctor`: every kernel the demo model uses runs clean against its reference wherever the suite
runs (the CPU render here, the device's kernels on a GPU), a wrong kernel makes it exit 1, a bad model path 2."""

import mlx.core as mx
import pytest

from lattice_mlx import doctor, variants
from lattice_mlx.metal import _dialect, cpu_render, rms_pair

needs_render = pytest.mark.skipif(not cpu_render.available(), reason="the CPU render needs a C++ compiler")


@needs_render
def test_doctor_runs_clean_on_the_demo(capsys):
    assert doctor.main(["--repeats", "1"]) == 0
    out = capsys.readouterr().out
    kernels = {line.split()[0] for line in out.splitlines() if line.startswith("lattice_")}
    assert {"lattice_gated_delta_conv", "lattice_sdpa", "lattice_q4_rms", "lattice_argmax"} <= kernels
    assert "versions: mlx " in out and " rows ok" in out and "wrong" not in out


@needs_render
def test_a_wrong_kernel_is_a_wrong_row(monkeypatch):
    monkeypatch.setattr(_dialect, "_FAILED", {})
    text, dtype, bits, gs = doctor.model_settings(doctor.DEMO_MODEL)
    calls = variants.model_calls({**text, **variants.SMALL}, dtype=mx.float32, bits=bits, group_size=gs, widths=(1,))
    call = doctor.first_per_kernel(calls)["lattice_rms_pair"]
    backend = "cpu render" if not doctor.use_kernels() else _dialect.backend()
    assert doctor.run_row(call, "small", backend, 1)["status"] == "ok"
    monkeypatch.setattr(rms_pair, "_BODY", rms_pair._BODY.replace("w * LX_F32", "1.5f * w * LX_F32"))
    row = doctor.run_row(call, "small", backend, 1)
    assert row["status"] == "WRONG" and row["error"] > row["tolerance"], row


def test_a_bad_model_is_one_line_and_exit_2(tmp_path, capsys):
    assert doctor.main(["--model", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("doctor: ")
