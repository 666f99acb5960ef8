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
  // PYTHON: run(a, b); LAUNCH: the arguments (their owner is the router's kernel). A reference
  // released only with the GIL held (release), never by a destructor: a table left at exit
  // is destroyed after the interpreter
  PyObject* payload = nullptr;
  std::atomic<int64_t> routed{0};    // calls that ran the route (torch's own choice included)
  std::atomic<int64_t> fallback{0};  // calls left to torch (no entry, a failed kernel)
  std::atomic<int64_t> unaligned{0};  // routed calls whose pointers sent them to torch's kernel
};

using Routes = std::vector<std::unique_ptr<Route>>;

// the GIL held
void release(Routes& routes) {
  for (auto& r : routes) Py_XDECREF(r->payload);
  routes.clear();
}

std::shared_mutex table_mutex;
std::unordered_map<Sig, std::unique_ptr<Route>, SigHash> table;
// routes of a detached router: a call in flight may still hold one; released at uninstall
Routes retired;
std::atomic<PyObject*> router{nullptr};  // the attached router (a new reference), or none
// the Python routes, for every other call: replaced at each install, never freed (a call in
// flight at uninstall may still use the old ones)
std::atomic<py::object*> py_gemm{nullptr};
std::atomic<py::object*> py_addmm{nullptr};
torch::Library* library = nullptr;  // the overrides while installed (freed at uninstall, not at exit)
thread_local int grouped_depth = 0;  // > 0 while this thread runs a grouped GEMM

struct Quiet : c10::WarningHandler {
  void process(const c10::Warning&) override {}  // "overriding a previously registered kernel": the point
};

bool plain(const at::Tensor& t) {
  return !t.unsafeGetTensorImpl()->is_python_dispatch();
}

Sig signature(int64_t op, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias) {
  // the caller checked the ranks: 2 and 2 (mm, addmm) or 3 and 3 (bmm)
  Sig s;
  std::memset(s.w, 0, sizeof(s.w));
  const int64_t rank = a.dim();
  s.w[0] = op | (rank << 8);
  s.w[1] = static_cast<int64_t>(a.scalar_type()) | (static_cast<int64_t>(b.scalar_type()) << 16) |
           ((bias ? static_cast<int64_t>(bias->scalar_type()) + 1 : 0) << 32);
  s.w[2] = static_cast<int64_t>(a.device().type()) | (static_cast<int64_t>(a.device().index() + 1) << 8) |
           (static_cast<int64_t>(b.device().type()) << 24) |
           (static_cast<int64_t>(b.device().index() + 1) << 32);
  for (int64_t i = 0; i < rank; ++i) {
    s.w[4 + i] = a.sizes()[i];
    s.w[7 + i] = a.strides()[i];
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
  // torch's kernel through the out= overload (not overridden), as kernels/gemm.py torch_mm;
  // operands of another rank than the op's get an empty output: torch's kernel says what is wrong
  const int64_t rank = op == BMM ? 3 : 2;
  std::vector<int64_t> shape{0};
  if (a.dim() == rank && b.dim() == rank) {
    shape.assign(a.sizes().begin(), a.sizes().end() - 1);
    shape.push_back(b.sizes().back());
  }
  at::Tensor out = at::empty(shape, a.options());
  if (bias != nullptr) return at::addmm_out(out, *bias, a, b);
  if (op == BMM) return at::bmm_out(out, a, b);
  return at::mm_out(out, a, b);
}

int64_t as_int(const py::handle& h) { return h.cast<int64_t>(); }
void* as_ptr(const py::handle& h) { return reinterpret_cast<void*>(h.cast<uintptr_t>()); }

// the attached router's answer for a new signature: (key, kind, slot, payload); none when
// the router was detached meanwhile
std::unique_ptr<Route> ask(PyObject* owner, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias) {
  py::gil_scoped_acquire gil;
  if (router.load() != owner) return nullptr;  // (attach changes it with the GIL held)
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
  r->payload = payload.release().ptr();
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
  if (!made) return nullptr;
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

// every signature of a problem goes to torch from now on
void mark_failed(const std::string& key) {
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  for (auto& kv : table) {
    if (kv.second->key == key) kv.second->kind.store(FALLBACK);
  }
}

// a tuned kernel failed: the router says so once (its native_failed marks the problem's
// other signatures through mark_failed) and counts the call as left to torch
void failed(PyObject* owner, Route* r, const std::string& why) {
  if (r->kind.exchange(FALLBACK) == FALLBACK) {  // another thread's call failed first
    r->fallback.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  py::gil_scoped_acquire gil;
  if (router.load() == owner) {
    py::reinterpret_borrow<py::object>(owner).attr("native_failed")(r->key, why);
  }
}

at::Tensor launch(PyObject* owner, Route* r, const at::Tensor& a, const at::Tensor& b, int64_t op, bool* ok) {
  const uintptr_t pa = reinterpret_cast<uintptr_t>(a.data_ptr());
  const uintptr_t pb = reinterpret_cast<uintptr_t>(b.data_ptr());
  if ((pa | pb) & r->misaligned) {
    r->unaligned.fetch_add(1, std::memory_order_relaxed);
    return torch_gemm(op, a, b, nullptr);
  }
  const c10::DeviceGuard guard(a.device());  // the operands' device, as torch's own kernel sets it
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

at::Tensor run_python(PyObject* owner, Route* r, const at::Tensor& a, const at::Tensor& b, int64_t op,
                      bool* ok) {
  std::string why;
  {
    py::gil_scoped_acquire gil;
    try {
      py::object out = py::reinterpret_borrow<py::object>(r->payload)(a, b);
      if (!out.is_none()) return out.cast<at::Tensor>();
    } catch (std::exception& e) {  // the kernel raised, or answered with something else than a tensor
      why = e.what();
    }
  }
  if (why.empty()) return torch_gemm(op, a, b, nullptr);  // the kernel answered None: torch's
  failed(owner, r, why);
  *ok = false;
  return at::Tensor();
}

at::Tensor python_route(int64_t op, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias,
                        const c10::Scalar* beta, const c10::Scalar* alpha) {
  py::gil_scoped_acquire gil;
  if (op == ADDMM) {
    return (*py_addmm.load())(*bias, a, b, py::arg("beta") = *beta, py::arg("alpha") = *alpha).cast<at::Tensor>();
  }
  return (*py_gemm.load())(a, b).cast<at::Tensor>();
}

at::Tensor route(int64_t op, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias,
                 const c10::Scalar* beta, const c10::Scalar* alpha) {
  PyObject* owner = router.load(std::memory_order_acquire);
  if (owner == nullptr || grouped_depth > 0 || torch::profiler::impl::profilerEnabled() || !plain(a) ||
      !plain(b) || (bias != nullptr && !plain(*bias))) {
    return python_route(op, a, b, bias, beta, alpha);
  }
  const int64_t rank = op == BMM ? 3 : 2;
  if (a.dim() != rank || b.dim() != rank) {  // torch's kernel raises its own error
    if (op != ADDMM) return torch_gemm(op, a, b, nullptr);
    at::Tensor out = at::empty({0}, a.options());
    return at::addmm_out(out, *bias, a, b, *beta, *alpha);
  }
  if (op == ADDMM) {  // only the bias epilogue is a problem of the router's
    if (!(beta->equal(1) && alpha->equal(1) && bias->dim() == 1 && bias->size(0) == b.size(1))) {
      std::vector<int64_t> shape{a.size(0), b.size(1)};
      at::Tensor out = at::empty(shape, a.options());
      return at::addmm_out(out, *bias, a, b, *beta, *alpha);
    }
  }
  const Sig s = signature(op, a, b, bias);
  Route* r = resolve(owner, s, a, b, bias);
  if (r == nullptr) return python_route(op, a, b, bias, beta, alpha);
  const int kind = r->kind.load(std::memory_order_relaxed);
  if (kind == TORCH_ROUTED || kind == FALLBACK) {
    (kind == FALLBACK ? r->fallback : r->routed).fetch_add(1, std::memory_order_relaxed);
    return torch_gemm(op, a, b, bias);
  }
  bool ok = true;
  at::Tensor out = kind == LAUNCH ? launch(owner, r, a, b, op, &ok) : run_python(owner, r, a, b, op, &ok);
  if (!ok) return torch_gemm(op, a, b, bias);  // counted by failed()
  r->routed.fetch_add(1, std::memory_order_relaxed);
  if (bias != nullptr) out.add_(*bias);
  return out;
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) { return route(MM, a, b, nullptr, nullptr, nullptr); }

at::Tensor bmm(const at::Tensor& a, const at::Tensor& b) { return route(BMM, a, b, nullptr, nullptr, nullptr); }

at::Tensor addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, const c10::Scalar& beta,
                 const c10::Scalar& alpha) {
  return route(ADDMM, a, b, &bias, &beta, &alpha);
}

// (key, slot, routed, fallback, unaligned) of every route of the table with calls since the
// last take; reset
py::list take_counts() {
  std::vector<Route*> routes;
  {
    std::shared_lock<std::shared_mutex> lock(table_mutex);
    for (auto& kv : table) routes.push_back(kv.second.get());
  }
  py::list out;
  for (Route* r : routes) {
    const int64_t routed = r->routed.exchange(0);
    const int64_t fallback = r->fallback.exchange(0);
    const int64_t unaligned = r->unaligned.exchange(0);
    if (routed != 0 || fallback != 0) out.append(py::make_tuple(r->key, r->slot, routed, fallback, unaligned));
  }
  return out;
}

// the router whose routes the table holds (None: none): the old one's counts are returned,
// its routes retired (a call in flight may still hold one)
py::list attach(py::object owner) {
  py::list counts = take_counts();
  PyObject* old = nullptr;
  {
    std::unique_lock<std::shared_mutex> lock(table_mutex);
    old = router.exchange(owner.is_none() ? nullptr : owner.inc_ref().ptr());
    for (auto& kv : table) retired.push_back(std::move(kv.second));
    table.clear();
  }
  Py_XDECREF(old);  // outside the lock: a finalizer may run GEMMs
  return counts;
}

void drop_retired() {
  Routes gone;
  {
    std::unique_lock<std::shared_mutex> lock(table_mutex);
    gone.swap(retired);
  }
  release(gone);
}

void install(const std::string& key, py::object gemm, py::object addmm_route) {
  if (library != nullptr) throw std::runtime_error("the native GEMM dispatch is already installed");
  py_gemm.store(new py::object(std::move(gemm)));
  py_addmm.store(new py::object(std::move(addmm_route)));
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::parseDispatchKey(key),
                                              __FILE__, __LINE__);
  lib->impl("mm", TORCH_FN(mm));
  lib->impl("bmm", TORCH_FN(bmm));
  lib->impl("addmm", TORCH_FN(addmm));
  library = lib.release();
}

void uninstall() {
  delete library;  // torch's kernels again
  library = nullptr;
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
  m.def("take_counts", &take_counts, "(key, slot, routed, fallback, unaligned) since the last take");
  m.def("drop_retired", &drop_retired, "release the routes of detached routers");
  m.def("mark_failed", &mark_failed, "every signature of a problem goes to torch from now on");
  m.def("enter_grouped", &enter_grouped, "this thread runs a grouped GEMM");
  m.def("exit_grouped", &exit_grouped, "this thread's grouped GEMM ended");
  m.def("signatures", &signatures, "call signatures in the table");
  m.attr("TORCH_ROUTED") = static_cast<int>(TORCH_ROUTED);
  m.attr("FALLBACK") = static_cast<int>(FALLBACK);
  m.attr("LAUNCH") = static_cast<int>(LAUNCH);
  m.attr("PYTHON") = static_cast<int>(PYTHON);
}
