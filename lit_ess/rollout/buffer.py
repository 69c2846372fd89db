"""RolloutBuffer: generated phases waiting to be trained, in order, with a hard staleness bound.

Phase p holds `k = steps_per_rollout` batches; batches are handed out in order, one per optimizer
step. A row sampled by policy version v and trained at step s has lag `s - v`; the bound is
`lag <= S` (`max_staleness`). When the trainer is about to take step `t` and `consumed` batches have
left the buffer (trained, or dropped whole by the filter), phase p's last batch is `ahead(p) =
(p + 1) * k - 1 - consumed` batches away, so it is trained at step `t + ahead(p)` at the latest (a
step skipped for a non-finite gradient consumes a batch without advancing the step: only earlier).
Phase p may therefore be generated only with weights of version

    v >= need(p, t) = t + ahead(p) - S                    (admission)

and when a batch is handed out, rows with lag > S are dropped and counted (`stale_dropped`): a sample
older than S steps is never trained on, whatever happened before (a resume with a smaller S, a slow
worker). Synchronous training is S = k - 1: phase p is generated with the weights of the step that
trains its first batch.

The buffer's state (ready batches with their versions and any proximal logprobs, counters) is part of
the checkpoint; requests in flight are kept by the owner and regenerated after a resume.
"""
from __future__ import annotations

from lit_ess.batch import RolloutBatch


class RolloutBuffer:
    def __init__(self, steps_per_rollout: int, max_staleness: int):
        if max_staleness < steps_per_rollout - 1:
            raise ValueError(f"data.schedule.max_staleness={max_staleness} is below data.batch.steps_per_rollout - 1 = "
                             f"{steps_per_rollout - 1}: "
                             f"the last step of a phase trains on data that many steps old")
        self.k, self.S = steps_per_rollout, max_staleness
        self.ready: dict[int, list[RolloutBatch]] = {}     # phase -> its batches not yet served
        self.next_phase = 0                                 # the phase being served
        self.consumed = 0                                   # batches handed out or dropped whole
        self.stale_dropped = 0                              # rows
        self.served = 0                                     # batches handed to the trainer

    def ahead(self, phase: int) -> int:
        """Batches between the next one to hand out and `phase`'s last batch."""
        return (phase + 1) * self.k - 1 - self.consumed

    def need(self, phase: int, step: int) -> int:
        """The oldest weights version that may generate `phase` when the trainer's next step is `step`."""
        return step + self.ahead(phase) - self.S

    def put(self, phase: int, batches: list[RolloutBatch]) -> None:
        if phase < self.next_phase or phase in self.ready:
            raise RuntimeError(f"rollout phase {phase} arrived twice (serving phase {self.next_phase})")
        self.ready[phase] = list(batches)

    def has_next(self) -> bool:
        return bool(self.ready.get(self.next_phase))

    def waiting(self, phase: int) -> list[RolloutBatch]:
        """The batches of `phase` not yet handed out (the objects themselves: a caller may annotate them)."""
        return list(self.ready.get(phase, []))

    def rows(self) -> int:
        return sum(b.rows for bs in self.ready.values() for b in bs)

    def take(self, step: int) -> RolloutBatch | None:
        """The next batch to train at `step`, rows older than S dropped; None if its phase is not ready."""
        while self.has_next():
            batches = self.ready[self.next_phase]
            batch = batches.pop(0)
            self.consumed += 1
            if not batches:
                del self.ready[self.next_phase]
                self.next_phase += 1
            fresh = (step - batch.versions) <= self.S
            if bool(fresh.all()):
                self.served += 1
                return batch
            self.stale_dropped += int((~fresh).sum())
            if bool(fresh.any()):
                self.served += 1
                return batch.select(fresh.nonzero().flatten().tolist())
        return None

    def pop_phase(self, phase: int) -> list[RolloutBatch]:
        """All remaining batches of the phase being served, unfiltered (inspection and tests)."""
        if phase != self.next_phase:
            raise RuntimeError(f"phase {phase} is not the one being served ({self.next_phase})")
        batches = self.ready.pop(phase)
        self.next_phase += 1
        self.served += len(batches)
        self.consumed += len(batches)
        return batches

    def state_dict(self) -> dict:
        return {"ready": {p: [b.to_state() for b in bs] for p, bs in self.ready.items()},
                "next_phase": self.next_phase, "consumed": self.consumed, "stale_dropped": self.stale_dropped,
                "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.ready = {int(p): [RolloutBatch.from_state(b) for b in bs] for p, bs in state["ready"].items()}
        self.next_phase, self.consumed = state["next_phase"], state["consumed"]
        self.stale_dropped, self.served = state["stale_dropped"], state["served"]
