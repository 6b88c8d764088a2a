"""Fair tickets with real rollout workers: two vLLM engines, each with room for 64 groups (max_num_seqs=256,
4 samples a group) against a staleness window of (k + 1) * B = 8 tickets. Served in arrival order, the first engine's
64 parked requests take the window for 16 learner steps while the second idles (docs/reliability.md, measured:
busy 0.45 vs 0.11 over 40 steps). With fair tickets both engines get the same number of groups and both stay busy.

Busy time is not the scheduler's alone: at equal grants an engine that decodes slower (on a shared 2-core box one
of the two often does) holds its tickets longer. Measured: 0.79 / 0.79 on an idle box, 0.60 / 0.76 at grants
83 / 81 on a CI run, 0.39 / 0.59 at grants 76 / 84 in a full-suite run on the development box. So the grants are
held to 20% and the busy fractions to 0.6 of each other, well clear of the arrival-order rule's 0.24. "Busy" is the share of time a worker holds a ticket, so a faster engine reads lower
while the learner is the slower side: once an engine stopped waiting 50 ms after each weight load with its tickets
in hand (rollout/worker.py: _admit), it read 0.38 / 0.42 and 0.48 / 0.44 at grants 80 / 80. The floor (0.25)
stays above the arrival-order rule's starved engine (0.11)."""

import json

import pytest

from test_e2e_launch import _launch, _train_records

pytestmark = pytest.mark.slow

STEPS = 40
FAIR_RUN = ("cluster.rollout_workers=2", "rollout.rollout_batch_size=4", "rollout.num_return_sequences_in_group=4",
            "rollout.max_num_seqs=256", "rollout.max_staleness=1", f"trainer.total_steps={STEPS}",
            "trainer.eval_every=0", "data.num_eval_prompts=16")


def test_two_engines_are_kept_equally_busy(tmp_path):
    proc, records = _launch(tmp_path, *FAIR_RUN, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_train_records(records)) == STEPS
    admission = json.loads((tmp_path / "run" / "summary.json").read_text())["admission"]
    assert admission["fair_tickets"] is True
    busy = list(admission["busy_by_worker"].values())
    granted = list(admission["granted_by_worker"].values())
    # both engines worked most of the run (the old rule leaves one near 0.1), neither far behind the other
    assert len(busy) == 2 and min(busy) > 0.25, admission
    assert min(busy) >= 0.6 * max(busy), admission
    assert min(granted) >= 0.8 * max(granted), admission  # the groups themselves are shared too
