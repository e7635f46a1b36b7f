"""bench/expert_comm.py without a network: its arguments, its rows, gloo's placement of the plan's all-reduce, the
report on made-up measurements (the table, the checks, the last line) and the one line it exits with where it cannot
build two nodes. The measurement itself needs root and network namespaces: bench/RESULTS.md has its numbers."""
import types

import pytest

from benchlib import load, run, table_rows

MB = 1e6


@pytest.fixture(scope="module")
def bench():
    return load("expert_comm")


def row(bench, layout, option, step_s, payload=10.0, plan=10.0, own=None):
    return bench.Row(layout, option, step_s, 0.5, payload * 1.003 * MB, payload * MB, plan * MB,
                     (own if own is not None else plan) * MB, 1.003)


def test_report_table_checks_and_last_line(bench):
    rows = [row(bench, "ep2", "blocking", 3.0, payload=36.7, plan=36.6), row(bench, "ep2", "dedup", 1.0),
            row(bench, "ep2", "all", 0.75),
            row(bench, "ep4", "blocking", 4.0, plan=10.0, own=9.0), row(bench, "ep4", "dedup + node_aware", 2.5),
            row(bench, "ep4", "all", 2.0, payload=10.3)]
    lines = bench.report(rows, "# header", ["a note"])
    assert lines[0] == "# header" and "a note" in lines
    cells = table_rows("\n".join(lines))
    assert [c[:2] for c in cells] == [[r.layout, r.option] for r in rows]
    assert cells[2][2:5] == ["0.750", "4.00x", "50%"]  # step s, vs blocking, a2a share
    assert cells[0][5:] == ["36.810", "36.700", "36.600", "1.0027", "1.0027"]  # link, payload, plan, the two ratios
    assert "ep4: moep-plan's own link model (NCCL's hierarchical all-reduce) puts 9.000 MB/step between the nodes, " \
           "gloo's flat ring 1.000 MB more (the dense gradients)" in lines
    assert "payload / plan, farthest row: ep4 all +3.00% (target within 2%: MISSED)" in lines
    assert "ep2: blocking / best (all): 4.00x" in lines and "ep4: blocking / best (all): 2.00x" in lines
    assert lines[-1] == "blocking / best: 2.00x"  # the smaller over the layouts


def test_a2a_share_check(bench):
    rows = [bench.Row("ep2", "blocking", 1.0, 0.39, MB, MB, MB, MB, 1.0), row(bench, "ep2", "dedup", 0.9)]
    lines = bench.report(rows, "#")
    assert "ep2: the blocking step's share in the all-to-all 39% (needed >= 40%: NOT MET)" in lines
    assert "payload / plan, farthest row: ep2 blocking +0.00% (target within 2%: met)" in lines
    assert lines[-1] == "blocking / best: 1.11x"


def test_rows_per_layout(bench):
    assert bench.layout_options("ep2", fp8=True) == ["blocking", "dedup", "fp8_dispatch", "overlap_chunks", "all"]
    assert bench.layout_options("ep4", fp8=False) == ["blocking", "dedup", "dedup + node_aware", "overlap_chunks",
                                                      "all"]
    assert bench.comm_options("blocking", "ep4", fp8=True) == {"dedup": False, "node_aware": False,
                                                               "fp8_dispatch": False, "overlap_chunks": 1}
    assert bench.comm_options("all", "ep4", fp8=True) == {"dedup": True, "node_aware": True, "fp8_dispatch": True,
                                                          "overlap_chunks": 2}
    # one rank per node: node-aware would be dedup with an extra hop, so every ep2 row leaves it off
    assert bench.comm_options("all", "ep2", fp8=False) == {"dedup": True, "node_aware": False, "overlap_chunks": 2}
    assert bench.comm_options("overlap_chunks", "ep2", fp8=False) == {"dedup": False, "node_aware": False,
                                                                      "overlap_chunks": 2}


def test_gloo_ring_between_nodes(bench):
    """An all-reduce over 4 ranks, 2 per node: gloo's ring 0-1-2-3-0 crosses twice, each edge 2 (n-1)/n of the
    buffer; over 2 ranks, one per node, both edges cross (what moep-plan's link model says too)."""
    layout4 = types.SimpleNamespace(gpus=4, expert_parallel=4, cluster=types.SimpleNamespace(gpus_per_node=2))
    layout2 = types.SimpleNamespace(gpus=2, expert_parallel=2, cluster=types.SimpleNamespace(gpus_per_node=1))
    grads = types.SimpleNamespace(kind="all_reduce", span="data", total=1000)
    assert bench.gloo_inter_bytes(grads, layout4) == 2 * 1.5 * 1000
    assert bench.gloo_inter_bytes(grads, layout2) == 2 * 1 * 1000
    assert bench.rank_groups(4, 2, "expert") == [[0, 1], [2, 3]]
    assert bench.rank_groups(4, 2, "expert_data") == [[0, 2], [1, 3]]


@pytest.mark.parametrize("args, message", [
    (["--rate", "0"], "argument --rate: 0 is not a positive rate"),
    (["--steps", "0"], "argument --steps: 0 is not a positive integer"),
    (["--capacity_factor", "9"], "argument --capacity_factor: 9 must be in (0, --experts (8)]"),
    (["--router", "topk", "--k", "9"], "argument --k: 9 must be <= --experts (8)"),
])
def test_arguments_refused(args, message):
    with pytest.raises(AssertionError) as info:  # run() raises on a non-zero exit, with the output
        run("expert_comm.py", *args, timeout=120)
    assert f"expert_comm.py {tuple(args)} exited 2" in str(info.value) and str(info.value).rstrip().endswith(message)


def test_without_root_or_tools_one_line(bench, monkeypatch, capsys):
    assert bench.unavailable(euid=1000) == ("needs root to build two nodes (network namespaces, a veth pair, tc): "
                                            "running as uid 1000")
    assert bench.unavailable(euid=0, which=lambda tool: None if tool == "tc" else "/sbin/" + tool) == (
        "needs `tc` (iproute2) to build two nodes and throttle their link: not on PATH")
    assert bench.unavailable(euid=0, which=lambda tool: "/sbin/" + tool) is None
    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    assert bench.main([]) == 2
    err = capsys.readouterr().err
    assert err == "expert_comm.py: needs root to build two nodes (network namespaces, a veth pair, tc): running as " \
                  "uid 1000\n"
