"""The native GEMM dispatch: the overrides of ``aten::mm``, ``bmm`` and ``addmm`` in C++
(``native_gemm.cpp``), so a routed call costs no Python.

The C++ overrides keep one table of call signatures (shapes, strides, dtypes, devices, the
bias's dtype); a signature's first call asks the attached owner (the runtime's GEMM dispatch,
``GemmDispatch.native_route``) what its calls run, and every later call runs it from the
table: torch's kernel (through the ``out=`` overload), or the stored cuBLASLt/hipBLASLt
algorithm through the library's ``Matmul`` with the arguments the router's kernel made once
(``blaslt.binding.LaunchArgs``). A kernel the C++ cannot call itself is called in Python from
the table. Every call the table must not answer (no owner attached: online routers, a
confirmation; inside a grouped GEMM, the C++ keeping this thread's depth of
``kernels.grouped.passes.inside``; while the profiler records; tensor subclasses) runs the
Python routes given to :func:`install`.

The extension is built once per source, torch version and flags with
``torch.utils.cpp_extension`` (a C++ compiler and, for CUDA, the CUDA runtime headers: under a
minute, in torch's extensions folder, shared by the processes of a machine). Where it cannot
be built, or with ``PRIMUS_PERF_NATIVE=0``, the Python overrides run and :func:`why_not` says why.
"""

from __future__ import annotations

import atexit
import hashlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from primus_perf.base import environment
from primus_perf.base.devices import gpu_vendor
from primus_perf.kernels.gemm import NATIVE_FALLBACK, NATIVE_LAUNCH, NATIVE_PYTHON, NATIVE_TORCH
from primus_perf.kernels.grouped.passes import inside

ENV = "PRIMUS_PERF_NATIVE"  # "0": the Python overrides only
SOURCE = Path(__file__).with_name("native_gemm.cpp")
# devices.gpu_vendor() -> the compiler's defines: which stream header native_gemm.cpp includes
DEFINES = {"nvidia": ["-DPRIMUS_CUDA"], "amd": ["-DPRIMUS_ROCM", "-D__HIP_PLATFORM_AMD__"], "cpu": []}

# torch's build lock (``BUILD_DIR/lock``) left by a build that was killed makes every later
# build wait for ever; one that lives longer than a build takes (under a minute) is removed
STALE_BUILD_LOCK_S = 300.0
_lock = threading.Lock()
_ext: Any = None
_why_not: str | None = None
_tried = False
_installed = False
_attached: Any = None  # the owner whose routes the C++ table holds
_at_exit = False  # uninstall registered with atexit


def _build(log: Callable[[str], None] | None) -> Any:
    import torch
    from torch.utils import cpp_extension

    vendor = gpu_vendor()
    defines = DEFINES[vendor]
    tag = hashlib.sha256(SOURCE.read_bytes() + repr((torch.__version__, defines, sys.version_info[:2])).encode())
    name = f"primus_perf_native_gemm_{tag.hexdigest()[:12]}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    _clear_stale_lock(build_dir / "lock", log)
    if log is not None and not any(build_dir.glob(f"{name}*.so")):
        log(f"primus-perf: building the native GEMM dispatch in {build_dir} (once per torch version; under a minute)")
    # with_cuda: torch's GPU libraries (c10_cuda or c10_hip, the stream) and the runtime's headers
    return cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=["-O2", *defines],
                              with_cuda=vendor != "cpu", build_directory=str(build_dir), verbose=False)


def _clear_stale_lock(lock: Path, log: Callable[[str], None] | None, poll_s: float = 0.5) -> None:
    """Wait while another process holds the build lock; remove it once it is older than
    :data:`STALE_BUILD_LOCK_S` (its build was killed: nothing will release it)."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_BUILD_LOCK_S:
            lock.unlink(missing_ok=True)
            (log or (lambda m: print(m, file=sys.stderr)))(
                f"primus-perf: removed the build lock {lock}, left {age / 60:.0f} min ago by a build that did not end")
            return
        time.sleep(poll_s)


def load(log: Callable[[str], None] | None = None) -> Any:
    """The extension module (built on first use), or None where it cannot run (:func:`why_not`)."""
    global _ext, _why_not, _tried
    with _lock:
        if _tried:
            return _ext
        _tried = True
        if not environment.get(ENV):
            _why_not = f"{ENV}=0"
            return None
        try:
            _ext = _build(log)
        except Exception as exc:  # no compiler, no CUDA headers: the Python overrides run
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            _why_not = f"the native GEMM dispatch could not be built ({first[:200]}); set {ENV}=0 to skip trying"
            return None
        kinds = (_ext.TORCH_ROUTED, _ext.FALLBACK, _ext.LAUNCH, _ext.PYTHON)
        if kinds != (NATIVE_TORCH, NATIVE_FALLBACK, NATIVE_LAUNCH, NATIVE_PYTHON):  # one numbering, two files
            _ext, _why_not = None, f"the native GEMM dispatch numbers its routes {kinds}, kernels.gemm otherwise"
            return None
        inside.mirror = (_ext.enter_grouped, _ext.exit_grouped)
        return _ext


def why_not() -> str | None:
    """Why the Python overrides run in place of the native ones (None: they need not)."""
    return _why_not


def installed() -> bool:
    return _installed


def install(dispatch_key: str, gemm: Callable[..., Any], addmm: Callable[..., Any]) -> bool:
    """Override ``aten::mm``, ``bmm`` and ``addmm`` at ``dispatch_key`` with the native kernels
    (``gemm(a, b)`` and ``addmm(bias, a, b, beta=, alpha=)``: the Python routes of the calls
    the table does not answer); False where the extension is not available."""
    global _installed, _at_exit
    ext = load()
    if ext is None:
        return False
    ext.install(dispatch_key, gemm, addmm)
    _installed = True
    if not _at_exit:  # a program that exits enabled: the table is emptied while Python runs
        atexit.register(uninstall)
        _at_exit = True
    return True


def uninstall() -> list:
    """Torch's kernels again; returns the detached owner's counts (:func:`attach`)."""
    global _installed
    if not _installed:
        return []
    counts = attach(None)
    _ext.uninstall()
    _ext.drop_retired()  # routes of detached owners (a call in flight at a switch may have held one)
    _installed = False
    return counts


def attach(owner: Any) -> list:
    """Hold ``owner``'s routes in the table (None: none; every call then runs the Python
    routes); returns the previous owner's counts since its last take, ``[(key, slot, routed,
    fallback, unaligned)]``."""
    global _attached
    if not _installed or owner is _attached:
        return []
    counts = _ext.attach(owner)
    _attached = owner
    return counts or []


def take_counts() -> list:
    """The attached owner's counts since the last take (``[]`` where none is attached)."""
    return _ext.take_counts() if _installed and _attached is not None else []


def mark_failed(key: str) -> None:
    """Every signature of problem ``key`` runs torch's kernel from now on."""
    if _installed:
        _ext.mark_failed(key)


def signatures() -> int:
    """Call signatures the table holds (0 while nothing is installed)."""
    return _ext.signatures() if _installed else 0
