"""ZeRO-3 construction (distributed/zero3.py): no rank holds the whole model, and the weights are the unpartitioned
model's."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
from tiny import launch  # noqa: E402

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_ranks_build_only_their_partitions_with_the_unpartitioned_weights(tmp_path, precision):
    """Every routed block type (stacked MSIT branches and MoEP paths included) on two processes: after the build
    every parameter is partitioned and no element is held whole; during it, never more than a module's worth; each
    gathered weight and every buffer (dtype too: zero.Init would turn fp32 buffers into bf16) equals the plain
    build's from the same seed, and so do the weight-decay groups."""
    out = tmp_path / "build.json"
    launch(2, SCRIPTS / "zero3_build.py", str(out), precision)
    result = json.loads(out.read_text())
    assert result["mismatches"] == []
    assert result["decay_groups_equal"]
    assert result["all_partitioned"] and result["whole_elements_after"] == 0
    model = result["model_elements"]
    assert model / 2 <= result["partition_elements"] <= model / 2 + 1000  # half each, plus padding
    assert result["whole_elements_at_registration_max"] < model / 4
