// vllm_ir.ir.dispatch._fast_lookup: the cache-hit half of the eager hot path, in one C call.
//
// Building the decision-cache key in Python costs about 40 ns per tensor attribute read and
// hashing torch.device objects is slow, which puts a call that must consult a predicate near
// 1 us. Here one call reads the same facts straight from each TensorImpl and looks the key up.
//
// The pure-Python path in vllm_ir/ir/dispatch.py stays the reference: this module only ever
// answers with a cached decision or "ask Python" (None). Python handles misses, tracing,
// calls that need autograd, tensor subclasses, tensor lists and every error, and stores its
// decisions under the keys built by `Lookup.key`, so both paths share one cache.
//
// Most call sites call an op with one signature over and over (every layer's norm), so the
// last hit is kept and compared field by field first: no key, no hashing, no allocation.
// Python calls `forget()` whenever it clears the decision dicts.
//
// Key layout: (scope, a0, a1, ...) where a tensor argument becomes the bytes of its facts
// (see tensor_facts: the same facts as vllm_ir.ir.dispatch.cache_key.tensor_facts in Python: dtype,
// device, every dimension except the leading token dimension of token tensors, every stride)
// and any other argument is itself. When a tuning table chooses the op by token range
// (`set_buckets`), the key ends with the call's range bucket: buckets[bit length of T], T the
// leading dimension of the first token tensor that has one (1 without), as
// vllm_ir.ir.dispatch.cache_key.bucket computes it. Without buckets nothing is counted.
//
// donation_conflict() is the cheap aliasing check of `maybe_inplace` calls (see
// vllm_ir.ir.dispatch.donation for the Python reference it must agree with); call_facts() what the
// trace records of a call (vllm_ir.ir.dispatch.observe).

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/core/GradMode.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cstdint>
#include <cstring>
#include <ctime>

#ifndef VLLM_IR_BUILT_FOR_TORCH
#error "setup.py passes the torch version this module is compiled against"
#endif

namespace {

PyObject* compiling_flag_name = nullptr;  // interned "_is_compiling_flag"

constexpr int kDtypeBits = 8;
constexpr int kDeviceTypeBits = 8;
constexpr int kDeviceIndexBits = 9;
//: Tensors with more dimensions go to Python (the facts buffer lives on the stack).
constexpr int64_t kMaxDims = 24;
constexpr Py_ssize_t kMaxFacts = 2 + 2 * kMaxDims;

// Writes the facts of an exact torch.Tensor / nn.Parameter into `facts` and returns how many,
// or -1 when Python must look (not strided, too many dimensions, a field too large, or a
// tensor whose facts throw: functorch wrappers and the like). `token`: a token tensor of 2 or
// more dimensions, or 1-D of an integer dtype (positions), has the token (batch) count as its
// leading dimension, which predicates must not read, so it is left out (cache_key.has_token_dim).
// `lead`: the token count of the call's first such tensor (-1 until one is seen); with
// `relate`, whether this one has the same count is a fact (a [1, H] residual broadcast against
// a [T, H] activation is not the same call as a [T, H] one).
Py_ssize_t tensor_facts(PyObject* obj, bool token, bool relate, int64_t* lead, int64_t* facts) noexcept {
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.layout() != c10::kStrided) {
      return -1;
    }
    const int64_t dtype = static_cast<int64_t>(t.scalar_type());
    const c10::Device device = t.device();
    const int64_t device_type = static_cast<int64_t>(device.type());
    const int64_t device_index = static_cast<int64_t>(device.index()) + 1;
    const int64_t dim = t.dim();
    if (dtype >= (1L << kDtypeBits) || device_type >= (1L << kDeviceTypeBits) || device_index < 0 ||
        device_index >= (1L << kDeviceIndexBits) || dim > kMaxDims) {
      return -1;
    }
    // The header also records the number of dimensions, so [T] and 0-d differ.
    facts[0] = dtype | device_type << kDtypeBits | device_index << (kDtypeBits + kDeviceTypeBits) |
               dim << (kDtypeBits + kDeviceTypeBits + kDeviceIndexBits);
    Py_ssize_t n = 1;
    const auto sizes = t.sizes();
    const auto strides = t.strides();
    const bool drop_token = token && (dim >= 2 || (dim == 1 && c10::isIntegralType(t.scalar_type(), true)));
    for (int64_t d = drop_token ? 1 : 0; d < dim; ++d) {
      facts[n++] = sizes[d];
    }
    if (drop_token) {
      if (*lead < 0) {
        *lead = sizes[0];
      }
      if (relate) {
        facts[n++] = sizes[0] == *lead;
      }
    }
    for (int64_t d = 0; d < dim; ++d) {
      facts[n++] = strides[d];
    }
    return n;
  } catch (...) {
    return -1;
  }
}

struct Lookup {
  PyObject_HEAD
  PyObject* fixed;  // dict: scope -> decision (the first candidate accepts every call)
  PyObject* cache;  // dict: key -> decision
  PyObject* scope;  // the contextvars.ContextVar holding the priority scope
  PyObject* compiler_globals;  // torch.compiler's module dict: its _is_compiling_flag is read per call
  uint64_t tensor_mask;  // bit i: parameter i is a Tensor / Tensor | None
  uint64_t token_mask;   // bit i: parameter i's leading dimension is the token count
  bool relate_tokens;    // two or more token parameters: whether their token counts agree is a fact
  Py_ssize_t nargs;
  PyObject* buckets;        // bytes: bucket index per token-count bit length (0..64), or NULL: no bucket
  PyObject* last_key;       // the key of the last dict hit, or NULL
  PyObject* last_decision;  // its decision
};

// The range bucket of token count `lead` (-1: no token tensor, counted as one token).
long bucket_of(PyObject* buckets, int64_t lead) {
  const uint64_t t = lead < 0 ? 1 : static_cast<uint64_t>(lead);
  const int bits = t == 0 ? 0 : 64 - __builtin_clzll(t);
  return static_cast<unsigned char>(PyBytes_AS_STRING(buckets)[bits]);
}

// New reference to the key tuple, Py_None when Python must build it, NULL on error.
PyObject* build_key(Lookup* self, PyObject* scope, PyObject* const* args) {
  PyObject* key = PyTuple_New(self->nargs + 1 + (self->buckets != nullptr));
  if (key == nullptr) {
    return nullptr;
  }
  Py_INCREF(scope);
  PyTuple_SET_ITEM(key, 0, scope);
  bool complete = true;
  int64_t lead = -1;
  for (Py_ssize_t i = 0; i < self->nargs && complete; ++i) {
    PyObject* arg = args[i];
    PyObject* item = nullptr;
    if (self->tensor_mask >> i & 1) {
      if (arg == Py_None) {
        item = Py_NewRef(arg);
      } else if (THPVariable_CheckExact(arg)) {  // subclasses may redefine any fact: Python looks
        int64_t facts[kMaxFacts];
        const Py_ssize_t n = tensor_facts(arg, self->token_mask >> i & 1, self->relate_tokens, &lead, facts);
        if (n < 0) {
          complete = false;
          continue;
        }
        item = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(facts), n * sizeof(int64_t));
        if (item == nullptr) {
          Py_DECREF(key);
          return nullptr;
        }
      } else {
        complete = false;  // Python raises the error naming the argument
        continue;
      }
    } else if (PyList_Check(arg) || PyTuple_Check(arg)) {
      complete = false;  // Python freezes lists (tensors inside them by their facts)
      continue;
    } else {
      item = Py_NewRef(arg);
    }
    PyTuple_SET_ITEM(key, i + 1, item);
  }
  if (!complete) {  // the unset items are NULL, which tuple deallocation skips
    Py_DECREF(key);
    Py_RETURN_NONE;
  }
  if (self->buckets != nullptr) {
    PyObject* bucket = PyLong_FromLong(bucket_of(self->buckets, lead));
    if (bucket == nullptr) {
      Py_DECREF(key);
      return nullptr;
    }
    PyTuple_SET_ITEM(key, self->nargs + 1, bucket);
  }
  return key;
}

bool check_call(Lookup* self, Py_ssize_t nargs, const char* method) {
  if (self->scope == nullptr) {
    PyErr_Format(PyExc_TypeError, "Lookup.%s(): the Lookup was never initialized", method);
    return false;
  }
  if (nargs == self->nargs) {
    return true;
  }
  PyErr_Format(PyExc_TypeError, "Lookup.%s() takes %zd arguments, got %zd", method, self->nargs, nargs);
  return false;
}

// Replaces the memo with (key, decision), both stolen references or both NULL. Both fields
// change before the old ones are released: releasing may run a finalizer that calls the op
// again, which must see a consistent pair.
void set_memo(Lookup* self, PyObject* key, PyObject* decision) {
  PyObject* old_key = self->last_key;
  PyObject* old_decision = self->last_decision;
  self->last_key = key;
  self->last_decision = decision;
  Py_XDECREF(old_key);
  Py_XDECREF(old_decision);
}

// 1 when this call has the same key as the last hit, else 0 (never an error: Python looks).
int matches_last(Lookup* self, PyObject* key, PyObject* scope, PyObject* const* args) {
  if (PyTuple_GET_ITEM(key, 0) != scope || PyTuple_GET_SIZE(key) != self->nargs + 1 + (self->buckets != nullptr)) {
    return 0;
  }
  int64_t lead = -1;
  for (Py_ssize_t i = 0; i < self->nargs; ++i) {
    PyObject* arg = args[i];
    PyObject* item = PyTuple_GET_ITEM(key, i + 1);
    if (arg == item) {
      continue;
    }
    if (self->tensor_mask >> i & 1) {
      if (arg == Py_None || item == Py_None || !THPVariable_CheckExact(arg)) {
        return 0;
      }
      int64_t facts[kMaxFacts];
      const Py_ssize_t n = tensor_facts(arg, self->token_mask >> i & 1, self->relate_tokens, &lead, facts);
      if (n < 0 || PyBytes_GET_SIZE(item) != static_cast<Py_ssize_t>(n * sizeof(int64_t)) ||
          std::memcmp(PyBytes_AS_STRING(item), facts, n * sizeof(int64_t)) != 0) {
        return 0;
      }
      continue;
    }
    // Only builtin scalars of the same type compare by value: their == agrees with their
    // hash, as the dict lookup this short-cuts requires (a tensor's == does not). Anything
    // else equal by value but not identical goes to the dict.
    PyTypeObject* type = Py_TYPE(arg);
    if (type != Py_TYPE(item) || !(type == &PyFloat_Type || type == &PyLong_Type || type == &PyUnicode_Type)) {
      return 0;
    }
    const int equal = PyObject_RichCompareBool(arg, item, Py_EQ);
    if (equal <= 0) {
      PyErr_Clear();
      return 0;
    }
  }
  if (self->buckets != nullptr) {  // a tensor identical to the memo's cannot be: its item is bytes
    const long bucket = PyLong_AsLong(PyTuple_GET_ITEM(key, self->nargs + 1));
    if (bucket != bucket_of(self->buckets, lead)) {
      PyErr_Clear();
      return 0;
    }
  }
  return 1;
}

// lookup(*args) -> the cached decision for this call, or None: Python takes over.
PyObject* Lookup_lookup(PyObject* op, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<Lookup*>(op);
  if (!check_call(self, nargs, "lookup")) {
    return nullptr;
  }
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    Py_RETURN_NONE;  // tracing or a dispatch mode: the call must reach the torch op
  }
  // A profiler records this thread: Python runs the kernel in a named range. The profiler's
  // state is this thread's debug info (a thread-local read; profilerEnabled() would also load
  // the global profiler's state, atomically, costing more than the rest of a cache hit).
  if (c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) != nullptr) {
    Py_RETURN_NONE;
  }
  // torch.compiler.is_compiling() without the Python call (Dynamo itself is checked before
  // this call, by the generated entry point).
  PyObject* compiling = PyDict_GetItemWithError(self->compiler_globals, compiling_flag_name);
  if (compiling != Py_False) {
    if (compiling == nullptr && PyErr_Occurred()) {
      return nullptr;
    }
    Py_RETURN_NONE;  // compiling or exporting (or the flag is gone): the Python path decides
  }
  // Every tensor parameter must hold a tensor (an fx Proxy or a wrong type goes to Python,
  // which traces or names the argument), and a call that needs autograd goes to Python,
  // which routes it through the torch op's autograd formula.
  const bool grad_mode = c10::GradMode::is_enabled();
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (!(self->tensor_mask >> i & 1) || args[i] == Py_None) {
      continue;
    }
    if (!THPVariable_Check(args[i])) {
      Py_RETURN_NONE;
    }
    if (grad_mode) {
      try {
        if (THPVariable_Unpack(args[i]).requires_grad()) {
          Py_RETURN_NONE;
        }
      } catch (...) {
        Py_RETURN_NONE;
      }
    }
  }
  PyObject* scope = nullptr;
  if (PyContextVar_Get(self->scope, nullptr, &scope) < 0) {
    return nullptr;
  }
  PyObject* decision = PyDict_GetItemWithError(self->fixed, scope);
  if (decision != nullptr || PyErr_Occurred()) {
    Py_DECREF(scope);
    return Py_XNewRef(decision);
  }
  PyObject* last = Py_XNewRef(self->last_key);  // held: comparing may run Python code
  if (last != nullptr) {
    const bool hit = matches_last(self, last, scope, args) && self->last_key == last;
    Py_DECREF(last);
    if (hit) {
      Py_DECREF(scope);
      return Py_NewRef(self->last_decision);
    }
  }
  PyObject* key = build_key(self, scope, args);
  Py_DECREF(scope);
  if (key == nullptr || key == Py_None) {
    return key;
  }
  decision = Py_XNewRef(PyDict_GetItemWithError(self->cache, key));
  if (decision == nullptr) {
    Py_DECREF(key);
    PyErr_Clear();  // an unhashable argument: Python's lookup raises the error in context
    Py_RETURN_NONE;
  }
  set_memo(self, key, Py_NewRef(decision));
  return decision;
}

// forget(): drop the remembered last hit (the decision dicts are being cleared).
PyObject* Lookup_forget(PyObject* op, PyObject*) {
  set_memo(reinterpret_cast<Lookup*>(op), nullptr, nullptr);
  Py_RETURN_NONE;
}

// set_buckets(buckets): key calls on their token-range bucket (bytes of 65, one per bit
// length of the token count) or not (None); forgets the memo.
PyObject* Lookup_set_buckets(PyObject* op, PyObject* buckets) {
  auto* self = reinterpret_cast<Lookup*>(op);
  if (buckets != Py_None && !(PyBytes_CheckExact(buckets) && PyBytes_GET_SIZE(buckets) == 65)) {
    PyErr_SetString(PyExc_TypeError, "Lookup.set_buckets(): expected None or 65 bytes (one per bit length 0..64)");
    return nullptr;
  }
  set_memo(self, nullptr, nullptr);
  Py_XSETREF(self->buckets, buckets == Py_None ? nullptr : Py_NewRef(buckets));
  Py_RETURN_NONE;
}

// key(scope, *args) -> the cache key Python stores a new decision under, or None.
PyObject* Lookup_key(PyObject* op, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<Lookup*>(op);
  if (nargs < 1 || !check_call(self, nargs - 1, "key")) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_TypeError, "Lookup.key(scope, *args)");
    }
    return nullptr;
  }
  return build_key(self, args[0], args + 1);
}

int Lookup_init(PyObject* op, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<Lookup*>(op);
  static const char* names[] = {"fixed",       "cache",      "scope", "compiler_globals",
                                "tensor_mask", "token_mask", "nargs", nullptr};
  PyObject *fixed, *cache, *scope, *compiler_globals;
  unsigned long long mask, token_mask;
  Py_ssize_t n;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OO!KKn", const_cast<char**>(names), &PyDict_Type, &fixed,
                                   &PyDict_Type, &cache, &scope, &PyDict_Type, &compiler_globals, &mask, &token_mask,
                                   &n)) {
    return -1;
  }
  if (!PyContextVar_CheckExact(scope)) {
    PyErr_SetString(PyExc_TypeError, "Lookup: scope must be a contextvars.ContextVar");
    return -1;
  }
  if (n < 0 || n > 64) {
    PyErr_SetString(PyExc_ValueError, "Lookup: ops take at most 64 parameters");
    return -1;
  }
  Py_XSETREF(self->fixed, Py_NewRef(fixed));
  Py_XSETREF(self->cache, Py_NewRef(cache));
  Py_XSETREF(self->scope, Py_NewRef(scope));
  Py_XSETREF(self->compiler_globals, Py_NewRef(compiler_globals));
  set_memo(self, nullptr, nullptr);
  self->tensor_mask = mask;
  self->token_mask = token_mask;
  self->relate_tokens = __builtin_popcountll(token_mask) >= 2;
  self->nargs = n;
  return 0;
}

int Lookup_traverse(PyObject* op, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<Lookup*>(op);
  Py_VISIT(self->fixed);
  Py_VISIT(self->cache);
  Py_VISIT(self->scope);
  Py_VISIT(self->compiler_globals);
  Py_VISIT(self->buckets);
  Py_VISIT(self->last_key);
  Py_VISIT(self->last_decision);
  return 0;
}

int Lookup_clear(PyObject* op) {
  auto* self = reinterpret_cast<Lookup*>(op);
  Py_CLEAR(self->fixed);
  Py_CLEAR(self->cache);
  Py_CLEAR(self->scope);
  Py_CLEAR(self->compiler_globals);
  Py_CLEAR(self->buckets);
  set_memo(self, nullptr, nullptr);
  return 0;
}

void Lookup_dealloc(PyObject* op) {
  PyObject_GC_UnTrack(op);
  Lookup_clear(op);
  Py_TYPE(op)->tp_free(op);
}

// -- maybe_inplace aliasing -------------------------------------------------------------

// True when two elements of `t` may share memory (a stride-0 expand, or strides that
// interleave). Sufficient test: sorted by stride, each stride must step past everything the
// smaller dimensions reach. Anything it cannot prove is treated as overlapping.
bool may_self_overlap(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) {
    return false;
  }
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dimensions with size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) {
      dims.emplace_back(t.stride(d), t.size(d));
    }
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the largest element offset the dimensions so far can address
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) {
      return true;
    }
    reach += stride * (size - 1);
  }
  return false;
}

// Whether two non-empty tensors' byte ranges in one storage intersect (or cannot be told).
bool may_share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (!a.has_storage() || !b.has_storage()) {
    return true;
  }
  if (!a.storage().is_alias_of(b.storage())) {
    return false;
  }
  auto range = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) {
      last += t.stride(d) * (t.size(d) - 1);
    }
    const int64_t start = t.storage_offset() * static_cast<int64_t>(t.element_size());
    return std::make_pair(start, start + (last + 1) * static_cast<int64_t>(t.element_size()));
  };
  const auto [a0, a1] = range(a);
  const auto [b0, b1] = range(b);
  return a0 < b1 && b0 < a1;
}

// donation_conflict(donated_mask, tensor_mask, *args) -> None, or (i, j): donated argument i
// overlaps itself (j == i) or tensor argument j, so an in-place kernel must not run on it.
PyObject* donation_conflict(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || !PyLong_Check(args[0]) || !PyLong_Check(args[1]) || nargs - 2 > 64) {
    PyErr_SetString(PyExc_TypeError, "donation_conflict(donated_mask, tensor_mask, *args), at most 64 args");
    return nullptr;
  }
  const uint64_t donated = PyLong_AsUnsignedLongLongMask(args[0]);
  const uint64_t tensors = PyLong_AsUnsignedLongLongMask(args[1]);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  PyObject* const* call = args + 2;
  const Py_ssize_t n = nargs - 2;
  auto tensor_at = [&](Py_ssize_t i) -> const at::Tensor* {
    if (!(tensors >> i & 1) || !THPVariable_Check(call[i])) {
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(call[i]);
    return t.numel() == 0 ? nullptr : &t;
  };
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      const at::Tensor* a = (donated >> i & 1) ? tensor_at(i) : nullptr;
      if (a == nullptr) {
        continue;
      }
      if (may_self_overlap(*a)) {
        return Py_BuildValue("(nn)", i, i);
      }
      for (Py_ssize_t j = 0; j < n; ++j) {
        const at::Tensor* b = j == i ? nullptr : tensor_at(j);
        if (b != nullptr && may_share_memory(*a, *b)) {
          return Py_BuildValue("(nn)", i, j);
        }
      }
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// -- what the trace records of a call -----------------------------------------------------

//: Tensor parameters an op may have for the compiled fact reader (the key's mask holds 64).
constexpr Py_ssize_t kMaxTensorParams = 64;

// The facts a trace records of a call, read before the kernel runs (see call_facts).
struct Facts {
  PyObject* dtype;  // borrowed: torch's dtype objects live as long as torch
  bool cuda;
  int64_t tokens;  // -1: no token count
  Py_ssize_t n;    // values used
  int64_t values[kMaxTensorParams * (1 + kMaxDims)];
};

// Reads the facts of `call` (positional arguments) into `out`: the tensors at `tensors`, the
// token count of the first of `tokens` that has a token dimension, the dtype of `first` (-1:
// none). False when Python must read them: an index out of range, an argument that is neither
// None nor an exact strided tensor, a tensor whose sizes throw. Never sets a Python error.
bool read_facts(PyObject* const* call, Py_ssize_t n_call, const Py_ssize_t* tensors, Py_ssize_t n_tensors,
                const Py_ssize_t* tokens, Py_ssize_t n_tokens, Py_ssize_t first, Facts* out) noexcept {
  // An exact, strided tensor at position `i` of the call, or nullptr (`none`: the argument is
  // None; otherwise Python must look).
  auto tensor_at = [&](Py_ssize_t i, bool* none) -> const at::Tensor* {
    *none = false;
    if (i < 0 || i >= n_call) {
      return nullptr;
    }
    PyObject* arg = call[i];
    if (arg == Py_None) {
      *none = true;
      return nullptr;
    }
    if (!THPVariable_CheckExact(arg)) {  // subclasses may redefine any fact: Python looks
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(arg);
    return t.layout() == c10::kStrided && t.dim() <= kMaxDims ? &t : nullptr;
  };
  if (n_tensors > kMaxTensorParams) {
    return false;
  }
  try {
    bool none = false;
    out->dtype = Py_None;
    out->cuda = false;
    if (first >= 0) {
      const at::Tensor* t = tensor_at(first, &none);
      if (t != nullptr) {
        out->dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t->scalar_type()));
        out->cuda = t->is_cuda();
      } else if (!none) {
        return false;
      }
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t k = 0; k < n_tensors; ++k) {
      const at::Tensor* t = tensor_at(tensors[k], &none);
      if (t == nullptr) {
        if (!none) {
          return false;
        }
        out->values[n++] = -1;
        continue;
      }
      out->values[n++] = t->dim();
      for (const int64_t size : t->sizes()) {
        out->values[n++] = size;
      }
    }
    out->n = n;
    out->tokens = -1;
    for (Py_ssize_t k = 0; k < n_tokens && out->tokens < 0; ++k) {
      const at::Tensor* t = tensor_at(tokens[k], &none);
      if (t == nullptr) {
        if (!none) {
          return false;
        }
        continue;
      }
      const int64_t dim = t->dim();
      if (dim >= 2 || (dim == 1 && c10::isIntegralType(t->scalar_type(), /*includeBool=*/true))) {
        out->tokens = t->sizes()[0];
      }
    }
    return true;
  } catch (...) {  // a tensor whose sizes throw (symbolic, functorch wrappers): Python looks
    return false;
  }
}

// The indices of a tuple of ints into `out` (at most `max`); false (no error set) when one is
// not a non-negative int or there are too many.
bool parse_indices(PyObject* tuple, Py_ssize_t* out, Py_ssize_t max, Py_ssize_t* n) {
  *n = PyTuple_GET_SIZE(tuple);
  if (*n > max) {
    return false;
  }
  for (Py_ssize_t k = 0; k < *n; ++k) {
    out[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(tuple, k));
    if (out[k] < 0) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// call_facts(args, tensor_indices, token_indices, first) -> (dtype, is_cuda, shapes, tokens), or
// None when Python must read them (vllm_ir.ir.dispatch.observe.python_call_facts is the reference this
// must agree with). `dtype`, `is_cuda`: of args[first] (None, False when `first` is None).
// `shapes`: the bytes of int64 values, per tensor parameter in `tensor_indices`, -1 for None,
// else its number of dimensions and then its sizes. `tokens`: the leading dimension of the first
// tensor in `token_indices` that has a token dimension (cache_key.has_token_dim), or None.
// Each tensor attribute read from Python costs about as much as this whole call, and bytes are
// one allocation the garbage collector never tracks. (The traced runner reads the same facts
// without building this tuple: TracedRunner.)
PyObject* call_facts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) || !PyTuple_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "call_facts(args, tensor_indices, token_indices, first): three tuples and an index");
    return nullptr;
  }
  Py_ssize_t tensors[kMaxTensorParams], tokens[kMaxTensorParams], n_tensors, n_tokens;
  Py_ssize_t first = -1;
  if (args[3] != Py_None) {
    first = PyLong_AsSsize_t(args[3]);
    if (first < 0) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
  }
  if (!parse_indices(args[1], tensors, kMaxTensorParams, &n_tensors) ||
      !parse_indices(args[2], tokens, kMaxTensorParams, &n_tokens)) {
    Py_RETURN_NONE;
  }
  Facts facts;
  if (!read_facts(&PyTuple_GET_ITEM(args[0], 0), PyTuple_GET_SIZE(args[0]), tensors, n_tensors, tokens, n_tokens,
                  first, &facts)) {
    Py_RETURN_NONE;
  }
  PyObject* shapes =
      PyBytes_FromStringAndSize(reinterpret_cast<const char*>(facts.values), facts.n * sizeof(int64_t));
  if (shapes == nullptr) {
    return nullptr;
  }
  PyObject* count = facts.tokens < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(facts.tokens);
  if (count == nullptr) {
    Py_DECREF(shapes);
    return nullptr;
  }
  PyObject* out = PyTuple_New(4);
  if (out == nullptr) {
    Py_DECREF(shapes);
    Py_DECREF(count);
    return nullptr;
  }
  PyTuple_SET_ITEM(out, 0, Py_NewRef(facts.dtype));
  PyTuple_SET_ITEM(out, 1, Py_NewRef(facts.cuda ? Py_True : Py_False));
  PyTuple_SET_ITEM(out, 2, shapes);
  PyTuple_SET_ITEM(out, 3, count);
  return out;
}

// -- the compiled recorder ----------------------------------------------------------------
//
// A `Recorder` holds what a trace (vllm_ir.tools.tracing.Trace) records of the calls a
// `TracedRunner` times: rows (call site, dtype, token-count bit length) with their count, total
// and the ring of their last `max_samples` durations; calls per (module path, call site); the
// ring of the last `max_events` calls. It mirrors Trace.record, the Python reference that keeps
// running wherever the runner hands over (no extension, tensor subclasses, CUDA events, a
// profiler, a sink that is no Trace); the trace merges both when it is read. One recorder takes
// calls from every thread: an update runs no Python code, so the GIL makes it atomic (the
// Python recorder shards per thread to the same end).

int64_t monotonic_ns() {
  // The clock of time.perf_counter_ns on Linux, so events of both recorders order together.
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Row {
  PyObject* site;   // strong
  PyObject* dtype;  // strong
  int bits;
  int64_t calls = 0;
  int64_t total_ns = 0;
  std::vector<int64_t> samples;  // a ring once full: `next` is the oldest
  size_t next = 0;
};

struct Event {
  int64_t start_ns;
  int64_t duration_ns;
  int64_t tokens;  // -1: None
  int32_t row;
  int32_t shape;
  PyObject* module;  // borrowed: `outside` or a module the recorder's module counts hold
  unsigned long thread;
};

struct RowKey {
  PyObject* site;
  PyObject* dtype;
  int bits;
  bool operator==(const RowKey& o) const { return site == o.site && dtype == o.dtype && bits == o.bits; }
};

struct RowKeyHash {
  size_t operator()(const RowKey& k) const {
    return std::hash<void*>()(k.site) ^ (std::hash<void*>()(k.dtype) * 31) ^ (static_cast<size_t>(k.bits) << 7);
  }
};

struct PairHash {
  size_t operator()(const std::pair<PyObject*, PyObject*>& k) const {
    return std::hash<void*>()(k.first) ^ (std::hash<void*>()(k.second) * 31);
  }
};

struct RecorderState {
  size_t max_events;
  size_t max_samples;
  size_t max_shapes;
  uint64_t serial;  // unique per recorder: runners remember rows and shapes per recorder
  std::vector<Row> rows;
  std::unordered_map<RowKey, int32_t, RowKeyHash> row_index;
  std::vector<std::string> shapes;  // int64 values, as call_facts' bytes
  std::unordered_map<std::string, int32_t> shape_index;
  std::vector<Event> events;  // a ring once full: `next_event` is the oldest
  size_t next_event = 0;
  // (module path, call site) -> calls; both strong.
  std::unordered_map<std::pair<PyObject*, PyObject*>, int64_t, PairHash> modules;
};

uint64_t recorder_serials = 0;

struct Recorder {
  PyObject_HEAD
  RecorderState* state;
  PyObject* stacks;   // dict: thread -> the module paths entered, or NULL (calls are not attributed)
  PyObject* outside;  // the module path of calls outside every module
};

PyTypeObject RecorderType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// The number of these shapes (interned on first sight), or -1 when the table is full.
int32_t intern_shapes(RecorderState* s, const int64_t* values, Py_ssize_t n) {
  std::string key(reinterpret_cast<const char*>(values), n * sizeof(int64_t));
  auto found = s->shape_index.find(key);
  if (found != s->shape_index.end()) {
    return found->second;
  }
  if (s->shapes.size() >= s->max_shapes) {
    return -1;
  }
  const auto id = static_cast<int32_t>(s->shapes.size());
  s->shapes.push_back(key);
  s->shape_index.emplace(std::move(key), id);
  return id;
}

int32_t find_row(RecorderState* s, PyObject* site, PyObject* dtype, int bits) {
  const RowKey key{site, dtype, bits};
  auto found = s->row_index.find(key);
  if (found != s->row_index.end()) {
    return found->second;
  }
  const auto index = static_cast<int32_t>(s->rows.size());
  Row row;
  row.site = Py_NewRef(site);
  row.dtype = Py_NewRef(dtype);
  row.bits = bits;
  s->rows.push_back(std::move(row));
  s->row_index.emplace(key, index);
  return index;
}

template <typename T>
void ring_push(std::vector<T>& ring, size_t* next, size_t capacity, const T& value) {
  if (ring.size() < capacity) {
    ring.push_back(value);
    return;
  }
  ring[*next] = value;
  *next = (*next + 1) % capacity;
}

// The ring's items, oldest first.
template <typename T>
std::vector<T> ring_items(const std::vector<T>& ring, size_t next) {
  std::vector<T> out(ring.begin() + static_cast<std::ptrdiff_t>(next), ring.end());
  out.insert(out.end(), ring.begin(), ring.begin() + static_cast<std::ptrdiff_t>(next));
  return out;
}

int Recorder_init(PyObject* op, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<Recorder*>(op);
  static const char* names[] = {"max_events", "max_samples", "max_shape_sets", "outside", nullptr};
  Py_ssize_t max_events, max_samples, max_shapes;
  PyObject* outside;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nnnU", const_cast<char**>(names), &max_events, &max_samples,
                                   &max_shapes, &outside)) {
    return -1;
  }
  if (max_events < 0 || max_samples < 1 || max_shapes < 0 || max_shapes > INT32_MAX) {
    PyErr_SetString(PyExc_ValueError, "Recorder: max_events >= 0, max_samples >= 1, 0 <= max_shape_sets < 2**31");
    return -1;
  }
  if (self->state != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "Recorder: already initialized");
    return -1;
  }
  try {
    self->state = new RecorderState();
  } catch (...) {
    PyErr_NoMemory();
    return -1;
  }
  self->state->max_events = static_cast<size_t>(max_events);
  self->state->max_samples = static_cast<size_t>(max_samples);
  self->state->max_shapes = static_cast<size_t>(max_shapes);
  self->state->serial = ++recorder_serials;
  Py_XSETREF(self->outside, Py_NewRef(outside));
  return 0;
}

int Recorder_traverse(PyObject* op, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<Recorder*>(op);
  Py_VISIT(self->stacks);
  Py_VISIT(self->outside);
  if (self->state != nullptr) {
    for (const Row& row : self->state->rows) {
      Py_VISIT(row.site);
      Py_VISIT(row.dtype);
    }
    for (const auto& [key, n] : self->state->modules) {
      Py_VISIT(key.first);
      Py_VISIT(key.second);
    }
  }
  return 0;
}

int Recorder_clear(PyObject* op) {
  auto* self = reinterpret_cast<Recorder*>(op);
  RecorderState* state = self->state;
  self->state = nullptr;  // before any reference is released: a finalizer may record again
  Py_CLEAR(self->stacks);
  if (state != nullptr) {
    for (const Row& row : state->rows) {
      Py_DECREF(row.site);
      Py_DECREF(row.dtype);
    }
    for (const auto& [key, n] : state->modules) {
      Py_DECREF(key.first);
      Py_DECREF(key.second);
    }
    delete state;
  }
  Py_CLEAR(self->outside);  // last: events name it
  return 0;
}

void Recorder_dealloc(PyObject* op) {
  PyObject_GC_UnTrack(op);
  Recorder_clear(op);
  Py_TYPE(op)->tp_free(op);
}

RecorderState* recorder_state(PyObject* op) {
  auto* state = reinterpret_cast<Recorder*>(op)->state;
  if (state == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "Recorder: not initialized (or cleared)");
  }
  return state;
}

// set_stacks(stacks): attribute calls to the last module path in stacks[thread] (a dict of
// lists, `Trace._install_hooks`), or not (None).
PyObject* Recorder_set_stacks(PyObject* op, PyObject* stacks) {
  auto* self = reinterpret_cast<Recorder*>(op);
  if (stacks != Py_None && !PyDict_CheckExact(stacks)) {
    PyErr_SetString(PyExc_TypeError, "Recorder.set_stacks(): expected a dict or None");
    return nullptr;
  }
  Py_XSETREF(self->stacks, stacks == Py_None ? nullptr : Py_NewRef(stacks));
  Py_RETURN_NONE;
}

// The copies below are taken before any Python object is made: making one may collect garbage,
// whose finalizers may record calls (and move the vectors) meanwhile.

// rows() -> [(site, dtype, bits, calls, total_ns, [recent durations, oldest first])], in order of creation.
PyObject* Recorder_rows(PyObject* op, PyObject*) {
  RecorderState* s = recorder_state(op);
  if (s == nullptr) {
    return nullptr;
  }
  struct Copy {
    PyObject* site;
    PyObject* dtype;
    int bits;
    int64_t calls, total_ns;
    std::vector<int64_t> samples;
  };
  std::vector<Copy> rows;
  try {
    for (const Row& row : s->rows) {
      rows.push_back({row.site, row.dtype, row.bits, row.calls, row.total_ns, ring_items(row.samples, row.next)});
    }
  } catch (...) {
    return PyErr_NoMemory();
  }
  for (const Copy& row : rows) {  // held by the list below once built; hold them meanwhile
    Py_INCREF(row.site);
    Py_INCREF(row.dtype);
  }
  PyObject* out = PyList_New(0);
  for (size_t i = 0; i < rows.size() && out != nullptr; ++i) {
    const Copy& row = rows[i];
    PyObject* samples = PyList_New(static_cast<Py_ssize_t>(row.samples.size()));
    for (size_t k = 0; samples != nullptr && k < row.samples.size(); ++k) {
      PyObject* v = PyLong_FromLongLong(row.samples[k]);
      if (v == nullptr) {
        Py_CLEAR(samples);
        break;
      }
      PyList_SET_ITEM(samples, static_cast<Py_ssize_t>(k), v);
    }
    PyObject* item = samples == nullptr ? nullptr
                                        : Py_BuildValue("(OOiLLN)", row.site, row.dtype, row.bits,
                                                        static_cast<long long>(row.calls),
                                                        static_cast<long long>(row.total_ns), samples);
    if (item == nullptr || PyList_Append(out, item) < 0) {
      Py_XDECREF(item);
      Py_CLEAR(out);
      break;
    }
    Py_DECREF(item);
  }
  for (const Copy& row : rows) {
    Py_DECREF(row.site);
    Py_DECREF(row.dtype);
  }
  return out;
}

// modules() -> [(module path, site, calls)].
PyObject* Recorder_modules(PyObject* op, PyObject*) {
  RecorderState* s = recorder_state(op);
  if (s == nullptr) {
    return nullptr;
  }
  std::vector<std::pair<std::pair<PyObject*, PyObject*>, int64_t>> copy;
  try {
    copy.assign(s->modules.begin(), s->modules.end());
  } catch (...) {
    return PyErr_NoMemory();
  }
  for (const auto& [key, n] : copy) {
    Py_INCREF(key.first);
    Py_INCREF(key.second);
  }
  PyObject* out = PyList_New(0);
  for (const auto& [key, n] : copy) {
    PyObject* item = Py_BuildValue("(OOL)", key.first, key.second, static_cast<long long>(n));
    if (item == nullptr || PyList_Append(out, item) < 0) {
      Py_XDECREF(item);
      Py_CLEAR(out);
      break;
    }
    Py_DECREF(item);
  }
  for (const auto& [key, n] : copy) {
    Py_DECREF(key.first);
    Py_DECREF(key.second);
  }
  return out;
}

// events() -> [(start_ns, duration_ns, row number, shapes bytes, tokens, module path, thread)], oldest first.
PyObject* Recorder_events(PyObject* op, PyObject*) {
  auto* self = reinterpret_cast<Recorder*>(op);
  RecorderState* s = recorder_state(op);
  if (s == nullptr) {
    return nullptr;
  }
  std::vector<Event> events;
  std::vector<std::string> shapes;
  try {
    events = ring_items(s->events, s->next_event);
    shapes = s->shapes;
  } catch (...) {
    return PyErr_NoMemory();
  }
  // Event modules are borrowed from the module counts or `outside`, which only grow until the
  // recorder is cleared: hold them while Python objects are made.
  std::vector<PyObject*> held;
  for (const Event& e : events) {
    held.push_back(Py_NewRef(e.module));
  }
  PyObject* out = PyList_New(0);
  for (const Event& e : events) {
    if (out == nullptr) {
      break;
    }
    const std::string& shape = shapes[static_cast<size_t>(e.shape)];
    PyObject* tokens = e.tokens < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(e.tokens);
    PyObject* item =
        tokens == nullptr
            ? nullptr
            : Py_BuildValue("(LLiy#NOk)", static_cast<long long>(e.start_ns), static_cast<long long>(e.duration_ns),
                            e.row, shape.data(), static_cast<Py_ssize_t>(shape.size()), tokens, e.module, e.thread);
    if (item == nullptr || PyList_Append(out, item) < 0) {
      Py_XDECREF(item);
      Py_CLEAR(out);
    } else {
      Py_DECREF(item);
    }
  }
  for (PyObject* m : held) {
    Py_DECREF(m);
  }
  (void)self;
  return out;
}

// calls: every call recorded here (counts are not bounded by max_events).
PyObject* Recorder_get_calls(PyObject* op, void*) {
  RecorderState* s = recorder_state(op);
  if (s == nullptr) {
    return nullptr;
  }
  int64_t n = 0;
  for (const Row& row : s->rows) {
    n += row.calls;
  }
  return PyLong_FromLongLong(n);
}

// kept: the calls kept one by one (at most max_events).
PyObject* Recorder_get_kept(PyObject* op, void*) {
  RecorderState* s = recorder_state(op);
  return s == nullptr ? nullptr : PyLong_FromSize_t(s->events.size());
}

// -- the traced runner ----------------------------------------------------------------------
//
// TracedRunner(decision, attr, site, tensor_indices, token_indices, first, active, process_sink,
// profiler_globals, fallback): the hot part of vllm_ir.ir.dispatch.observe's traced runner in one
// C call. Per call: the sink (the `active` context variable, else process_sink[0]); with none,
// the kernel alone. Else its recorder (`sink._recorder`, a Recorder), the call's facts, the
// kernel timed by the monotonic clock, and the recorder updated. Everything it cannot do as the
// Python runner would goes to `fallback` (that runner) before the kernel runs: a sink without a
// recorder, a profiler (the flag torch.autograd.profiler._is_profiler_enabled, or this thread's
// profiler state), facts Python must read (subclasses, other layouts), a CUDA tensor (timed by
// events), a full shape table, keyword arguments.

PyObject* recorder_attr = nullptr;      // interned "_recorder"
PyObject* profiler_flag_name = nullptr;  // interned "_is_profiler_enabled"

struct TracedRunner {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* decision;
  PyObject* attr;  // "functional" / "maybe_inplace": read per call (the decision may swap its runners)
  PyObject* site;
  PyObject* active;            // contextvars.ContextVar
  PyObject* process_sink;      // list of one item
  PyObject* profiler_globals;  // torch.autograd.profiler's module dict
  PyObject* fallback;          // the Python runner
  Py_ssize_t n_tensors, n_tokens, first;
  Py_ssize_t tensors[kMaxTensorParams];
  Py_ssize_t tokens[kMaxTensorParams];
  // What the last call recorded into which recorder (by serial): its row and shapes.
  uint64_t memo_serial;
  PyObject* memo_dtype;  // borrowed, compared by identity only
  int memo_bits;
  int32_t memo_row;
  int32_t memo_shape;
  Py_ssize_t memo_n;
  int64_t* memo_values;  // kMaxTensorParams * (1 + kMaxDims) values, or NULL
};

PyObject* run_kernel(TracedRunner* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* kernel = PyObject_GetAttr(self->decision, self->attr);
  if (kernel == nullptr) {
    return nullptr;
  }
  PyObject* out = PyObject_Vectorcall(kernel, args, nargsf, kwnames);
  Py_DECREF(kernel);
  return out;
}

PyObject* TracedRunner_call(PyObject* op, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<TracedRunner*>(op);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  PyObject* sink = nullptr;
  if (PyContextVar_Get(self->active, Py_None, &sink) < 0) {
    return nullptr;
  }
  if (sink == Py_None) {
    Py_DECREF(sink);
    sink = PyList_GET_SIZE(self->process_sink) > 0 ? Py_NewRef(PyList_GET_ITEM(self->process_sink, 0)) : nullptr;
    if (sink == Py_None) {
      Py_CLEAR(sink);
    }
  }
  if (sink == nullptr) {  // the block ended in another task that shares this scope
    return run_kernel(self, args, nargsf, kwnames);
  }
  PyObject* recorder = PyObject_GetAttr(sink, recorder_attr);
  Py_DECREF(sink);  // the recorder is held; the trace holds nothing the call needs
  if (recorder == nullptr) {
    PyErr_Clear();
  }
  RecorderState* s = recorder != nullptr && Py_TYPE(recorder) == &RecorderType
                         ? reinterpret_cast<Recorder*>(recorder)->state
                         : nullptr;
  PyObject* profiling = PyDict_GetItemWithError(self->profiler_globals, profiler_flag_name);
  Facts facts;
  bool mine = s != nullptr && kwnames == nullptr && profiling == Py_False &&
              c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) == nullptr &&
              read_facts(args, nargs, self->tensors, self->n_tensors, self->tokens, self->n_tokens, self->first,
                         &facts) &&
              !facts.cuda;
  int32_t shape = -1;
  if (mine && s->max_events > 0) {
    if (self->memo_serial == s->serial && self->memo_values != nullptr && self->memo_n == facts.n &&
        std::memcmp(self->memo_values, facts.values, facts.n * sizeof(int64_t)) == 0) {
      shape = self->memo_shape;
    } else {
      try {
        shape = intern_shapes(s, facts.values, facts.n);
      } catch (...) {
        shape = -1;
      }
      mine = shape >= 0;  // the table is full: Python's recorder keeps the shapes themselves
    }
  }
  if (!mine) {
    PyErr_Clear();  // the profiler flag's lookup, at worst
    Py_XDECREF(recorder);
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  }
  const int64_t start = monotonic_ns();
  PyObject* out = run_kernel(self, args, nargsf, kwnames);
  const int64_t duration = monotonic_ns() - start;
  if (out == nullptr) {
    Py_DECREF(recorder);
    return nullptr;
  }
  // The kernel may have run anything, even cleared this recorder (Recorder_clear).
  s = reinterpret_cast<Recorder*>(recorder)->state;
  if (s == nullptr) {
    Py_DECREF(recorder);
    return out;
  }
  auto* rec = reinterpret_cast<Recorder*>(recorder);
  const unsigned long thread = PyThread_get_thread_ident();
  PyObject* module = rec->outside;
  if (rec->stacks != nullptr) {
    PyObject* key = PyLong_FromUnsignedLong(thread);
    PyObject* stack = key == nullptr ? nullptr : PyDict_GetItemWithError(rec->stacks, key);
    Py_XDECREF(key);
    if (stack == nullptr && PyErr_Occurred()) {
      Py_DECREF(out);
      Py_DECREF(recorder);
      return nullptr;
    }
    if (stack != nullptr && PyList_Check(stack) && PyList_GET_SIZE(stack) > 0) {
      module = PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1);
    }
  }
  try {
    const int64_t tokens = facts.tokens;
    const int bits = tokens < 0 ? 0 : 64 - __builtin_clzll(static_cast<uint64_t>(tokens > 0 ? tokens : 1));
    int32_t row;
    if (self->memo_serial == s->serial && self->memo_dtype == facts.dtype && self->memo_bits == bits) {
      row = self->memo_row;
    } else {
      row = find_row(s, self->site, facts.dtype, bits);
    }
    Row& r = s->rows[static_cast<size_t>(row)];
    r.calls += 1;
    r.total_ns += duration;
    ring_push(r.samples, &r.next, s->max_samples, duration);
    if (rec->stacks != nullptr) {
      auto [it, inserted] = s->modules.try_emplace({module, self->site}, 0);
      if (inserted) {
        Py_INCREF(module);
        Py_INCREF(self->site);
      }
      it->second += 1;
    }
    if (s->max_events > 0) {
      ring_push(s->events, &s->next_event, s->max_events,
                Event{start, duration, tokens, row, shape, module, thread});
      if (self->memo_values == nullptr) {
        self->memo_values = new int64_t[kMaxTensorParams * (1 + kMaxDims)];
      }
      std::memcpy(self->memo_values, facts.values, facts.n * sizeof(int64_t));
      self->memo_n = facts.n;
      self->memo_shape = shape;
    }
    self->memo_serial = s->serial;
    self->memo_dtype = facts.dtype;
    self->memo_bits = bits;
    self->memo_row = row;
  } catch (...) {
    self->memo_serial = 0;
    Py_DECREF(out);
    Py_DECREF(recorder);
    return PyErr_NoMemory();
  }
  Py_DECREF(recorder);
  return out;
}

int TracedRunner_init(PyObject* op, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<TracedRunner*>(op);
  static const char* names[] = {"decision", "attr",         "site",           "tensor_indices", "token_indices", "first",
                                "active",   "process_sink", "profiler_globals", "fallback",     nullptr};
  PyObject *decision, *attr, *site, *tensors, *tokens, *first, *active, *process_sink, *profiler_globals, *fallback;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OUOO!O!OOO!O!O", const_cast<char**>(names), &decision, &attr, &site,
                                   &PyTuple_Type, &tensors, &PyTuple_Type, &tokens, &first, &active, &PyList_Type,
                                   &process_sink, &PyDict_Type, &profiler_globals, &fallback)) {
    return -1;
  }
  if (!PyContextVar_CheckExact(active)) {
    PyErr_SetString(PyExc_TypeError, "TracedRunner: active must be a contextvars.ContextVar");
    return -1;
  }
  if (!PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_TypeError, "TracedRunner: fallback must be callable");
    return -1;
  }
  Py_ssize_t first_index = -1;
  if (first != Py_None) {
    first_index = PyLong_AsSsize_t(first);
    if (first_index < 0) {
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "TracedRunner: first must be None or an index >= 0");
      }
      return -1;
    }
  }
  if (!parse_indices(tensors, self->tensors, kMaxTensorParams, &self->n_tensors) ||
      !parse_indices(tokens, self->tokens, kMaxTensorParams, &self->n_tokens)) {
    PyErr_SetString(PyExc_ValueError, "TracedRunner: indices must be at most 64 ints >= 0");
    return -1;
  }
  self->first = first_index;
  Py_XSETREF(self->decision, Py_NewRef(decision));
  Py_XSETREF(self->attr, Py_NewRef(attr));
  PyUnicode_InternInPlace(&self->attr);
  Py_XSETREF(self->site, Py_NewRef(site));
  Py_XSETREF(self->active, Py_NewRef(active));
  Py_XSETREF(self->process_sink, Py_NewRef(process_sink));
  Py_XSETREF(self->profiler_globals, Py_NewRef(profiler_globals));
  Py_XSETREF(self->fallback, Py_NewRef(fallback));
  self->memo_serial = 0;
  self->vectorcall = TracedRunner_call;
  return 0;
}

int TracedRunner_traverse(PyObject* op, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<TracedRunner*>(op);
  Py_VISIT(self->decision);
  Py_VISIT(self->attr);
  Py_VISIT(self->site);
  Py_VISIT(self->active);
  Py_VISIT(self->process_sink);
  Py_VISIT(self->profiler_globals);
  Py_VISIT(self->fallback);
  return 0;
}

int TracedRunner_clear(PyObject* op) {
  auto* self = reinterpret_cast<TracedRunner*>(op);
  Py_CLEAR(self->decision);
  Py_CLEAR(self->attr);
  Py_CLEAR(self->site);
  Py_CLEAR(self->active);
  Py_CLEAR(self->process_sink);
  Py_CLEAR(self->profiler_globals);
  Py_CLEAR(self->fallback);
  return 0;
}

void TracedRunner_dealloc(PyObject* op) {
  PyObject_GC_UnTrack(op);
  TracedRunner_clear(op);
  delete[] reinterpret_cast<TracedRunner*>(op)->memo_values;
  Py_TYPE(op)->tp_free(op);
}

// Calls before __init__ (a bare TracedRunner.__new__) must not read NULL fields.
PyObject* TracedRunner_uninitialized(PyObject*, PyObject* const*, size_t, PyObject*) {
  PyErr_SetString(PyExc_TypeError, "TracedRunner: never initialized");
  return nullptr;
}

PyObject* TracedRunner_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* op = PyType_GenericNew(type, args, kwargs);
  if (op != nullptr) {
    reinterpret_cast<TracedRunner*>(op)->vectorcall = TracedRunner_uninitialized;
  }
  return op;
}

PyMemberDef TracedRunner_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(TracedRunner, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyGetSetDef Recorder_getset[] = {
    {"calls", Recorder_get_calls, nullptr, "Every call recorded here.", nullptr},
    {"kept", Recorder_get_kept, nullptr, "The calls kept one by one (at most max_events).", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMethodDef Recorder_methods[] = {
    {"set_stacks", Recorder_set_stacks, METH_O,
     "set_stacks(stacks): attribute calls to the last module path of stacks[thread], or not (None)."},
    {"rows", Recorder_rows, METH_NOARGS,
     "rows(): [(site, dtype, bits, calls, total_ns, recent durations oldest first)], in order of creation."},
    {"modules", Recorder_modules, METH_NOARGS, "modules(): [(module path, site, calls)]."},
    {"events", Recorder_events, METH_NOARGS,
     "events(): [(start_ns, duration_ns, row number, shapes bytes, tokens, module path, thread)], oldest first."},
    {nullptr, nullptr, 0, nullptr},
};


PyMethodDef module_methods[] = {
    {"donation_conflict", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(donation_conflict)),
     METH_FASTCALL,
     "donation_conflict(donated_mask, tensor_mask, *args): None, or (i, j) where donated argument i overlaps "
     "itself (j == i) or argument j."},
    {"call_facts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call_facts)), METH_FASTCALL,
     "call_facts(args, tensor_indices, token_indices, first): (dtype, is_cuda, shape bytes, token count), or None: "
     "Python reads them."},
    {nullptr, nullptr, 0, nullptr},
};

PyMethodDef Lookup_methods[] = {
    {"lookup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Lookup_lookup)), METH_FASTCALL,
     "lookup(*args): the cached decision for this call, or None (Python takes over)."},
    {"key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Lookup_key)), METH_FASTCALL,
     "key(scope, *args): the cache key of this call, or None when Python must build it."},
    {"forget", Lookup_forget, METH_NOARGS, "forget(): drop the remembered last hit (call when clearing the dicts)."},
    {"set_buckets", Lookup_set_buckets, METH_O,
     "set_buckets(buckets): end keys with the token-range bucket (65 bytes, one per bit length) or not (None)."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject LookupType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyTypeObject TracedRunnerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "vllm_ir.ir.dispatch._fast_lookup",
                          "Decision-cache lookups for the eager hot path (see vllm_ir.ir.dispatch.fast_lookup).", -1,
                          module_methods};

// Refuses to load under another torch than the one it was compiled against: the tensor
// layout it reads is torch's, and would be misread rather than fail.
bool check_torch_version() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) {
    return false;
  }
  PyObject* version = PyObject_GetAttrString(torch, "__version__");
  Py_DECREF(torch);
  if (version == nullptr) {
    return false;
  }
  const char* running = PyUnicode_AsUTF8(version);
  const bool same = running != nullptr && std::strcmp(running, VLLM_IR_BUILT_FOR_TORCH) == 0;
  if (running != nullptr && !same) {
    PyErr_Format(PyExc_ImportError, "vllm_ir.ir.dispatch._fast_lookup was built for torch %s but torch %s is running",
                 VLLM_IR_BUILT_FOR_TORCH, running);
  }
  Py_DECREF(version);
  return same;
}

}  // namespace

PyMODINIT_FUNC PyInit__fast_lookup(void) {
  if (!check_torch_version()) {
    return nullptr;
  }
  compiling_flag_name = PyUnicode_InternFromString("_is_compiling_flag");
  if (compiling_flag_name == nullptr) {
    return nullptr;
  }
  LookupType.tp_name = "vllm_ir.ir.dispatch._fast_lookup.Lookup";
  LookupType.tp_basicsize = sizeof(Lookup);
  LookupType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  LookupType.tp_doc =
      "Lookup(fixed, cache, scope, compiler_globals, tensor_mask, token_mask, nargs): one op's decision cache, read "
      "from C.";
  LookupType.tp_methods = Lookup_methods;
  LookupType.tp_init = Lookup_init;
  LookupType.tp_new = PyType_GenericNew;
  LookupType.tp_traverse = Lookup_traverse;
  LookupType.tp_clear = Lookup_clear;
  LookupType.tp_dealloc = Lookup_dealloc;
  LookupType.tp_free = PyObject_GC_Del;
  if (PyType_Ready(&LookupType) < 0) {
    return nullptr;
  }
  recorder_attr = PyUnicode_InternFromString("_recorder");
  profiler_flag_name = PyUnicode_InternFromString("_is_profiler_enabled");
  if (recorder_attr == nullptr || profiler_flag_name == nullptr) {
    return nullptr;
  }
  RecorderType.tp_name = "vllm_ir.ir.dispatch._fast_lookup.Recorder";
  RecorderType.tp_basicsize = sizeof(Recorder);
  RecorderType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  RecorderType.tp_doc =
      "Recorder(max_events, max_samples, max_shape_sets, outside): what a trace's compiled runners record.";
  RecorderType.tp_methods = Recorder_methods;
  RecorderType.tp_getset = Recorder_getset;
  RecorderType.tp_init = Recorder_init;
  RecorderType.tp_new = PyType_GenericNew;
  RecorderType.tp_traverse = Recorder_traverse;
  RecorderType.tp_clear = Recorder_clear;
  RecorderType.tp_dealloc = Recorder_dealloc;
  RecorderType.tp_free = PyObject_GC_Del;
  if (PyType_Ready(&RecorderType) < 0) {
    return nullptr;
  }
  TracedRunnerType.tp_name = "vllm_ir.ir.dispatch._fast_lookup.TracedRunner";
  TracedRunnerType.tp_basicsize = sizeof(TracedRunner);
  TracedRunnerType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  TracedRunnerType.tp_doc =
      "TracedRunner(decision, attr, site, tensor_indices, token_indices, first, active, process_sink, "
      "profiler_globals, fallback): a traced decision's runner, recording into its trace's Recorder.";
  TracedRunnerType.tp_vectorcall_offset = offsetof(TracedRunner, vectorcall);
  TracedRunnerType.tp_call = PyVectorcall_Call;
  TracedRunnerType.tp_members = TracedRunner_members;
  TracedRunnerType.tp_init = TracedRunner_init;
  TracedRunnerType.tp_new = TracedRunner_new;
  TracedRunnerType.tp_traverse = TracedRunner_traverse;
  TracedRunnerType.tp_clear = TracedRunner_clear;
  TracedRunnerType.tp_dealloc = TracedRunner_dealloc;
  TracedRunnerType.tp_free = PyObject_GC_Del;
  if (PyType_Ready(&TracedRunnerType) < 0) {
    return nullptr;
  }
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) {
    return nullptr;
  }
  if (PyModule_AddObjectRef(module, "Lookup", reinterpret_cast<PyObject*>(&LookupType)) < 0 ||
      PyModule_AddObjectRef(module, "Recorder", reinterpret_cast<PyObject*>(&RecorderType)) < 0 ||
      PyModule_AddObjectRef(module, "TracedRunner", reinterpret_cast<PyObject*>(&TracedRunnerType)) < 0 ||
      PyModule_AddStringConstant(module, "BUILT_FOR_TORCH", VLLM_IR_BUILT_FOR_TORCH) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
