"""Lanes: a single-GPU config's candidates measured on every GPU of the machine at once.

The search's session runs on one GPU; each other GPU gets a lane: a process with a session of
its own (the same config, the same seed), which measures the candidate it is handed against the
incumbent it is handed, in blocks interleaved on its own GPU (``tuner.measure.blocks``, as the
session does). A candidate's ratio is thus always of two settings on one GPU; different
candidates of one lever run on different GPUs at the same time. A lane that cannot start or
breaks is closed and its candidates go back to the session.

The lanes are spawned processes (CUDA does not survive a fork), each seeing only its own GPU
(``CUDA_VISIBLE_DEVICES`` set for it, one rank of one process: no process group).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import traceback
from collections.abc import Sequence
from typing import Any

from primus_perf.base import environment

OK, OOM, USER_ERROR, BROKEN = "ok", "oom", "user error", "broken"  # a lane's replies
START_TIMEOUT_S = 900.0  # a lane's trainer is built (and the first compile may come) within this


def _serve(conn: Any, session_class: Any, config: str, base: list[str], values: dict[str, Any],
           warm_up: int) -> None:
    """A lane's process: one session (``session_class(config, base, setting)``), then
    (incumbent, candidate) pairs measured until told to stop. Replies: (OK, (incumbent seconds,
    candidate seconds)), (OOM, why), (USER_ERROR, why: the trainer cannot run it here) or
    (BROKEN, traceback)."""
    session = None
    try:
        from primus_perf.base.errors import DivergedError, OutOfMemory, UserError, one_line
        from primus_perf.tuner.step.levers import Setting

        session = session_class(config, base, Setting(dict(values)))
        session.warm_up(warm_up)
        conn.send((OK, None))
        while True:
            msg = conn.recv()
            if msg is None:
                return
            incumbent, candidate, blocks, block_steps, settle = msg
            inc, cand = Setting(dict(incumbent)), Setting(dict(candidate))
            reply: tuple[str, Any]
            back = None  # how the session gets back to the incumbent, after the except block
            try:
                times = session.measure(inc, cand, blocks=blocks, block_steps=block_steps, settle=settle)
            except OutOfMemory as exc:
                reply, back = (OOM, str(exc)), session.recover
            except DivergedError as exc:  # non-finite weights: a fresh trainer from the seed
                reply, back = (USER_ERROR, str(exc)), session.reset
            except UserError as exc:
                reply, back = (USER_ERROR, str(exc)), session.recover
            except Exception as exc:  # a library's error in the step, as the session records it
                reply, back = (USER_ERROR, one_line(exc)), session.reset
            else:
                reply = (OK, times)
            if back is not None:  # the error (its traceback holds the failed step's tensors) is gone by now
                back(inc)
            conn.send(reply)
    except (EOFError, KeyboardInterrupt):
        return
    except BaseException:  # the coordinator reads it and closes the lane
        with contextlib.suppress(OSError):
            conn.send((BROKEN, traceback.format_exc()))
    finally:
        if session is not None:
            session.close()


class Lane:
    def __init__(self, index: int, visible: str | None, session_class: Any, config: str, base: Sequence[str],
                 values: dict[str, Any], warm_up: int = 0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.index, self.visible = index, visible
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, session_class, config, list(base), dict(values),
                                                        warm_up), daemon=True, name=f"primus-step-lane-{index}")
        # the child inherits the environment at its start: its GPU alone, no ranks
        changes = {"LOCAL_RANK": None, "RANK": None, "WORLD_SIZE": None}
        with environment.changed(changes if visible is None else {**changes, "CUDA_VISIBLE_DEVICES": visible}):
            self.process.start()
        child.close()
        self.error = ""

    @property
    def name(self) -> str:
        return f"GPU {self.visible}" if self.visible is not None else f"lane {self.index}"

    def ready(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        """Whether the lane's session started; else ``error`` says why."""
        reply = self._reply(timeout_s)
        if reply[0] != OK:
            self.error = str(reply[1])
            self.close()
            return False
        return True

    def submit(self, incumbent: dict[str, Any], candidate: dict[str, Any], blocks: int, block_steps: int,
               settle: int) -> None:
        self.conn.send((dict(incumbent), dict(candidate), blocks, block_steps, settle))

    def result(self, timeout_s: float | None = None) -> tuple[str, Any]:
        reply = self._reply(timeout_s)
        if reply[0] == BROKEN:
            self.error = str(reply[1])
            self.close()
        return reply

    def _reply(self, timeout_s: float | None) -> tuple[str, Any]:
        try:
            if not self.conn.poll(timeout_s):
                return BROKEN, f"{self.name}: no answer in {timeout_s:.0f} s"
            return self.conn.recv()
        except (EOFError, OSError):
            return BROKEN, f"{self.name}: its process ended (exit code {self.process.exitcode})"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.conn.close()


def visible_devices(count: int) -> list[str]:
    """The device ids, as ``CUDA_VISIBLE_DEVICES`` names them, of the first ``count`` GPUs
    torch sees."""
    names = [s.strip() for s in environment.get("CUDA_VISIBLE_DEVICES").split(",") if s.strip()]
    return [names[i] if i < len(names) else str(i) for i in range(count)]


def start_lanes(session_class: Any, config: str, base: Sequence[str], values: dict[str, Any],
                visible: Sequence[str | None], log: Any = lambda _m: None, warm_up: int = 0) -> list[Lane]:
    """A lane per entry of ``visible`` (a device id, or None: the machine's own devices, for a
    CPU), started together, each a ``session_class`` (``tune.StepSession``: a class, which a
    spawned process imports by name) run ``warm_up`` untimed steps; those that fail to start
    are left out, with a line saying why."""
    lanes = [Lane(i + 1, v, session_class, config, base, values, warm_up) for i, v in enumerate(visible)]
    ready = []
    for lane in lanes:
        if lane.ready():
            ready.append(lane)
        else:
            log(f"lane {lane.name} did not start: {lane.error.strip().splitlines()[-1] if lane.error else '?'}")
    return ready
