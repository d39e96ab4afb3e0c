"""bench/eagle3_peer.py's pure parts: llama-server's per-pass acceptance lines and the acceptance both sides report.

The log lines are llama-server's format (tools/server/server-context.cpp, SLT_INF with LLAMA_TRACE=1); the expected
numbers are counted by hand from the lines.
"""

from __future__ import annotations

import bench_modules


def _peer():
    return bench_modules.load("eagle3_peer")


LOG = """\
0.00.617.804 W srv    load_model: LLAMA_TRACE = 1
0.02.101.002 I slot launch_slot_: id  0 | task 12 | processing task, is_child = 0
0.02.691.228 I slot   operator(): id  0 | task 12 | accepted  2/ 4 draft tokens
0.02.777.728 I slot   operator(): id  0 | task 12 | accepted  0/ 4 draft tokens
0.02.859.854 I slot   operator(): id  0 | task 12 | accepted  4/ 4 draft tokens
0.02.935.611 I slot   operator(): id  0 | task 12 | accepted  1/ 2 draft tokens
0.03.087.096 I slot print_timing: id  0 | task 12 | draft acceptance = 0.50000 (    7 accepted /    14 generated), mean len =  2.75
0.05.388.613 I slot   operator(): id  0 | task 15 | accepted  3/ 4 draft tokens (restore checkpoint)
0.05.468.367 I slot   operator(): id  0 | task 15 | accepted 10/12 draft tokens
0.05.500.001 I slot      release: id  0 | task 15 | stop processing: n_tokens = 80, truncated = 0
"""


def test_parse_server_log_groups_passes_and_summaries_by_task():
    tasks = _peer().parse_server_log(LOG)
    assert set(tasks) == {12, 15}
    assert tasks[12].rounds == [(2, 4), (0, 4), (4, 4), (1, 2)]
    assert tasks[12].summary == (7, 14) and tasks[12].restores == 0
    assert tasks[15].rounds == [(10, 12)]  # a restored pass is counted apart, not as a verification pass
    assert tasks[15].summary is None and tasks[15].restores == 1


def test_acceptance_counts_passes_with_drafts_and_positions():
    peer = _peer()
    acc = peer.Acceptance.of_rounds([(2, 4), (0, 4), (4, 4), (1, 2), (0, 0)])  # (0, 0): a plain last step
    assert (acc.passes, acc.drafted, acc.accepted) == (4, 14, 7)
    assert acc.length == 1 + 7 / 4 and acc.rate == 0.5
    # position i: passes that accepted at least i + 1 drafts, over all passes (llama.cpp's "acc per pos")
    assert acc.accepted_at == [3, 2, 1, 1]
    assert acc.per_position == [3 / 4, 2 / 4, 1 / 4, 1 / 4]
    merged = peer.Acceptance.of_rounds([(2, 4)])
    merged.merge(peer.Acceptance.of_rounds([(0, 4), (4, 4), (1, 2)]))
    assert merged == acc


def test_acceptance_of_no_passes_and_common_prefix():
    peer = _peer()
    empty = peer.Acceptance.of_rounds([(0, 0)])
    assert (empty.passes, empty.length, empty.rate, empty.per_position) == (0, 0.0, 0.0, [])
    assert peer.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert peer.common_prefix([1, 2], [1, 2, 3]) == 2
    assert peer.common_prefix([], [1]) == 0
