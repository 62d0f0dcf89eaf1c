"""Quarantine by id range (orchestrator/idset.py, orchestrator/quarantine.py): the ledger's
``{"range": [lo, hi]}`` lines next to its ``{"sample": id}`` ones, merged into sorted
disjoint intervals; the entries a storage failure held back, ranges included; and what a
window sampler says a range costs the data budget (orchestrator/samplers.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator.errors import LedgerError
from orchestrator.idset import IdSet
from orchestrator.protocol import LEDGER_NAME
from orchestrator.quarantine import Ledger, held_back
from orchestrator.samplers import (
    RandomOffsetSampler,
    TokenStreamSampler,
    WindowDataset,
    id_share,
    id_span,
)

pytestmark = pytest.mark.timeout(60)


def test_idset_merges_ranges_and_answers_membership_like_a_set() -> None:
    """Random adds of ids and ranges and removals, against a set: the same members, in
    order, as few intervals as can be (overlapping and adjacent ones merged)."""
    rng = random.Random(0)
    ids, ref = IdSet(), set()
    for _ in range(3000):
        lo = rng.randrange(300)
        if rng.random() < 0.2:
            ids.discard(lo)
            ref.discard(lo)
        else:
            hi = lo + rng.randrange(6)
            ids.add_range(lo, hi)
            ref |= set(range(lo, hi))
    assert ids == ref and len(ids) == len(ref) and list(ids) == sorted(ref)
    spans = ids.ranges()
    assert all(a < b for a, b in spans)
    assert all(spans[k][1] < spans[k + 1][0] for k in range(len(spans) - 1))  # not adjacent
    probe = torch.arange(-3, 310)
    assert ids.mask(probe).tolist() == [int(i) in ref for i in probe]
    both = IdSet([4], ranges=[(5, 9), (1, 4)])
    assert both.ranges() == [(1, 9)] and len(both) == 8
    both |= IdSet(ranges=[(100, 10**12)])  # a range is never expanded into ids
    assert len(both) == 8 + 10**12 - 100 and 10**12 - 1 in both and 10**12 not in both
    assert both.count_in(0, 200) == 108
    assert np.int64(5) in both and "5" not in both  # numpy's integers are ids too


def test_ledger_round_trip_of_ids_and_ranges(tmp_path: Path) -> None:
    """Old ``sample`` lines still read; ``range`` lines are half-open; what overlaps merges;
    adding writes ranges as ranges."""
    path = tmp_path / LEDGER_NAME
    lines = [{"sample": 3}, {"range": [10, 20]}, {"sample": 20}, {"range": [15, 30]}]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    ledger = Ledger(str(path))
    got = ledger.load()
    assert got.ranges() == [(3, 4), (10, 30)] and len(got) == 21
    assert 3 in got and 29 in got and 30 not in got and 9 not in got
    ledger.add([40], step=7, reason="nonfinite_loss", ranges=[[100, 133]])
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert written[:4] == lines  # the old lines as they were
    assert [(e.get("sample"), e.get("range"), e["step"]) for e in written[4:]] == [
        (40, None, 7),
        (None, [100, 133], 7),
    ]
    assert Ledger(str(path)).load().ranges() == [(3, 4), (10, 30), (40, 41), (100, 133)]
    memory = Ledger("memory://ledger-ranges/q/quarantine.jsonl")
    memory.add([], step=1, reason="x", ranges=[[5, 8]])
    assert Ledger(memory.url).load() == {5, 6, 7}


@pytest.mark.parametrize(
    "bad",
    ['{"range": [5, 3]}', '{"range": [5]}', '{"range": "5-8"}', '{"range": [1.5, 3]}'],
    ids=["empty", "one_bound", "text", "float"],
)
def test_a_range_line_that_does_not_parse_names_file_and_line(tmp_path: Path, bad: str) -> None:
    path = tmp_path / LEDGER_NAME
    path.write_text('{"sample": 1}\n{"range": [2, 4]}\n' + bad + "\n")
    with pytest.raises(LedgerError, match="range") as caught:
        Ledger(str(path)).load()
    assert caught.value.line == 3 and caught.value.url == str(path)


def test_held_back_entries_keep_their_ranges() -> None:
    """A quarantine a storage failure kept out of the ledger is written at the next start,
    its range as a range; what a later write or the ledger already holds is not again."""

    def quarantine(step: int, samples: list[int], ranges: list[list[int]]) -> dict:
        details = {"samples": samples, "ranges": ranges, "persisted": False, "reason": "r"}
        return {"kind": "quarantine", "step": step, "details": details}

    events = [
        quarantine(5, [50], [[34, 67]]),  # held back
        quarantine(6, [90], [[74, 107]]),  # held back, then written late
        {"kind": "ledger_written", "step": 6, "details": {"samples": [], "ranges": [[74, 107]]}},
        quarantine(8, [300], [[284, 317]]),  # held back, but the ledger has it
        quarantine(9, [7, 500], []),  # ids without ranges, as before
    ]
    in_ledger = IdSet(ranges=[(280, 320)])
    assert held_back(events, in_ledger) == [([], 5, "r", [[34, 67]]), ([7, 500], 9, "r", [])]


def test_window_samplers_say_their_span_and_what_a_range_costs() -> None:
    """id_span is block_size + 1 (the tokens a window reads). A range's cost is the share
    of the draws it takes away: for random offsets the windows it holds of all windows;
    for the token stream the windows of an epoch it holds (the multiples of the stride)."""
    rand = RandomOffsetSampler(1016, 16, seed=0, rank=0, world_size=2)  # 1000 windows
    stream = TokenStreamSampler(1016, 16, rank=1, world_size=2)  # offsets 0, 16, ... 976
    data = WindowDataset(torch.zeros(1016, dtype=torch.int64), 16)
    assert rand.id_span == stream.id_span == data.id_span == 17
    assert id_span(rand, None) == id_span(None, data) == 17 and id_span(None, [1]) is None
    ranges = [(-10, 23), (990, 1033)]  # clipped to the windows that exist
    assert rand.share(ranges) == pytest.approx((23 + 10) / 1000)
    # Multiples of 16 in [0, 23) and [990, 992): 0, 16; the stream draws 62 per epoch.
    assert stream.share(ranges) == pytest.approx(2 / 62)
    assert stream.share([(17, 32)]) == 0.0
    ids = IdSet(ranges=[(100, 133)])
    assert id_share(ids, rand, data) == pytest.approx(33 / 1000)
    assert id_share(ids, None, data) == pytest.approx(33 / 1000)  # any sampler: uniform
    assert id_share(ids, None, list(range(1000))) is None  # ids that are not windows
