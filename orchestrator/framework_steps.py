"""The Guard's step protocol for a loop a framework drives, where the framework fetches a
whole optimizer step's micro-batches before it runs any (``transformers.Trainer``'s
``get_batch_samples``): hooks for integrations (``orchestrator/integrations/``), not users.

An integration calls, per optimizer step of ``n`` micro-batches:

1. :meth:`begin_step` (the framework's fetch): snapshot if due, then the step's ``n``
   micro-batches from the Guard's loader, each with its sample ids kept (always ``n``: a
   framework that counts micro-batches modulo ``n`` would otherwise step out of phase);
2. per micro-batch: :meth:`begin_micro`, the framework's forward and backward (reaching
   ``guard.backward``), then ``guard.step()`` (``"accumulate"`` before the last; on the last
   it judges and commits or starts the incident), then :meth:`end_micro`;
3. on an incident under investigation, :meth:`run_reruns` at once, nested inside the
   framework's step, so its outer loop never sees the re-runs; the verdict's rollback has
   happened when it returns.

A rollback rewinds the Guard's data as in ``guard.batches``: the next :meth:`begin_step`
replays the step from the snapshot's position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from orchestrator.crashes import IN_BODY
from orchestrator.rng import set_torch_rng_state, torch_rng_state
from orchestrator.stepping import StepInternals
from orchestrator.tuning import Intervals


class FrameworkSteps(StepInternals):
    """Part of the Guard (see the module docstring)."""

    intervals: Intervals
    _step_rng: tuple[torch.Tensor, Any] | None
    _queued: list[list[int]]  # the sample ids of each micro-batch begin_step returned

    # A stop (SIGTERM on some rank) agreed at a step's check waits for the next begin_step:
    # the framework finishes its step first (its scheduler step, its counters, its logging),
    # so the durable snapshot holds the step whole. Class defaults: guard.batches loops stop
    # at once, as before.
    _framework = False  # begin_step drives this Guard
    _stop_due = False

    def _stop(self) -> None:
        if self._framework:
            self._stop_due = True
        else:
            super()._stop()

    def _open_run(self, max_steps: int) -> None:
        """Before the first batch of this process: resume if there is something to resume
        from, and hold the initial snapshot."""
        if not self._resumed:
            self._resumed = True
            self.keeper.check_budget()  # with the objects register_state added since
            step: int | None = None
            if self.rejoin.replacement:  # issue 33: join the survivors instead
                step = self.rejoin.join()
            elif self.policy.persist.resume:
                step = self.keeper.resume()
            self.global_step = self.global_step if step is None else step
            self.lifecycle.say_if_done(self.global_step, max_steps)
        if not self.ring.snapshots():
            self.keeper.capture(self.global_step, initial=True)

    def begin_step(
        self,
        loader: Any,
        n: int,
        max_steps: int,
        probe: Callable[[Any], torch.Tensor] | None = None,
    ) -> list[Any]:
        """The ``n`` micro-batches of the next optimizer step, fetched now from ``loader``
        (the one ``guard.dataloader`` returned), after a snapshot if one is due. ``probe``
        is the framework's forward of a batch (as :meth:`run_reruns` takes it): when the
        previous attempt died in the loop body of one of these micro-batches, its samples
        are probed with it one at a time first (forward only), as ``guard.batches`` does.

        Raises:
            UsageError: a step is already running, or ``n`` is not the engine's
                micro-batches per step.
        """
        if self._phase != "idle" or self._micro != 0 or self.investigation.active:
            raise self._misuse("begin_step was called while a step is running")
        gas = self.engine.micro_steps_per_step
        if n != gas:
            raise self._misuse(
                f"begin_step({n}): the engine runs {gas} micro-batches per step; a step of "
                "fewer would put the framework's accumulation counter out of phase"
            )
        self.cursor.check_loader(loader)
        self._framework = True
        self._open_run(max_steps)
        if self._stop_due:
            self._stop_due = False
            super()._stop()  # raises Preempted
        step = self.global_step
        if step % self.intervals.snapshot_steps == 0 and not self.ring.has(step):
            self.keeper.capture(step)
        self._queued = []
        batches: list[Any] = []
        while len(batches) < n:
            self.cursor.open(loader, self.recovery.ledger.url)
            fetched = self.cursor.fetch()
            if fetched is None:
                continue  # end of an epoch: the step goes on into the next one
            # Past this micro-batch before fetching the next: each one's position (and so
            # its samples, for the incident) is its own. Moving past it again when its
            # guard.step returns "accumulate" changes nothing.
            self.cursor.micro_done()
            self._queued.append(fetched[0])
            batches.append(fetched[1])
        s = self._suspect
        if probe is not None and s is not None and s.step == step and s.micro < n:
            for batch in self._probe_crash(self._queued[s.micro]):
                self.backward(probe(batch))  # type: ignore[attr-defined]
                self.step()  # type: ignore[attr-defined]
        self._step_rng = torch_rng_state()
        return batches

    def begin_micro(self) -> None:
        """The next micro-batch of those :meth:`begin_step` returned runs now (its forward
        and ``guard.backward``): its samples are the ones a crash or a NaN is charged to."""
        if self._phase != "idle" or self._micro >= len(self._queued):
            raise self._misuse("begin_micro needs begin_step first, and runs each micro-batch once")
        self._begin_batch(self._queued[self._micro])
        self.marker.set(self.global_step, self._micro, -1, IN_BODY)

    def end_micro(self) -> None:
        """The micro-batch begun last is done (its ``guard.step`` was called)."""
        self._end_batch()

    def run_reruns(self, run: Callable[[Any], torch.Tensor]) -> None:
        """Run the investigation's re-runs of the bad step now, one after another, on every
        rank alike: ``run(batch)`` is the framework's forward of a batch of some of the
        step's samples and returns its loss; the Guard does the backward and judges it.
        Call it right after the last micro-batch's ``guard.step()`` returned
        ``"incident"``, before :meth:`end_micro`; it returns once the verdict is acted on."""
        while self.investigation.active:
            self._end_batch()  # the bad step's last micro-batch, then each re-run
            with self.investigation.rerun() as ids:
                batch = self.cursor.rerun_batch(ids)
                self._begin_batch(ids)
                if self._step_rng is not None:
                    set_torch_rng_state(self._step_rng)
                loss = run(batch)
                self.backward(loss)  # type: ignore[attr-defined]  # the Guard's (or a fault's)
                self.step()  # type: ignore[attr-defined]
