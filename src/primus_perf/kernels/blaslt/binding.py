"""One ctypes binding layer over :mod:`tables` for cuBLASLt and hipBLASLt.

Every library call goes through :meth:`BlasLt.call`, which checks its status; a failure
raises :class:`BlasLtError` naming the call and the status. Symbol names, the version query
and ctypes widths come from the vendor table. A :class:`Plan` (descriptors of one problem)
is a context manager: ``with lt.plan(p) as plan:`` destroys its descriptors on the way
out, also on an error. :func:`load` gives one clear :class:`~primus_perf.base.errors.DeviceError`
line when there is no GPU or no library.
"""

from __future__ import annotations

import ctypes
import glob
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from primus_perf.base import environment
from primus_perf.base.devices import gpu_vendor
from primus_perf.base.errors import DeviceError
from primus_perf.kernels.blaslt.layout import layouts
from primus_perf.kernels.blaslt.tables import TABLES, VendorTable
from primus_perf.problems import GemmProblem

c_void_p = ctypes.c_void_p


class BlasLtError(RuntimeError):
    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"{call} failed with status {status}")
        self.call = call
        self.status = status


def _candidate_paths(table: VendorTable) -> list[str]:
    paths: list[str] = []
    try:
        import torch

        site = os.path.dirname(os.path.dirname(torch.__file__))
        for name in table.lib_names:
            paths += sorted(glob.glob(os.path.join(site, "nvidia", "**", name), recursive=True))
            paths += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", name)))
    except ImportError:
        pass
    for root in (environment.get("CUDA_HOME"), environment.get("ROCM_PATH")):
        for name in table.lib_names:
            paths += glob.glob(os.path.join(root, "lib*", name))
    return paths + list(table.lib_names)


class BlasLt:
    """A loaded library with one handle."""

    def __init__(self, table: VendorTable, lib: ctypes.CDLL, path: str) -> None:
        self.t = table
        self.lib = lib
        self.path = path
        self._fn_cache: dict[str, Any] = {}
        self.handle = c_void_p()
        self.call("Create", ctypes.byref(self.handle))

    # ---- plumbing -----------------------------------------------------------------------
    def fn(self, name: str):
        full = self.t.prefix + name
        f = self._fn_cache.get(full)
        if f is None:
            f = getattr(self.lib, full)
            f.restype = ctypes.c_int
            self._fn_cache[full] = f
        return f

    def call(self, name: str, *args: Any) -> None:
        status = self.fn(name)(*args)
        if status != self.t.success:
            raise BlasLtError(self.t.prefix + name, status)

    def version(self) -> str:
        """The library's version, as the vendor table says to query and spell it."""
        t = self.t
        if t.version_takes_handle:
            out = ctypes.c_int()
            try:
                self.call(t.version_symbol, self.handle, ctypes.byref(out))
            except (AttributeError, BlasLtError):
                return "unknown"
            v = int(out.value)
        else:  # returns the encoded version itself, not a status
            f = getattr(self.lib, t.prefix + t.version_symbol)
            f.restype = ctypes.c_size_t
            v = int(f())
        if t.version_digits is None:
            return str(v)
        major, minor = t.version_digits
        return f"{v // major}.{(v // minor) % (major // minor)}.{v % minor}"

    def library_name(self) -> str:
        """The key of this library in a cache entry's versions ("cublasLt", "hipblasLt")."""
        return self.t.prefix

    def _set(self, setter: str, obj: c_void_p, attr: int, value: Any) -> None:
        buf = value if isinstance(value, ctypes.Array | ctypes._SimpleCData) else ctypes.c_int32(value)
        self.call(setter, obj, ctypes.c_int(attr), ctypes.byref(buf), ctypes.c_size_t(ctypes.sizeof(buf)))

    # ---- descriptors --------------------------------------------------------------------
    def matmul_desc(self, p: GemmProblem) -> c_void_p:
        desc = c_void_p()
        self.call("MatmulDescCreate", ctypes.byref(desc), ctypes.c_int(self.t.compute_type[p.compute]),
                  ctypes.c_int(self.t.data_type["f64" if p.compute == "f64" else "f32"]))
        a = self.t.desc_attr
        self._set("MatmulDescSetAttribute", desc, a["TRANSA"], ctypes.c_int32(self.t.op["T" if p.trans_a else "N"]))
        self._set("MatmulDescSetAttribute", desc, a["TRANSB"], ctypes.c_int32(self.t.op["T" if p.trans_b else "N"]))
        return desc

    def layout(self, dtype: str, rows: int, cols: int, ld: int, batch: int, stride: int) -> c_void_p:
        lay = c_void_p()
        self.call("MatrixLayoutCreate", ctypes.byref(lay), ctypes.c_int(self.t.data_type[dtype]),
                  ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(ld))
        if batch > 1:
            la = self.t.layout_attr
            self._set("MatrixLayoutSetAttribute", lay, la["BATCH_COUNT"], ctypes.c_int32(batch))
            self._set("MatrixLayoutSetAttribute", lay, la["STRIDED_BATCH_OFFSET"], ctypes.c_int64(stride))
        return lay

    def preference(self, workspace: int, reduction_mask: int | None = None) -> c_void_p:
        pref = c_void_p()
        self.call("MatmulPreferenceCreate", ctypes.byref(pref))
        pa = self.t.pref_attr
        self._set("MatmulPreferenceSetAttribute", pref, pa["MAX_WORKSPACE_BYTES"], ctypes.c_uint64(workspace))
        if reduction_mask is not None and "REDUCTION_SCHEME_MASK" in pa:
            self._set("MatmulPreferenceSetAttribute", pref, pa["REDUCTION_SCHEME_MASK"], ctypes.c_uint32(reduction_mask))
        for name in ("A", "B", "C", "D"):  # what the kernels check per call (their pointers' low bits)
            attr = pa.get(f"MIN_ALIGNMENT_{name}_BYTES")
            if attr is not None:
                self._set("MatmulPreferenceSetAttribute", pref, attr, ctypes.c_uint32(self.t.pointer_alignment))
        return pref

    def algo_config(self, algo: bytes) -> dict[str, int]:
        """Readable config of a cuBLASLt algo (empty on hipBLASLt): what TunableOp's
        cuBLASLt solution names spell (``cache.export``)."""
        t = self.t
        a = (ctypes.c_uint8 * t.algo_size).from_buffer_copy(algo)
        out = {}
        for name, attr in t.algo_config_attr.items():
            v = ctypes.c_uint64(0)  # every attribute fits; the library writes its own width
            written = ctypes.c_size_t()
            try:
                self.call("MatmulAlgoConfigGetAttribute", ctypes.byref(a), ctypes.c_int(attr),
                          ctypes.byref(v), ctypes.c_size_t(8), ctypes.byref(written))
            except BlasLtError:  # an attribute this library version does not have
                continue
            out[name] = int(v.value)
        return out

    def plan(self, p: GemmProblem) -> Plan:
        """Descriptors for one problem (kept alive by the returned plan; close it, or use it
        as a context manager). A descriptor that fails destroys the ones made before it."""
        desc = self.matmul_desc(p)
        made: list[c_void_p] = []
        try:
            for m in layouts(p):  # the one description of the four matrices (blaslt.layout)
                made.append(self.layout(m.dtype, m.rows, m.cols, m.ld, m.batch, m.stride))
        except BaseException:
            for lay in made:
                self.call("MatrixLayoutDestroy", lay)
            self.call("MatmulDescDestroy", desc)
            raise
        return Plan(self, p, desc, *made)


@dataclass
class Heuristic:
    algo: bytes  # the opaque algo struct
    workspace: int
    waves: float


@dataclass(frozen=True)
class LaunchArgs:
    """One plan's ``Matmul`` arguments but the operands, the output, the workspace pointer and
    the stream (:meth:`Plan.launch_args`): addresses, valid while ``keep`` (the scalars, the
    algorithm's buffer, the plan) is alive and the plan open. ``fn``: the library function's
    address (the native GEMM dispatch calls it, ``runtime/native.py``); ``call``: the ctypes
    function."""

    fn: int
    handle: int
    desc: int
    alpha: int
    beta: int
    layouts: tuple[int, int, int, int]  # A, B, C, D
    algo: int
    workspace: int  # bytes
    success: int
    call: Any
    keep: tuple


@dataclass
class Plan:
    lt: BlasLt
    problem: GemmProblem
    desc: c_void_p
    a: c_void_p
    b: c_void_p
    c: c_void_p
    d: c_void_p
    closed: bool = False

    def heuristics(self, count: int, workspace: int, reduction_mask: int | None = None) -> list[Heuristic]:
        t = self.lt.t
        pref = self.lt.preference(workspace, reduction_mask)
        try:
            buf = (ctypes.c_uint8 * (t.heuristic_size * count))()
            returned = ctypes.c_int()
            self.lt.call("MatmulAlgoGetHeuristic", self.lt.handle, self.desc, self.a, self.b, self.c, self.d,
                         pref, ctypes.c_int(count), buf, ctypes.byref(returned))
        finally:
            self.lt.call("MatmulPreferenceDestroy", pref)
        raw = bytes(buf)
        out = []
        o = t.heuristic_offsets
        for i in range(returned.value):
            rec = raw[i * t.heuristic_size : (i + 1) * t.heuristic_size]
            state = struct.unpack_from("<i", rec, o["state"])[0]
            if state != t.success:
                continue
            out.append(Heuristic(
                algo=rec[: t.algo_size],
                workspace=struct.unpack_from("<Q", rec, o["workspace"])[0],
                waves=struct.unpack_from("<f", rec, o["waves"])[0],
            ))
        return out

    def algo_config(self, algo: bytes) -> dict[str, int]:
        return self.lt.algo_config(algo)

    def with_config(self, algo: bytes, **attrs: int) -> tuple[bytes, int] | None:
        """A variant of a cuBLASLt algo with config attributes set, validated with AlgoCheck;
        returns (algo, workspace) or None when the variant is not supported."""
        t = self.lt.t
        if not t.algo_config_attr:
            return None
        a = (ctypes.c_uint8 * t.algo_size).from_buffer_copy(algo)
        res = (ctypes.c_uint8 * t.heuristic_size)()
        try:
            for name, value in attrs.items():
                v = t.algo_config_ctype[name](value)
                self.lt.call("MatmulAlgoConfigSetAttribute", ctypes.byref(a), ctypes.c_int(t.algo_config_attr[name]),
                             ctypes.byref(v), ctypes.c_size_t(ctypes.sizeof(v)))
            self.lt.call("MatmulAlgoCheck", self.lt.handle, self.desc, self.a, self.b, self.c, self.d,
                         ctypes.byref(a), res)
        except BlasLtError:  # the variant is not supported for this problem
            return None
        ws = struct.unpack_from("<Q", bytes(res), t.heuristic_offsets["workspace"])[0]
        return bytes(a), ws

    def launch_args(self, algo: bytes, workspace: int, alpha: float = 1.0) -> LaunchArgs:
        """The arguments of this plan's ``Matmul`` with ``algo`` but the operands, the output,
        the workspace pointer and the stream, as addresses (alpha; beta = 0; C aliases D)."""
        t = self.lt.t
        f = self.lt.lib[t.prefix + "Matmul"]  # a function object of its own: its argtypes are the launcher's
        f.restype = ctypes.c_int
        f.argtypes = [c_void_p] * 14 + [ctypes.c_size_t, c_void_p]
        scalar = ctypes.c_double if self.problem.compute == "f64" else ctypes.c_float
        al, be = scalar(alpha), scalar(0.0)
        a = (ctypes.c_uint8 * t.algo_size).from_buffer_copy(algo)
        return LaunchArgs(
            fn=ctypes.cast(f, c_void_p).value or 0, handle=self.lt.handle.value or 0, desc=self.desc.value or 0,
            alpha=ctypes.addressof(al), beta=ctypes.addressof(be),
            layouts=(self.a.value or 0, self.b.value or 0, self.c.value or 0, self.d.value or 0),
            algo=ctypes.addressof(a), workspace=workspace, success=t.success, call=f, keep=(al, be, a, self))

    def launcher(self, algo: bytes, workspace: int, alpha: float = 1.0) -> Callable[[int, int, int, int, int], None]:
        """``launch(a_ptr, b_ptr, d_ptr, workspace_ptr, stream)``: D = alpha * op(A) op(B)
        (beta = 0; C aliases D) with ``algo``, every argument but the five pointers built
        once (:meth:`launch_args`; a routed call pays one ctypes call of plain ints and the
        status check). ``launch.args`` holds them."""
        args = self.launch_args(algo, workspace, alpha)
        f, name, success = args.call, self.lt.t.prefix + "Matmul", args.success
        handle, desc, p_al, p_be, p_algo = args.handle, args.desc, args.alpha, args.beta, args.algo
        la, lb, lc, ld = args.layouts

        def launch(a_ptr: int, b_ptr: int, d_ptr: int, workspace_ptr: int, stream: int) -> None:
            status = f(handle, desc, p_al, a_ptr, la, b_ptr, lb, p_be, d_ptr, lc, d_ptr, ld, p_algo,
                       workspace_ptr or None, workspace, stream or None)
            if status != success:
                raise BlasLtError(name, status)

        launch.args = args  # type: ignore[attr-defined]  # alive as long as the launcher
        return launch

    def run(self, algo: bytes, a_ptr: int, b_ptr: int, d_ptr: int, workspace_ptr: int, workspace: int,
            stream: int, alpha: float = 1.0) -> None:
        """D = alpha * op(A) op(B) (beta = 0; C aliases D), once (:meth:`launcher` for many calls)."""
        self.launcher(algo, workspace, alpha)(a_ptr, b_ptr, d_ptr, workspace_ptr, stream)

    def close(self) -> None:
        """Destroy the descriptors (once; a closed plan cannot run)."""
        if self.closed:
            return
        self.closed = True
        for lay in (self.a, self.b, self.c, self.d):
            self.lt.call("MatrixLayoutDestroy", lay)
        self.lt.call("MatmulDescDestroy", self.desc)

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_loaded: dict[str, BlasLt] = {}


def load(vendor: str | None = None) -> BlasLt:
    """The library for the current GPU's vendor, loaded once per process."""
    if vendor is None:
        vendor = gpu_vendor()
        if vendor == "cpu":
            raise DeviceError("no CUDA or ROCm GPU is visible to torch; cuBLASLt/hipBLASLt need one")
    if vendor in _loaded:
        return _loaded[vendor]
    table = TABLES[vendor]
    errors = []
    for path in _candidate_paths(table):
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            errors.append(str(exc))
            continue
        _loaded[vendor] = BlasLt(table, lib, path)
        return _loaded[vendor]
    raise DeviceError(f"cannot load {table.lib_names[0]} (looked next to torch and in the CUDA/ROCm toolkit)")
