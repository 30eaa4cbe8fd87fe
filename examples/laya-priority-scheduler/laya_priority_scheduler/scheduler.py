"""The ``priority`` scheduler: the lowest ``SamplingParams.priority`` first."""

from __future__ import annotations

from laya_core.engine.request import Request
from laya_core.engine.scheduler import Scheduler
from laya_core.engine.step_plan import StepPlan


def tier(seq: Request) -> tuple[int, float]:
    """Lower first; within a tier, the earlier arrival."""
    return seq.params.priority, seq.arrival_time


class PriorityScheduler(Scheduler):
    """Admits the waiting sequences in tier order while the KV cache takes them, and runs
    decodes, then prefills, each in tier order."""

    def schedule(self) -> StepPlan:
        for seq in sorted(self.waiting, key=tier):
            if not self.can_admit(seq):
                break  # it holds back the tiers below: no starving a large request
            self.waiting.remove(seq)
            self.admit(seq)
        running = sorted(self.running, key=tier)
        decoding = [s for s in running if not s.is_prefilling]
        prefilling = [s for s in running if s.is_prefilling]
        return self.plan(decoding + prefilling)
