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

#include <Python.h>

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/core/GradMode.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <utility>
#include <vector>

#include <cstdint>
#include <cstring>

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

// call_facts(args, tensor_indices, token_indices, first) -> (dtype, is_cuda, shapes, tokens), or
// None when Python must read them (vllm_ir.ir.dispatch.observe.python_call_facts is the reference this
// must agree with). `dtype`, `is_cuda`: of args[first] (None, False when `first` is None).
// `shapes`: the bytes of int64 values, per tensor parameter in `tensor_indices`, -1 for None,
// else its number of dimensions and then its sizes. `tokens`: the leading dimension of the first
// tensor in `token_indices` that has a token dimension (cache_key.has_token_dim), or None.
// The trace reads these on every call: each tensor attribute read from Python costs about as
// much as this whole call, and bytes are one allocation the garbage collector never tracks.
PyObject* call_facts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) || !PyTuple_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "call_facts(args, tensor_indices, token_indices, first): three tuples and an index");
    return nullptr;
  }
  PyObject* call = args[0];
  const Py_ssize_t n_call = PyTuple_GET_SIZE(call);
  // An exact, strided tensor at position `index` of the call, or nullptr (`none`: the argument
  // is None; otherwise Python must look).
  auto tensor_at = [&](PyObject* index, bool* none) -> const at::Tensor* {
    const Py_ssize_t i = PyLong_AsSsize_t(index);
    *none = false;
    if (i < 0 || i >= n_call) {
      return nullptr;
    }
    PyObject* arg = PyTuple_GET_ITEM(call, i);
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
  int64_t values[64 * (1 + kMaxDims)];
  Py_ssize_t n = 0;
  try {
    bool none = false;
    PyObject* dtype = Py_None;
    PyObject* is_cuda = Py_False;
    if (args[3] != Py_None) {
      const at::Tensor* t = tensor_at(args[3], &none);
      if (t != nullptr) {
        dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t->scalar_type()));
        is_cuda = t->is_cuda() ? Py_True : Py_False;
      } else if (!none) {
        PyErr_Clear();
        Py_RETURN_NONE;
      }
    }
    const Py_ssize_t n_tensors = PyTuple_GET_SIZE(args[1]);
    if (n_tensors > 64) {
      Py_RETURN_NONE;
    }
    for (Py_ssize_t k = 0; k < n_tensors; ++k) {
      const at::Tensor* t = tensor_at(PyTuple_GET_ITEM(args[1], k), &none);
      if (t == nullptr) {
        if (!none) {
          PyErr_Clear();
          Py_RETURN_NONE;
        }
        values[n++] = -1;
        continue;
      }
      values[n++] = t->dim();
      for (const int64_t size : t->sizes()) {
        values[n++] = size;
      }
    }
    int64_t tokens = -1;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(args[2]) && tokens < 0; ++k) {
      const at::Tensor* t = tensor_at(PyTuple_GET_ITEM(args[2], k), &none);
      if (t == nullptr) {
        if (!none) {
          PyErr_Clear();
          Py_RETURN_NONE;
        }
        continue;
      }
      const int64_t dim = t->dim();
      if (dim >= 2 || (dim == 1 && c10::isIntegralType(t->scalar_type(), /*includeBool=*/true))) {
        tokens = t->sizes()[0];
      }
    }
    PyObject* shapes = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(values), n * sizeof(int64_t));
    if (shapes == nullptr) {
      return nullptr;
    }
    PyObject* count = tokens < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(tokens);
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
    PyTuple_SET_ITEM(out, 0, Py_NewRef(dtype));
    PyTuple_SET_ITEM(out, 1, Py_NewRef(is_cuda));
    PyTuple_SET_ITEM(out, 2, shapes);
    PyTuple_SET_ITEM(out, 3, count);
    return out;
  } catch (...) {  // a tensor whose sizes throw (symbolic, functorch wrappers): Python looks
    PyErr_Clear();
    Py_RETURN_NONE;
  }
}

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
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) {
    return nullptr;
  }
  if (PyModule_AddObjectRef(module, "Lookup", reinterpret_cast<PyObject*>(&LookupType)) < 0 ||
      PyModule_AddStringConstant(module, "BUILT_FOR_TORCH", VLLM_IR_BUILT_FOR_TORCH) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
