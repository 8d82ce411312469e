"""The programs of an SPMD launch, run one at a time, with ``nisa.core_barrier`` honored.

A launch of n > 1 programs (``kernel[n](...)``) runs each program in its own thread, but only one thread runs at a
time: program 0 runs until it ends or reaches a ``core_barrier``, then program 1 does, and so on round the grid. So a
barrier is "a synchronization point where all specified NeuronCores must reach before any can proceed" (the
``nki.isa.core_barrier`` page): what one program wrote to shared HBM before its barrier is there when another reads
it after its own. Without barriers the programs run whole, in order, as before.

The per-program state of the running context (program id, shared-HBM allocation cursor, the cost trace's core; on
an LNC launch, whose programs run on their own physical cores, also the loaded stationary and the engines'
accumulator registers) is saved and restored at each switch. A program that ends while
another has passed more barriers would leave that core waiting forever on hardware: refused after the launch.
"""

from __future__ import annotations

import threading

from .rules import NkiRuleError

class _Aborted(BaseException):
    """Raised in a waiting program when another one failed: the launch stops."""


class Programs:
    def __init__(self, ctx, starts: list[dict]):
        """`starts`: for each program, the context fields it starts with and keeps as its own (``program_id``,
        ``shared_hbm_cursor``; ``trace.core`` and the like for the cost trace's fields)."""
        self.ctx = ctx
        self.states = [dict(s) for s in starts]
        self.n = len(starts)
        self.turn = 0
        self.done = [False] * self.n
        self.barriers = [0] * self.n
        self.sends = [0] * self.n  # sendrecv calls made by each program
        self.mailbox: dict = {}  # (sender, its call number) -> the values it sent
        self.error: BaseException | None = None
        self.cv = threading.Condition()

    # ------------------------------------------------------------------------------------------------ switching
    def _save(self, i):
        state = self.states[i]
        for key in state:
            state[key] = getattr(self.ctx.trace, key[len("trace."):]) if key.startswith("trace.") else getattr(
                self.ctx, key)

    def _restore(self, i):
        for key, value in self.states[i].items():
            if key.startswith("trace."):
                if self.ctx.trace is not None:
                    setattr(self.ctx.trace, key[len("trace."):], value)
            else:
                setattr(self.ctx, key, value)

    def _pass_turn(self, i):
        """Hand the turn to the next program not yet done (under the lock)."""
        for step in range(1, self.n + 1):
            j = (i + step) % self.n
            if not self.done[j]:
                self.turn = j
                break
        else:
            self.turn = -1
        self.cv.notify_all()

    def _wait_turn(self, i):
        while self.turn != i:
            if self.error is not None:
                raise _Aborted()
            self.cv.wait()
        if self.error is not None:
            raise _Aborted()
        self._restore(i)

    # ---------------------------------------------------------------------------------------------------- API
    def barrier(self, i):
        """``core_barrier`` in program i: the others run up to theirs (or their end) before i goes on."""
        with self.cv:
            self._save(i)
            self.barriers[i] += 1
            self._pass_turn(i)
            self._wait_turn(i)

    def sendrecv(self, i, peer, values):
        """``nisa.sendrecv`` in program i: "the Nth sendrecv on one rank rendezvous with the Nth sendrecv on the
        peer rank" (the nki.lnc.sendrecv page). Leaves `values` for the peer, runs the others up to their next
        switch, and returns what `peer` sent at its call of the same number."""
        with self.cv:
            seq = self.sends[i]
            self.sends[i] += 1
            self.mailbox[(i, seq)] = values
        self.barrier(i)
        with self.cv:
            if (peer, seq) not in self.mailbox:
                raise NkiRuleError("core-barrier", f"sendrecv call {seq} of program {i} has no partner: program "
                                   f"{peer} reached a core_barrier or its end instead")
            return self.mailbox.pop((peer, seq))

    def run(self, body) -> list:
        """Run `body()` once per program; returns their results in program order."""
        results = [None] * self.n

        def worker(i):
            with self.cv:
                try:
                    self._wait_turn(i)
                except _Aborted:
                    self.done[i] = True
                    return
            try:
                results[i] = body()
            except _Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised in the launching thread
                with self.cv:
                    if self.error is None:
                        self.error = exc
            with self.cv:
                self.done[i] = True
                self._pass_turn(i)

        threads = [threading.Thread(target=worker, args=(i,), name=f"nki-program-{i}") for i in range(self.n)]
        self.ctx.programs = self
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            self.ctx.programs = None
        if self.error is not None:
            raise self.error
        if len(set(self.barriers)) > 1:
            raise NkiRuleError(
                "core-barrier", f"the programs passed different numbers of core_barrier calls ({self.barriers}): on "
                "hardware a core would wait forever at its barrier")
        return results

    def current(self) -> int:
        return self.turn
