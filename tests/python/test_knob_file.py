"""Knob files from Python (docs/tuning.md#knob-files): every Layer loads the file
$EPMOE_KNOB_FILE names, and one written for another layer is refused naming file, line and field."""

from __future__ import annotations

import pytest

import epmoe
from epmoe_ref import make_problem

SHAPE = dict(hidden=64, intermediate=64, num_experts=4, top_k=2, max_tokens_per_rank=8)
KEY = ("key precision=bf16 world=1 hidden=64 intermediate=64 num_experts=4 top_k=2 "
       "expert_math=wgmma\n")  # the default math


def create(group):
    problem = make_problem(epmoe.LayerShape(**SHAPE), 1, seed=5)
    return epmoe.Layer(group.communicator(0), epmoe.LayerShape(**SHAPE), "bf16", problem.w13_bits,
                       problem.w2_bits)


def test_a_layer_loads_the_knob_file_the_environment_names(tmp_path, monkeypatch):
    group = epmoe.HostGroup(1)
    monkeypatch.delenv("EPMOE_KNOB_FILE", raising=False)
    assert "num_sms=7" not in create(group).config.describe()
    tuned = tmp_path / "tuned.knobs"
    tuned.write_text("# by hand\n" + KEY + "decode num_sms=7\n")
    monkeypatch.setenv("EPMOE_KNOB_FILE", str(tuned))
    assert "num_sms=7" in create(group).config.describe()


def test_a_knob_file_for_another_layer_is_refused(tmp_path, monkeypatch):
    group = epmoe.HostGroup(1)
    other = tmp_path / "mxfp8.knobs"
    other.write_text(KEY.replace("precision=bf16", "precision=mxfp8"))
    monkeypatch.setenv("EPMOE_KNOB_FILE", str(other))
    refused = r"mxfp8\.knobs:1: tuned for precision=mxfp8, this layer has precision=bf16"
    with pytest.raises(epmoe.Error, match=refused):
        create(group)
    monkeypatch.setenv("EPMOE_KNOB_FILE", str(tmp_path / "missing.knobs"))
    with pytest.raises(epmoe.Error, match=r"knob file '.*missing\.knobs': cannot be read"):
        create(group)
