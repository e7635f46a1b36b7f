"""Monitor: routing statistics of all data-parallel ranks, TensorBoard tokens-per-expert as shares."""
import json
import os
import pathlib

import pytest
import torch
import torch.distributed as dist

from moep_ds.training.monitor import Monitor, drop_rows_after

from ranks import run_ranks

WORLD = 2


class Recorder:
    """Stands in for the engine (distributed/engine.py) and DeepSpeed's monitor behind it: keeps what write_events
    receives."""

    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events += events

    def flush_events(self):
        pass


def rank_stats(rank: int) -> dict[str, torch.Tensor]:
    return {"layers.1.tokens_per_expert": torch.tensor([3.0 + rank, 1.0, 0.0, 4.0 * rank]),
            "layers.1.dropped_fraction": torch.tensor(0.25 * rank), "layers.1.router_entropy": torch.tensor(1.0 + rank)}


def _worker(run_dir: str) -> None:
    dist.init_process_group("gloo")  # a rank of tests/ranks.py: the launcher's environment
    rank = dist.get_rank()
    recorder = Recorder()
    monitor = Monitor(pathlib.Path(run_dir), recorder, enabled=rank == 0)
    monitor.log_step(10, {"loss": 2.0}, rank_stats(rank))
    monitor.log_step(10, {"val_loss": 1.5}, {})
    monitor.close()
    if rank == 0:
        with open(os.path.join(run_dir, "events.json"), "w") as f:
            json.dump(recorder.events, f)


@pytest.mark.slow
def test_statistics_are_summed_over_ranks_and_shown_as_shares(tmp_path):
    run_ranks(WORLD, _worker, str(tmp_path))
    counts = [sum(rank_stats(r)["layers.1.tokens_per_expert"][e].item() for r in range(WORLD)) for e in range(4)]
    assert counts == [7.0, 2.0, 0.0, 4.0]
    events = {tag: (value, step) for tag, value, step in json.loads((tmp_path / "events.json").read_text())}
    for e, count in enumerate(counts):
        assert events[f"moe/layers.1.tokens_per_expert/expert_{e}"] == (pytest.approx(count / 13), 10)
    assert events["moe/layers.1.dropped_fraction"] == (pytest.approx(0.125), 10)
    assert events["moe/layers.1.router_entropy"] == (pytest.approx(1.5), 10)
    assert events["train/loss"] == (2.0, 10) and events["val/loss"] == (1.5, 10) and "train/val_loss" not in events
    rows = [json.loads(line) for line in (tmp_path / "expert_utilization.jsonl").read_text().splitlines()]
    assert rows == [{"step": 10, "layers.1.dropped_fraction": 0.125, "layers.1.router_entropy": 1.5,
                     "layers.1.tokens_per_expert": counts}]


def test_resume_drops_later_rows_and_a_cut_off_last_line(tmp_path, caplog):
    """A killed run can leave half a line at the end of a log; resuming drops it with the rows after the
    checkpoint, so that the next row starts on a line of its own. A malformed line elsewhere is kept."""
    rows = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text(rows[0] + "garbage\n" + "".join(rows[1:]) + '{"step": 5, "lo')
    (tmp_path / "expert_utilization.jsonl").write_text("".join(rows))
    drop_rows_after(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == rows[0] + "garbage\n" + rows[1]
    assert (tmp_path / "expert_utilization.jsonl").read_text() == rows[0] + rows[1]
    assert "metrics.jsonl, line 6: dropping the cut-off last line an interrupted run left" in caplog.text
    assert "metrics.jsonl, line 2: not valid JSON; kept as it is" in caplog.text
    (tmp_path / "metrics.jsonl").write_text(rows[0] + rows[1].rstrip("\n"))  # whole, but its newline never written
    drop_rows_after(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == rows[0] + rows[1]
