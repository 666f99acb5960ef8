"""One dispatch per kind: the owner of a kind's routing in this process.

A kind's ``intercept`` part (``primus_perf.kinds``) is a :class:`Dispatch` subclass; :func:`of`
gives its one instance. The dispatch owns everything a routed call touches: the installed
router (``kernels``: pure, it answers a call with ``(key, run)``; or the online tuner's), the
interposer a confirmation installs, the call counts by problem key, the failures, and the
aten overrides (and Inductor pass) that send a program's calls to it, installed while anyone
holds them (:meth:`Dispatch.keep_overrides`: ``enable()``'s handle, the trainer's MoE backend). The
overrides are the only routing path: eager calls reach them through the dispatcher, compiled
ones through the pass's custom ops.

:meth:`Dispatch.answer` is the one path of a routed call: no route or a failed problem runs the
caller's ``baseline()`` (counted as fallback), a choice that is the caller's own runs it too
(counted as routed), a confirmation in progress gets the call, else the choice runs; a choice
that raises is said once and its problem runs the baseline from then on.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from primus_perf import kinds
from primus_perf.kernels.routing import OWN

BACKEND_KEYS = {"cuda": "CUDA", "cpu": "CPU"}  # device type -> dispatch key of its kernels
TORCH = "torch"  # the baseline of a call whose fallback is torch's own kernel
PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor subclasses are left to torch

_dispatches: dict[str, Dispatch] = {}


class Dispatch:
    """One kind's routing (module docstring). Subclasses: ``overrides(lib, key)`` registers the
    aten overrides in ``lib`` (or elsewhere, returning what removes them), ``compile_pass()``
    installs the Inductor pass (None: none)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.router: Any = None
        self.interposer: Any = None  # tuner.confirm.Confirmer while a confirmation runs
        self.routed: Counter[str] = Counter()
        self.fallback: Counter[str] = Counter()
        self.failed: set[str] = set()
        self._holders: set[int] = set()
        self._lock = threading.Lock()  # holds and releases from several threads
        self._lib: Any = None
        self._undo: Callable[[], None] | None = None
        self._pass: Any = None

    # ---- the router and the interposer ------------------------------------------------------

    def install(self, router: Any) -> None:
        """Route to ``router`` (None: none)."""
        self.router = router
        self.changed()

    def reset(self) -> None:
        """The counts and failures start again (a new router's)."""
        self.routed.clear()
        self.fallback.clear()
        self.failed.clear()

    def interpose(self, interposer: Any) -> None:
        """Hand every routed call to ``interposer`` (None: stop)."""
        self.interposer = interposer
        self.changed()

    def changed(self) -> None:
        """The router or the interposer changed (the GEMM dispatch's table follows)."""

    def prepare(self, log: Callable[[str], None] | None) -> None:
        """Before the overrides are first held: build what they need (the native GEMM table)."""

    def path(self) -> str | None:
        """How the program's calls reach the router, for the start lines (None: nothing to say)."""
        return None

    def baseline_name(self) -> str:
        """What a call runs without a route, as a confirmation names it."""
        return TORCH

    def baseline_solution(self, name: str) -> dict[str, Any] | None:
        """The cache solution of the baseline ``name`` (a confirmation writes it in place of a
        choice the step did not bear out); None: the kind cannot store it."""
        return None

    def confirm_key(self, key: str) -> str:
        """The key a confirmation times and judges a call of ``key`` under."""
        return key

    def entry_keys(self, key: str) -> list[str]:
        """The keys of the router's cache entries a verdict on ``key`` covers."""
        return [key]

    def cost_probe(self) -> tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any]] | None:
        """``(routed, plain)``: a call of the kind through the overrides in place and torch's
        own, to price what routing costs the host (None: not priced)."""
        return None

    # ---- the one path of a routed call --------------------------------------------------------

    def answer(self, key: str, run: Any, baseline: Callable[[], Any], probe: Callable[[], bool] | None = None, *,
               timed: Callable[[bool, Any, Any], Any] | None = None, pairing: Any = None) -> Any:
        """The call's result: ``run()`` for a routed choice, else ``baseline()`` (module
        docstring); ``probe()`` says whether the choice's call waited for the device on the host.
        For a confirmation: ``timed(is_choice, sample, clock)`` runs one side timed where its
        work is not all between two marks (attention's backward), and calls of one ``pairing``
        only are timed against each other (with and without a backward)."""
        if run is None or key in self.failed:
            self.fallback[key] += 1
            return baseline()
        if run is OWN:
            self.routed[key] += 1
            return baseline()
        if self.interposer is not None:
            self.routed[key] += 1
            return self.interposer.call(self, self.confirm_key(key), lambda: self.guarded(key, run), baseline, probe,
                                        timed=timed, pairing=pairing)
        out = self.guarded(key, run)
        if out is None:  # the kernel declined the call, or failed
            self.fallback[key] += 1
            return baseline()
        self.routed[key] += 1
        return out

    def guarded(self, key: str, run: Callable[[], Any]) -> Any:
        """``run()``, or None (said once, the problem failed) where it raises."""
        try:
            return run()
        except Exception as exc:
            self.fail(key, exc)
            return None

    def fail(self, key: str, exc: BaseException | str) -> None:
        """A tuned kernel failed: said once; its problem runs the baseline from now on."""
        if key not in self.failed:
            self.failed.add(key)
            print(f"tuning cache: tuned kernel for {key} failed ({exc}); its calls run {self.baseline_name()} from"
                  " now on", file=sys.stderr)

    def label(self, key: str) -> str:
        """The readable name of the router's choice for ``key``."""
        label = getattr(self.router, "label", None)
        return (label(key) if label is not None else None) or "cached"

    def summary(self) -> dict[str, Any]:
        """``{"routed": {key: calls}, "fallback": {key: calls}, "failed": [keys]}`` and what the
        router adds (online tuning: ``tuning``, ``online``)."""
        out = {"routed": dict(self.routed), "fallback": dict(self.fallback), "failed": sorted(self.failed)}
        details = getattr(self.router, "details", None)
        if details is not None:
            out.update(details())
        return out

    # ---- the overrides ------------------------------------------------------------------

    def overrides(self, lib: torch.library.Library, key: str) -> Callable[[], None] | None:
        raise NotImplementedError

    def compile_pass(self) -> Any:
        return None

    @property
    def intercepting(self) -> bool:
        return bool(self._holders)

    def keep_overrides(self, holder: object, device_type: str) -> None:
        """Keep the overrides installed (on ``device_type``'s kernels) while ``holder`` holds them."""
        if device_type not in BACKEND_KEYS:
            raise ValueError(f"device type {device_type!r}: one of {sorted(BACKEND_KEYS)}")
        with self._lock:
            if not self._holders:
                self._lib = torch.library.Library("aten", "IMPL")
                try:
                    with warnings.catch_warnings():  # "overriding a previously registered kernel": the point
                        warnings.simplefilter("ignore", UserWarning)
                        self._undo = self.overrides(self._lib, BACKEND_KEYS[device_type])
                    self._pass = self.compile_pass()
                except BaseException:
                    self._remove()  # nothing of a half-made interception stays
                    raise
            self._holders.add(id(holder))

    def release(self, holder: object) -> None:
        """``holder`` no longer needs the overrides; the last one out removes them."""
        self.release_id(id(holder))

    def release_id(self, holder_id: int) -> None:
        """:meth:`release` by the holder's ``id`` (a finalizer's, once the holder is gone)."""
        with self._lock:
            self._holders.discard(holder_id)
            if not self._holders:
                self._remove()

    def _remove(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None
        if self._pass is not None:
            self._pass.uninstall()
            self._pass = None


def of(kind: str) -> Dispatch:
    """The dispatch of ``kind`` (made on first use from the kind's ``intercept`` part);
    KeyError for a kind without one."""
    found = _dispatches.get(kind)
    if found is None:
        cls = kinds.get(kind).part("intercept")
        if cls is None:
            raise KeyError(f"kind {kind!r} has no intercept: its calls are not routed")
        found = _dispatches[kind] = cls(kind)
    return found


@contextmanager
def routing(routers: Mapping[str, Any], device_type: str) -> Iterator[None]:
    """``routers`` (kind -> router) installed in their kinds' dispatches, their overrides held,
    until exit (what was installed before comes back): a recording router, a tool's own."""
    before = {kind: of(kind).router for kind in routers}
    holder = object()
    try:
        for kind, router in routers.items():
            of(kind).install(router)
            of(kind).keep_overrides(holder, device_type)
        yield
    finally:
        for kind, router in before.items():
            of(kind).release(holder)
            of(kind).install(router)


def kinds_with_dispatch() -> tuple[str, ...]:
    """The kinds that have a dispatch (an ``intercept`` part)."""
    return tuple(kinds.with_part("intercept"))


# ---- torch.compile (Inductor) ------------------------------------------------------------------


class InductorPass:
    """A graph rewrite in one of Inductor's custom-pass slots, while installed. Its uuid (part
    of Inductor's cache keys) hashes the source files of the rewrite, so no graph compiled by
    another version of them is taken from a cache."""

    def __init__(self, slot: str, installed: Any) -> None:
        self.slot = slot
        self.installed = installed

    @classmethod
    def install(cls, slot: str, rewrite: Callable[[torch.fx.Graph], None], name: str, what: str,
                sources: tuple[str, ...]) -> InductorPass | None:
        """``rewrite`` in ``torch._inductor.config.<slot>``; None (with a warning that compiled
        ``what`` are not routed) where the slot holds somebody else's pass."""
        try:
            from torch._inductor import config
            from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
        except ImportError as exc:  # torch without Inductor, or without its custom-pass API
            warnings.warn(f"Inductor's custom passes are not available ({exc}); compiled {what} are not routed",
                          stacklevel=5)
            return None
        if getattr(config, slot) is not None:  # somebody else's pass: leave Inductor as it is
            warnings.warn(f"an Inductor {slot} is already set; compiled {what} are not routed", stacklevel=5)
            return None
        version = f"{name}/{get_hash_for_files((__file__, *sources)).hex()}"

        class _Pass(CustomGraphPass):
            def __call__(self, graph: torch.fx.Graph) -> None:
                rewrite(graph)

            def uuid(self) -> str:
                return version

        installed = _Pass()
        setattr(config, slot, installed)
        return cls(slot, installed)

    def uninstall(self) -> None:
        from torch._inductor import config

        if getattr(config, self.slot) is self.installed:
            setattr(config, self.slot, None)


def replace_node(graph: torch.fx.Graph, node: torch.fx.Node, target: Any, args: tuple[Any, ...]) -> None:
    """``node`` -> a call of ``target`` on ``args`` that takes its metadata and its uses."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
