// The native GEMM dispatch of enable() (runtime/native.py says when it is built and used).
//
// While installed, the backend kernels of aten::mm, aten::bmm and aten::addmm (one dispatch
// key: CUDA, or CPU for tests) are the functions below. A call of a signature seen before
// (shapes, strides, dtypes, devices, the bias's dtype or its absence) is answered from a
// table without Python: torch's kernel through the out= overload, or the stored
// cuBLASLt/hipBLASLt algorithm through the library's Matmul function, whose arguments
// (handle, descriptors, layouts, algorithm, workspace) the Python router made once. A new
// signature asks the attached router (`native_route`) what its calls run, once. Every
// other call (no router attached, a grouped GEMM's own GEMMs, the profiler recording, a
// tensor subclass) runs the Python routes it always ran (`gemm`, `addmm` given to install).
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/profiler/api.h>
#if defined(PRIMUS_ROCM)
#include <c10/hip/HIPStream.h>
#elif defined(PRIMUS_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// cublasLtMatmul / hipblasLtMatmul: one shape of arguments (DESIGN.md "vendor differences")
using MatmulFn = int (*)(void*, void*, const void*, const void*, void*, const void*, void*,
                         const void*, const void*, void*, void*, void*, const void*, void*,
                         size_t, void*);

// what a signature's calls run (native.py names the same numbers)
enum Kind : int { TORCH_ROUTED = 0, FALLBACK = 1, LAUNCH = 2, PYTHON = 3 };
enum Op : int64_t { MM = 0, BMM = 1, ADDMM = 2 };

constexpr int kWords = 16;

struct Sig {
  int64_t w[kWords];
  bool operator==(const Sig& o) const { return std::memcmp(w, o.w, sizeof(w)) == 0; }
};

struct SigHash {
  size_t operator()(const Sig& s) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : s.w) {
      h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

struct Route {
  std::atomic<int> kind{FALLBACK};
  std::string key;
  int64_t slot = -1;
  // LAUNCH: the library call's arguments but the operands, the output and the stream
  MatmulFn fn = nullptr;
  void* handle = nullptr;
  void* desc = nullptr;
  void* alpha = nullptr;
  void* beta = nullptr;
  void* la = nullptr;
  void* lb = nullptr;
  void* lc = nullptr;
  void* ld = nullptr;
  void* algo = nullptr;
  void* workspace = nullptr;
  size_t workspace_size = 0;
  int success = 0;
  uint64_t misaligned = 0;  // a pointer with any of these bits set runs torch's kernel
  std::vector<int64_t> out_shape;
  py::object payload;  // PYTHON: run(a, b); LAUNCH: the arguments (their owner is the router's kernel)
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> unaligned{0};
};

std::shared_mutex table_mutex;
std::unordered_map<Sig, std::unique_ptr<Route>, SigHash> table;
std::vector<std::unique_ptr<Route>> retired;  // routes of a cleared table: counted, no longer found
std::atomic<PyObject*> router{nullptr};        // the attached router (a new reference), or none
py::object* py_gemm = nullptr;                 // the Python routes, for every other call
py::object* py_addmm = nullptr;
std::unique_ptr<torch::Library> library;
thread_local int grouped_depth = 0;  // > 0 while this thread runs a grouped GEMM

struct Quiet : c10::WarningHandler {
  void process(const c10::Warning&) override {}  // "overriding a previously registered kernel": the point
};

bool plain(const at::Tensor& t) {
  return !t.unsafeGetTensorImpl()->is_python_dispatch();
}

Sig signature(int64_t op, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias) {
  Sig s;
  std::memset(s.w, 0, sizeof(s.w));
  const int64_t rank = a.dim();
  s.w[0] = op | (rank << 8) | (static_cast<int64_t>(b.dim()) << 16);
  s.w[1] = static_cast<int64_t>(a.scalar_type()) | (static_cast<int64_t>(b.scalar_type()) << 16) |
           ((bias ? static_cast<int64_t>(bias->scalar_type()) + 1 : 0) << 32);
  s.w[2] = static_cast<int64_t>(a.device().type()) | (static_cast<int64_t>(a.device().index() + 1) << 8) |
           (static_cast<int64_t>(b.device().type()) << 24) |
           (static_cast<int64_t>(b.device().index() + 1) << 32);
  if (rank > 3 || b.dim() > 3) {
    s.w[3] = -1;  // no route takes these: the Python route says what torch says
    return s;
  }
  for (int64_t i = 0; i < rank; ++i) {
    s.w[4 + i] = a.sizes()[i];
    s.w[7 + i] = a.strides()[i];
  }
  for (int64_t i = 0; i < b.dim(); ++i) {
    s.w[10 + i] = b.sizes()[i];
    s.w[13 + i] = b.strides()[i];
  }
  return s;
}

void* current_stream(const at::Tensor& t) {
#if defined(PRIMUS_ROCM)
  return static_cast<void*>(c10::hip::getCurrentHIPStream(t.get_device()).stream());
#elif defined(PRIMUS_CUDA)
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(t.get_device()).stream());
#else
  (void)t;
  return nullptr;
#endif
}

at::Tensor torch_gemm(int64_t op, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias) {
  // torch's kernel through the out= overload (not overridden), as kernels/gemm.py torch_mm
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end() - 1);
  shape.push_back(b.sizes().back());
  at::Tensor out = at::empty(shape, a.options());
  if (bias != nullptr) return at::addmm_out(out, *bias, a, b);
  if (op == BMM) return at::bmm_out(out, a, b);
  return at::mm_out(out, a, b);
}

int64_t as_int(const py::handle& h) { return h.cast<int64_t>(); }
void* as_ptr(const py::handle& h) { return reinterpret_cast<void*>(h.cast<uintptr_t>()); }

// the attached router's answer for a new signature: (key, kind, slot, payload)
std::unique_ptr<Route> ask(PyObject* owner, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias) {
  py::gil_scoped_acquire gil;
  py::object answer = py::reinterpret_borrow<py::object>(owner).attr("native_route")(
      a, b, bias ? py::cast(*bias) : py::none());
  auto t = answer.cast<py::tuple>();
  auto r = std::make_unique<Route>();
  r->key = t[0].cast<std::string>();
  const int kind = t[1].cast<int>();
  r->slot = as_int(t[2]);
  py::object payload = t[3];
  if (kind == LAUNCH) {
    auto p = payload.cast<py::tuple>();
    r->fn = reinterpret_cast<MatmulFn>(as_ptr(p[0]));
    r->handle = as_ptr(p[1]);
    r->desc = as_ptr(p[2]);
    r->alpha = as_ptr(p[3]);
    r->beta = as_ptr(p[4]);
    r->la = as_ptr(p[5]);
    r->lb = as_ptr(p[6]);
    r->lc = as_ptr(p[7]);
    r->ld = as_ptr(p[8]);
    r->algo = as_ptr(p[9]);
    r->workspace = as_ptr(p[10]);
    r->workspace_size = p[11].cast<size_t>();
    r->success = p[12].cast<int>();
    r->misaligned = p[13].cast<uint64_t>();
    for (auto d : p[14].cast<py::tuple>()) r->out_shape.push_back(as_int(d));
  }
  r->payload = payload;
  r->kind.store(kind);
  return r;
}

Route* find(const Sig& s) {
  std::shared_lock<std::shared_mutex> lock(table_mutex);
  auto it = table.find(s);
  return it == table.end() ? nullptr : it->second.get();
}

Route* resolve(PyObject* owner, const Sig& s, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor* bias) {
  Route* r = find(s);
  if (r != nullptr) return r;
  std::unique_ptr<Route> made = ask(owner, a, b, bias);
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  if (router.load() != owner) {  // detached while it answered: keep nothing of it
    retired.push_back(std::move(made));
    return nullptr;
  }
  auto& slot = table[s];
  if (!slot) slot = std::move(made);
  else retired.push_back(std::move(made));  // another thread answered first
  return slot.get();
}

// a tuned kernel failed: its problem goes to torch from now on, and the router says so once
void failed(PyObject* owner, Route* r, const std::string& why) {
  {
    std::unique_lock<std::shared_mutex> lock(table_mutex);
    for (auto& kv : table) {
      if (kv.second->key == r->key) kv.second->kind.store(FALLBACK);
    }
  }
  py::gil_scoped_acquire gil;
  py::reinterpret_borrow<py::object>(owner).attr("native_failed")(r->key, why);
}

at::Tensor launch(PyObject* owner, Route* r, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias,
                  int64_t op, bool* ok) {
  const uintptr_t pa = reinterpret_cast<uintptr_t>(a.data_ptr());
  const uintptr_t pb = reinterpret_cast<uintptr_t>(b.data_ptr());
  if ((pa | pb) & r->misaligned) {
    r->unaligned.fetch_add(1, std::memory_order_relaxed);
    return torch_gemm(op, a, b, nullptr);
  }
  at::Tensor out = at::empty(r->out_shape, a.options());
  void* d = out.data_ptr();
  // BLAS A is torch's b (problems/gemm.py)
  const int status = r->fn(r->handle, r->desc, r->alpha, reinterpret_cast<void*>(pb), r->la,
                           reinterpret_cast<void*>(pa), r->lb, r->beta, d, r->lc, d, r->ld, r->algo,
                           r->workspace, r->workspace_size, current_stream(a));
  if (status != r->success) {
    failed(owner, r, "Matmul returned status " + std::to_string(status));
    *ok = false;
    return at::Tensor();
  }
  return out;
}

at::Tensor run_python(PyObject* owner, Route* r, const at::Tensor& a, const at::Tensor& b, bool* ok) {
  std::string why;
  {
    py::gil_scoped_acquire gil;
    try {
      return r->payload(a, b).cast<at::Tensor>();
    } catch (py::error_already_set& e) {
      why = e.what();
    }
  }
  failed(owner, r, why);
  *ok = false;
  return at::Tensor();
}

at::Tensor python_route(int64_t op, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias,
                        const c10::Scalar* beta, const c10::Scalar* alpha) {
  py::gil_scoped_acquire gil;
  if (op == ADDMM) {
    return (*py_addmm)(*bias, a, b, py::arg("beta") = *beta, py::arg("alpha") = *alpha).cast<at::Tensor>();
  }
  return (*py_gemm)(a, b).cast<at::Tensor>();
}

at::Tensor route(int64_t op, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias,
                 const c10::Scalar* beta, const c10::Scalar* alpha) {
  PyObject* owner = router.load(std::memory_order_acquire);
  if (owner == nullptr || grouped_depth > 0 || torch::profiler::impl::profilerEnabled() || !plain(a) ||
      !plain(b) || (bias != nullptr && !plain(*bias))) {
    return python_route(op, a, b, bias, beta, alpha);
  }
  if (op == ADDMM) {  // only the bias epilogue is a problem of the router's
    if (!(beta->equal(1) && alpha->equal(1) && bias->dim() == 1 && b.dim() == 2 &&
          bias->size(0) == b.size(1))) {
      std::vector<int64_t> shape{a.size(0), b.size(1)};
      at::Tensor out = at::empty(shape, a.options());
      return at::addmm_out(out, *bias, a, b, *beta, *alpha);
    }
  }
  const Sig s = signature(op, a, b, bias);
  Route* r = resolve(owner, s, a, b, bias);
  if (r == nullptr) return python_route(op, a, b, bias, beta, alpha);
  const int kind = r->kind.load(std::memory_order_relaxed);
  at::Tensor out;
  bool ok = true;
  if (kind == LAUNCH) {
    out = launch(owner, r, a, b, bias, op, &ok);
  } else if (kind == PYTHON) {
    out = run_python(owner, r, a, b, &ok);
  } else {
    r->calls.fetch_add(1, std::memory_order_relaxed);
    return torch_gemm(op, a, b, bias);
  }
  if (!ok) return torch_gemm(op, a, b, bias);  // counted by the router's native_failed
  r->calls.fetch_add(1, std::memory_order_relaxed);
  if (bias != nullptr) out.add_(*bias);
  return out;
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) { return route(MM, a, b, nullptr, nullptr, nullptr); }

at::Tensor bmm(const at::Tensor& a, const at::Tensor& b) { return route(BMM, a, b, nullptr, nullptr, nullptr); }

at::Tensor addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, const c10::Scalar& beta,
                 const c10::Scalar& alpha) {
  return route(ADDMM, a, b, &bias, &beta, &alpha);
}

// (key, kind, slot, calls, unaligned) of every route with calls since the last take; reset
py::list take_counts_locked(std::vector<Route*> routes) {
  py::list out;
  for (Route* r : routes) {
    const int64_t calls = r->calls.exchange(0);
    const int64_t unaligned = r->unaligned.exchange(0);
    if (calls != 0 || unaligned != 0) {
      out.append(py::make_tuple(r->key, r->kind.load(), r->slot, calls, unaligned));
    }
  }
  return out;
}

py::list take_counts() {
  std::vector<Route*> routes;
  {
    std::shared_lock<std::shared_mutex> lock(table_mutex);
    for (auto& kv : table) routes.push_back(kv.second.get());
    for (auto& r : retired) routes.push_back(r.get());
  }
  return take_counts_locked(routes);
}

// detach the router: its routes are counted once more (returned) and forgotten
py::list attach(py::object owner) {
  py::list counts = take_counts();
  {
    std::unique_lock<std::shared_mutex> lock(table_mutex);
    PyObject* old = router.exchange(owner.is_none() ? nullptr : owner.inc_ref().ptr());
    for (auto& kv : table) retired.push_back(std::move(kv.second));
    table.clear();
    Py_XDECREF(old);
  }
  // the retired routes' counts were taken above (a call in flight may add one more: taken next time)
  return counts;
}

py::list drop_retired() {
  py::list counts = take_counts();
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  retired.clear();
  return counts;
}

void install(const std::string& key, py::object gemm, py::object addmm_route) {
  if (library) throw std::runtime_error("the native GEMM dispatch is already installed");
  py_gemm = new py::object(std::move(gemm));
  py_addmm = new py::object(std::move(addmm_route));
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::parseDispatchKey(key),
                                              __FILE__, __LINE__);
  lib->impl("mm", TORCH_FN(mm));
  lib->impl("bmm", TORCH_FN(bmm));
  lib->impl("addmm", TORCH_FN(addmm));
  library = std::move(lib);
}

void uninstall() {
  library.reset();  // torch's kernels again
  delete py_gemm;
  delete py_addmm;
  py_gemm = py_addmm = nullptr;
}

void enter_grouped() { ++grouped_depth; }

void exit_grouped() {
  if (grouped_depth > 0) --grouped_depth;
}

int64_t signatures() {
  std::shared_lock<std::shared_mutex> lock(table_mutex);
  return static_cast<int64_t>(table.size());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "override aten::mm, bmm, addmm at a dispatch key");
  m.def("uninstall", &uninstall, "torch's kernels again");
  m.def("attach", &attach, "the router whose routes the table holds (None: none); the old one's counts");
  m.def("take_counts", &take_counts, "(key, kind, slot, calls, unaligned) since the last take");
  m.def("drop_retired", &drop_retired, "forget detached routes (their counts returned)");
  m.def("enter_grouped", &enter_grouped, "this thread runs a grouped GEMM");
  m.def("exit_grouped", &exit_grouped, "this thread's grouped GEMM ended");
  m.def("signatures", &signatures, "call signatures in the table");
  m.attr("TORCH_ROUTED") = static_cast<int>(TORCH_ROUTED);
  m.attr("FALLBACK") = static_cast<int>(FALLBACK);
  m.attr("LAUNCH") = static_cast<int>(LAUNCH);
  m.attr("PYTHON") = static_cast<int>(PYTHON);
}
