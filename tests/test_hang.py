"""`paratrain doctor --hang RUN_DIR` on hang records made here (the format paratrain/observe/hang.py writes): a chain of
waits across mesh groups, a rank busy outside collectives, and records that are not what they claim. A real hang
(rank 1 of 4 SIGSTOPped mid-step, the run's dumps read back) runs in tests/test_journeys.py (troubleshooting)."""

from __future__ import annotations

import json
import re

import pytest

from paratrain import cli
from paratrain.errors import UserError
from paratrain.observe.hang import diagnose

GROUPS = {"0": {"desc": "default_pg", "ranks": [0, 1, 2, 3]}}
TP = {0: ("3", [0, 1]), 1: ("3", [0, 1]), 2: ("4", [2, 3]), 3: ("4", [2, 3])}
DP = {0: ("1", [0, 2]), 1: ("2", [1, 3]), 2: ("1", [0, 2]), 3: ("2", [1, 3])}


def entry(group: tuple, seq: int, op: str, created_s: float, pg_id: int, shape=(2, 16, 64)) -> dict:
    name, desc = group
    return {"pg_id": pg_id, "process_group": [name, desc], "collective_seq_id": seq, "p2p_seq_id": 0,
            "profiling_name": f"gloo:{op}", "input_sizes": [list(shape)], "input_dtypes": ["Float"],
            "output_sizes": [list(shape)], "output_dtypes": ["Float"], "state": "scheduled", "retired": True,
            "is_p2p": False, "time_created_ns": int(created_s * 1e9),
            "frames": [{"name": "forward", "file": "/x/paratrain/models/llama.py", "line": 152}]}


def record(rank: int, entries: list[dict], completed: dict[int, int], peers=None, stack=()) -> dict:
    tp_name, tp_ranks = TP[rank]
    dp_name, dp_ranks = DP[rank]
    groups = {**GROUPS, tp_name: {"desc": "mesh_tp", "ranks": tp_ranks}, dp_name: {"desc": "mesh_dp_shard",
                                                                                  "ranks": dp_ranks}}
    status = {str(pg): {"last_enqueued_collective": max(e["collective_seq_id"] for e in entries if e["pg_id"] == pg),
                        "last_started_collective": -1, "last_completed_collective": done}
              for pg, done in completed.items()}
    return {"paratrain_hang_dump": 1, "rank": rank, "world_size": 4, "pid": 100 + rank, "host": "h", "time": 1000.0,
            "step": 3, "reason": "timeout", "history": "2000", "peers": peers or {}, "main_stack": list(stack),
            "groups": groups, "pg_status": status, "entries": entries}


def tp(rank):
    return TP[rank][0], "mesh_tp"


def dp(rank):
    return DP[rank][0], "mesh_dp_shard"


def write(run, records):
    (run / "hang").mkdir(parents=True)
    for r in records:
        (run / "hang" / f"rank{r['rank']}.json").write_text(json.dumps(r))


def test_a_stopped_rank_behind_a_chain_of_waits(tmp_path, capsys):
    """Rank 1 stopped: rank 0 waits for it in their tensor-parallel all-gather, rank 3 in their data-parallel
    all-gather; rank 2 waits for rank 0 (which waits for rank 1). Rank 1 is named, with both collectives it holds up."""
    run = tmp_path / "run"
    default = ("0", "default_pg")
    r0 = record(0, [entry(default, 9, "all_reduce", 990, 0, ()), entry(dp(0), 33, "all_gather", 991, 1, (4128,)),
                    entry(tp(0), 93, "all_gather", 992, 2)], {0: 9, 1: 33, 2: 92},
                peers={"1": {"pid": 101, "state": "stopped"}, "2": {"pid": 102, "state": "sleeping"}})
    r2 = record(2, [entry(default, 9, "all_reduce", 990, 0, ()), entry(tp(2), 93, "all_gather", 991, 2),
                    entry(dp(2), 34, "all_gather", 992, 1, (4128,))], {0: 9, 1: 33, 2: 93})
    r3 = record(3, [entry(default, 9, "all_reduce", 990, 0, ()), entry(tp(3), 93, "all_gather", 991, 2),
                    entry(dp(3), 34, "all_gather", 992, 1, (4128,))], {0: 9, 1: 33, 2: 93})
    write(run, [r0, r2, r3])
    lines = diagnose(run)
    assert lines[0] == f"hang records of {run}: 3 of 4 ranks (at step 4); none from rank 1"
    assert lines[1] == ("rank 1 is behind: rank 0 waits in all_gather #93 of mesh_tp (ranks 0, 1), 2x16x64 float "
                        "(8.0 KiB); it has not joined it: it wrote no record: its process (pid 101) was stopped "
                        "(SIGSTOP, or a debugger) when its peers looked; it also holds up all_gather #34 of "
                        "mesh_dp_shard (ranks 1, 3), 4128 float (16.1 KiB), which rank 3 waits in")
    assert len([x for x in lines if " is behind" in x]) == 1  # rank 0 is behind rank 2 too, but it waits itself
    assert lines[2] == ("  rank 0 waits in all_gather #93 of mesh_tp (ranks 0, 1), 2x16x64 float (8.0 KiB) for "
                        "8.0 s, issued at llama.py:152 forward")
    assert "rank 2 waits in all_gather #34 of mesh_dp_shard (ranks 0, 2)" in lines[3]
    assert cli.main(["doctor", "--hang", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_a_rank_busy_outside_collectives(tmp_path):
    """Rank 1 wrote its record (it answered SIGUSR2) but never issued the all-gather rank 0 waits in."""
    run = tmp_path / "run"
    r0 = record(0, [entry(tp(0), 92, "all_gather", 990, 2), entry(tp(0), 93, "all_gather", 992, 2)], {2: 92})
    r1 = record(1, [entry(tp(1), 92, "all_gather", 990, 2)], {2: 92},
                stack=['  File "/x/paratrain/training/loop.py", line 150, in fit\n    loss = slow()'])
    write(run, [r0, r1])
    line = next(x for x in diagnose(run) if "is behind" in x)
    assert line.startswith("rank 1 is behind: rank 0 waits in all_gather #93 of mesh_tp (ranks 0, 1)")
    assert "it never issued it (its last in this group: #92 all_gather); it is busy outside collectives, at " \
           'File "/x/paratrain/training/loop.py", line 150, in fit' in line


def test_without_a_history_the_silent_rank_is_still_named(tmp_path):
    """TORCH_FR_BUFFER_SIZE=0: the records hold no collectives, but rank 0 saw rank 1 stopped."""
    run = tmp_path / "run"
    r0 = record(0, [], {}, peers={"1": {"pid": 101, "state": "stopped"}})
    write(run, [{**r0, "pg_status": {}}])
    lines = diagnose(run)
    assert "rank 1 wrote no record: its process (pid 101) was stopped (SIGSTOP, or a debugger)" in lines[1]
    assert "no history kept" in lines[2]


@pytest.mark.parametrize("content, message", [
    ("not json", "rank0.json: not a JSON hang record"),
    (json.dumps({"rank": 0}), "rank0.json: not a paratrain hang record (field 'paratrain_hang_dump')"),
    (json.dumps({"paratrain_hang_dump": 1, "rank": 7, "world_size": 4}),
     "field 'rank' 7 is not a rank of world_size 4"),
    (json.dumps({"paratrain_hang_dump": 1, "rank": 0, "world_size": 4, "entries": [{"pg_id": "x"}], "pg_status": {},
                 "peers": {}, "groups": {}, "main_stack": []}), "field 'entries' holds an entry without"),
])
def test_records_that_are_not_what_they_claim(tmp_path, capsys, content, message):
    (tmp_path / "run" / "hang").mkdir(parents=True)
    (tmp_path / "run" / "hang" / "rank0.json").write_text(content)
    with pytest.raises(UserError, match=re.escape(message)):
        diagnose(tmp_path / "run")
    assert cli.main(["doctor", "--hang", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert cli.main(["doctor", "--hang", str(tmp_path / "nowhere")]) == 2
    assert "no such run folder" in capsys.readouterr().err


def test_records_written_at_once_by_two_threads_stay_whole(tmp_path):
    """A rank's own failure record (main thread) and a peer's SIGUSR2 request (the watcher thread) can coincide: the
    two writes take turns, so the record read back is always one whole JSON document."""
    import threading

    import torch.distributed as dist

    from paratrain.observe import hang

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def write(n):
            for _ in range(n):
                hang.dump(tmp_path, "request", {str(i): {"state": "running", "stack": "x" * 20000} for i in range(8)})

        threads = [threading.Thread(target=write, args=(15,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        record = json.loads((tmp_path / hang.FOLDER / "rank0.json").read_text())
        assert record["rank"] == 0 and record["reason"] == "request"
        assert not list((tmp_path / hang.FOLDER).glob(".*.tmp"))
    finally:
        dist.destroy_process_group()


def test_dtype_bytes_of_flight_recorder_names():
    """c10's names: a table for those without a width, the width for the others (BFloat16, the 8-bit floats)."""
    from paratrain.observe.hang import dtype_bytes

    assert [dtype_bytes(n) for n in ("Float", "Long", "Bool", "BFloat16", "Float8_e4m3fn", "Float8_e5m2", "Odd")] \
        == [4, 8, 1, 2, 1, 1, 4]
