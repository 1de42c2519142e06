"""Run a Hugging Face ``transformers`` decoder on vllm-ir ops: ``kernelize(model)``, ``undo(model)``.

``kernelize`` rewrites one loaded model in place, per module instance (nothing is patched on a
class or a library function, so another instance of the same model stays stock):

* RMSNorm modules -> ``vllm_ir.ops.rms_norm``. Two forms are recognised: Llama's
  (``weight * normalized.to(dtype)``: Llama, Mistral, Qwen2, Qwen3 and its q/k norms on
  ``[..., heads, head_dim]``, and every model whose norm is a copy of it; it rounds to the
  input dtype *before* the weight multiply, so a weight of another dtype -- fp32 norms on bf16
  activations -- is ``weight * rms_norm(x, None, eps)``, Llama's own multiply, where the op
  would multiply in the weight's dtype and return x's) and Gemma's
  (``normalized * (1 + weight)`` in float32, then cast). Gemma's form is exactly
  ``rms_norm(x.float(), 1 + weight.float(), eps).type_as(x)``: ``1 + weight`` is computed once
  and recomputed in eager when the weight changes.
* The decoder layer's residual add + ``post_attention_layernorm`` -> ``fused_add_rms_norm``
  (eager; under ``torch.compile`` vllm-ir's fusion pass also fuses the add that ends a layer
  with the next layer's input norm). In float32 the values are identical; in half precision
  the fused op normalizes the unrounded float32 sum (its documented semantics, as vLLM does),
  within the op's tolerances; float64 keeps the stock add (a float32 sum would round it).
  ``kernelize(model, fuse_residual=False)`` keeps the stock add in every dtype.
* Gated MLPs (``down(act(gate(x)) * up(x))``) -> one projection into ``[gate | up]`` and
  ``silu_and_mul`` / ``gelu_and_mul``; Gemma 3n's MLP with activation sparsity (its
  ``_gaussian_topk`` before a GELU) -> ``gelu_and_mul_sparse`` (vLLM's op). The gate and up
  weights are merged into one tensor and the two parameters become views of it (no extra
  memory, ``state_dict`` unchanged, in-place weight updates reach the merged tensor). Merged
  only for plain ``nn.Linear`` projections with plain tensors of one dtype and device and no
  hooks: anything else keeps the stock MLP.

Recognition is structural: a module is rewritten when its ``forward`` has the same bytecode
(code, constants, names) as the installed transformers' Llama or Gemma implementation of that
part, and the decoder layer's signature is the one the fused forward mirrors. Models that copy
these modules (most decoders do) are recognised without a list of class names; a model whose
code differs is left as it is and reported.

Not rewritten: rotary embedding. transformers computes ``cos``/``sin`` per call in the
model's rotary module and applies them inside each attention ``forward`` through a module-level
function on ``[batch, heads, tokens, head_dim]`` views; calling ``vllm_ir.ops.rotary_embedding``
there needs a copy of the whole attention forward (KV cache, attention back-end selection),
which changes with every transformers release, or a global patch of that function, which
would change every other model in the process. The report lists the rotary modules with this
reason.

Autograd: the ops have backward formulas; with gradients enabled and weights that require
them, the merged MLP concatenates the live parameters on each call so gradients reach them.
``save_pretrained`` of a kernelized model writes a checkpoint that a stock ``from_pretrained``
loads to the same logits (checked with transformers 5.25); `undo` restores the original modules.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vllm_ir

try:
    from transformers import activations as _hf_activations
    from transformers.models.gemma import modeling_gemma as _hf_gemma
    from transformers.models.llama import modeling_llama as _hf_llama
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "vllm_ir.integrations.transformers needs the transformers package: pip install 'vllm-ir[transformers]'"
    ) from exc

try:  # Gemma 3n's sparse MLP (transformers >= 4.53); optional
    from transformers.models.gemma3n import modeling_gemma3n as _hf_gemma3n
except ImportError:  # pragma: no cover - depends on the installed transformers
    _hf_gemma3n = None

__all__ = ["Report", "kernelize", "undo"]

#: The attribute on the root model that holds the state of a `kernelize` call.
_STATE = "_vllm_ir_kernelized"
#: Attributes `kernelize` sets on rewritten modules (removed by `undo`).
_ADD_NORM = "_vllm_ir_add_norm"
_ONE_PLUS_WEIGHT = "_vllm_ir_one_plus_weight"
_GATE_UP = "_vllm_ir_gate_up"
_GATED_OP = "_vllm_ir_gated_op"
_SPARSE_GATE = "_vllm_ir_sparse_gate"

#: Building blocks with no vllm-ir op of their own: never listed as unrecognised.
_PLAIN = (nn.Linear, nn.Embedding, nn.Dropout, nn.Identity, nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass
class Report:
    """What `kernelize` did: module path -> what it runs now, or why it was left as it is."""

    #: Rewritten modules: path -> the vllm-ir op(s) it now calls.
    rewritten: dict[str, str] = field(default_factory=dict)
    #: Recognised candidates left stock: path -> reason.
    skipped: dict[str, str] = field(default_factory=dict)
    #: Modules no rule applies to (and with no rewritten part): path -> class name.
    unrecognised: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"vllm-ir kernelize: {len(self.rewritten)} rewritten, {len(self.skipped)} skipped, "]
        lines[0] += f"{len(self.unrecognised)} unrecognised"
        for title, items in (("rewritten", self.rewritten), ("skipped", self.skipped)):
            lines += [f"  {title} {path or '<root>'}: {what}" for path, what in items.items()]
        lines += [f"  unrecognised {path}: {cls}" for path, cls in self.unrecognised.items()]
        return "\n".join(lines)


@dataclass
class _State:
    """What `undo` reverts. Plain data (no closures), so that a deep copy of a kernelized model
    carries a state that points at the copy's modules."""

    report: Report
    #: (module, attribute) pairs set on instances.
    attributes: list[tuple[nn.Module, str]] = field(default_factory=list)
    #: MLPs whose gate and up weights were merged.
    merged: list[nn.Module] = field(default_factory=list)


# --- recognition ------------------------------------------------------------------------------


def _code_key(fn: Any) -> tuple | None:
    """What makes two functions the same code: bytecode, constants, names, arguments and flags."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return (
        code.co_code,
        code.co_consts,
        code.co_names,
        code.co_varnames,
        code.co_argcount,
        code.co_kwonlyargcount,
        code.co_flags,
    )


@functools.cache
def _references() -> dict[str, tuple | None]:
    """Code keys of the installed transformers' reference modules (Llama's and Gemma's)."""
    return {
        "llama_norm": _code_key(_hf_llama.LlamaRMSNorm.forward),
        "gemma_norm": _code_key(_hf_gemma.GemmaRMSNorm.forward),
        "gemma_norm_inner": _code_key(_hf_gemma.GemmaRMSNorm._norm),
        "mlp": _code_key(_hf_llama.LlamaMLP.forward),
        "layer": _code_key(_hf_llama.LlamaDecoderLayer.forward),
        "sparse_mlp": None if _hf_gemma3n is None else _code_key(_hf_gemma3n.Gemma3nTextMLP.forward),
        "gaussian_topk": None if _hf_gemma3n is None else _code_key(_hf_gemma3n.Gemma3nTextMLP._gaussian_topk),
    }


def _stock_forward(module: nn.Module) -> Any | None:
    """The class's forward, or None when the instance already has its own (ours or someone else's)."""
    if "forward" in module.__dict__:
        return None
    return type(module).forward


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _norm_form(module: nn.Module) -> str | None:
    """ "llama" or "gemma" when ``module`` is an RMSNorm of that form, else None."""
    forward = _stock_forward(module)
    if forward is None:
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None
    key, refs = _code_key(forward), _references()
    if key == refs["llama_norm"] and isinstance(getattr(module, "variance_epsilon", None), float):
        return "llama"
    if (
        key == refs["gemma_norm"]
        and _code_key(getattr(type(module), "_norm", None)) == refs["gemma_norm_inner"]
        and isinstance(getattr(module, "eps", None), float)
    ):
        return "gemma"
    return None


# Module-level functions (not partials of the ops): a deep copy of a kernelized model shares them.
def _silu_and_mul(x: Tensor) -> Tensor:
    return vllm_ir.ops.silu_and_mul(x)


def _gelu_and_mul(x: Tensor) -> Tensor:
    return vllm_ir.ops.gelu_and_mul(x, "none")


def _gelu_tanh_and_mul(x: Tensor) -> Tensor:
    return vllm_ir.ops.gelu_and_mul(x, "tanh")


_GELU_AND_MUL = {"none": _gelu_and_mul, "tanh": _gelu_tanh_and_mul}


def _gated_op(act: nn.Module) -> tuple[Callable[[Tensor], Tensor], str] | str:
    """The gated IR op equal to ``act(gate) * up`` for this activation module, or why there is none."""
    if _has_hooks(act) or "forward" in act.__dict__:
        return f"its activation {type(act).__name__} has hooks or an instance forward"
    kind = type(act)
    silu_types = (nn.SiLU, getattr(_hf_activations, "SiLUActivation", nn.SiLU))
    if kind in silu_types:
        return _silu_and_mul, "silu_and_mul"
    if kind is nn.GELU and act.approximate in ("none", "tanh"):
        return _GELU_AND_MUL[act.approximate], f"gelu_and_mul({act.approximate})"
    fn = getattr(act, "act", None)
    if kind is getattr(_hf_activations, "GELUActivation", None) and fn is F.gelu:
        return _gelu_and_mul, "gelu_and_mul(none)"
    if (
        kind in {getattr(_hf_activations, n, None) for n in ("GELUTanh", "PytorchGELUTanh")} - {None}
        and isinstance(fn, functools.partial)
        and fn.func is F.gelu
        and fn.args == ()
        and fn.keywords == {"approximate": "tanh"}
    ):
        return _gelu_tanh_and_mul, "gelu_and_mul(tanh)"
    return f"no gated vllm-ir op computes its activation {kind.__name__} exactly"


def _merge_refusal(gate: nn.Module, up: nn.Module) -> str | None:
    """Why the gate and up projections cannot share one merged weight, or None."""
    for name, proj in (("gate_proj", gate), ("up_proj", up)):
        if type(proj) is not nn.Linear:
            return f"{name} is a {type(proj).__name__}, not a plain nn.Linear (quantized or wrapped weights)"
        if _has_hooks(proj) or hasattr(proj, "_hf_hook") or "forward" in proj.__dict__:
            return f"{name} has hooks or an instance forward (e.g. offloading)"
        for tensor in (proj.weight, proj.bias):
            if tensor is not None and type(tensor.data) is not Tensor:
                return f"{name} holds a {type(tensor.data).__name__}, not a plain tensor"
        if proj.weight.is_meta:
            return f"{name}'s weight is on the meta device (not loaded)"
    if gate.in_features != up.in_features or gate.out_features != up.out_features:
        return "gate_proj and up_proj have different shapes"
    if (gate.bias is None) != (up.bias is None):
        return "only one of gate_proj and up_proj has a bias"
    for a, b in ((gate.weight, up.weight), (gate.bias, up.bias)):
        if a is not None and (a.dtype != b.dtype or a.device != b.device):
            return "gate_proj and up_proj differ in dtype or device"
    return None


# --- the rewritten forwards (bound to one instance each) --------------------------------------


def _llama_norm_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """Llama's ``weight * normalized.to(input dtype)``: the normalized value rounded to x's dtype
    *before* the weight multiply (with type promotion). With a weight of x's dtype that is the
    op's own expression; with another (an fp32 weight on bf16 activations) the op would multiply
    in the weight's dtype and return x's (vLLM's semantics), so the norm runs without weight and
    Llama's own multiply follows."""
    w = self.weight
    if w.dtype == hidden_states.dtype:
        return vllm_ir.ops.rms_norm(hidden_states, w, self.variance_epsilon)
    return w * vllm_ir.ops.rms_norm(hidden_states, None, self.variance_epsilon)


#: Dtypes whose residual sum the fused op's float32 sum reproduces (rounded to the dtype); wider
#: ones (float64) keep the stock add, which float32 would round.
_FUSABLE = (torch.float32, torch.bfloat16, torch.float16)


def _llama_add_norm(self: nn.Module, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """``(norm(residual + x), residual + x)``."""
    if x.dtype not in _FUSABLE or residual.dtype != x.dtype:
        total = residual + x
        return self(total), total
    w = self.weight
    if w.dtype == x.dtype:
        return vllm_ir.ops.fused_add_rms_norm(x, residual, w, self.variance_epsilon)
    # Llama's multiply after the rounding to x's dtype (see _llama_norm_forward).
    out, total = vllm_ir.ops.fused_add_rms_norm(x, residual, None, self.variance_epsilon)
    return w * out, total


def _one_plus_weight(self: nn.Module) -> Tensor:
    """Gemma's ``1 + weight.float()``: computed in the graph under compile and where gradients are
    recorded; in eager computed once and recomputed when the weight changed (in place or by ``.to()``)."""
    w = self.weight
    if torch.compiler.is_compiling() or (w.requires_grad and torch.is_grad_enabled()):
        return 1.0 + w.float()
    key, cached = getattr(self, _ONE_PLUS_WEIGHT)
    current = (w.data_ptr(), w._version, w.dtype, w.device)
    if current != key:
        with torch.no_grad():
            cached = 1.0 + w.float()
        setattr(self, _ONE_PLUS_WEIGHT, (current, cached))
    return cached


def _gemma_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    return vllm_ir.ops.rms_norm(x.float(), _one_plus_weight(self), self.eps).type_as(x)


def _gemma_add_norm(self: nn.Module, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    if x.dtype not in _FUSABLE or residual.dtype != x.dtype:
        total = residual + x
        return self(total), total
    out, total = vllm_ir.ops.fused_add_rms_norm(x.float(), residual.float(), _one_plus_weight(self), self.eps)
    return out.type_as(x), total.to(x.dtype)


def _merge_gate_up(self: nn.Module) -> None:
    """Concatenate the gate and up weights (and biases) and make both parameters views of the result."""
    gate, up, rows = self.gate_proj, self.up_proj, self.gate_proj.out_features
    merged = []
    for a, b in ((gate.weight, up.weight), (gate.bias, up.bias)):
        if a is None:
            merged.append(None)
            continue
        with torch.no_grad():
            both = torch.cat((a, b))
        a.data, b.data = both[:rows], both[rows:]
        merged.append(both)
    setattr(self, _GATE_UP, tuple(merged))


def _gate_up_weights(self: nn.Module) -> tuple[Tensor, Tensor | None]:
    gate, up = self.gate_proj, self.up_proj
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (gate.weight, up.weight, gate.bias, up.bias)
    )
    if needs_grad:  # concatenate the live parameters so that gradients reach them
        bias = None if gate.bias is None else torch.cat((gate.bias, up.bias))
        return torch.cat((gate.weight, up.weight)), bias
    weight, bias = getattr(self, _GATE_UP)
    if not torch.compiler.is_compiling() and (
        gate.weight.data_ptr() != weight.data_ptr()
        or up.weight.data_ptr() != weight[gate.out_features :].data_ptr()
        or (bias is not None and gate.bias.data_ptr() != bias.data_ptr())
    ):  # the parameters were replaced (``.to()``, assignment): merge them again
        _merge_gate_up(self)
        weight, bias = getattr(self, _GATE_UP)
    return weight, bias


def _mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    weight, bias = _gate_up_weights(self)
    return self.down_proj(getattr(self, _GATED_OP)(F.linear(x, weight, bias)))


def _sparse_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """Gemma 3n's MLP with activation sparsity: ``gelu_and_mul_sparse`` on the merged projection.

    Gemma 3n rounds its multiplier (the normal quantile of the sparsity, float32) to the
    activations' dtype and multiplies the std by it in that dtype: the op's float32 scalar
    multiply is the same rounding when given that rounded value.
    """
    weight, bias = _gate_up_weights(self)
    gate_up = F.linear(x, weight, bias)
    quantile, approximate, by_dtype = getattr(self, _SPARSE_GATE)
    multiplier = by_dtype.get(gate_up.dtype)
    if multiplier is None:
        multiplier = by_dtype[gate_up.dtype] = float(quantile.to(gate_up.dtype))
    return self.down_proj(vllm_ir.ops.gelu_and_mul_sparse(gate_up, multiplier, approximate))


def _sparse_mlp_quantile(module: nn.Module) -> Tensor:
    """Gemma3nTextMLP._gaussian_topk's std multiplier before its rounding: the float32 quantile."""
    target = torch.tensor(module.activation_sparsity, dtype=torch.float32)
    return torch.distributions.normal.Normal(0, 1).icdf(target)


def _fused_layer_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cache: Any | None = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[Tensor, Tensor] | None = None,
    **kwargs: Any,
) -> Tensor:
    """The pre-norm decoder layer (its stock forward's calls, in order) with the residual add and
    the post-attention norm as one ``fused_add_rms_norm``."""
    if cache is None and "past_key_values" in kwargs:  # the stock forward's deprecated name
        cache = kwargs.pop("past_key_values")
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states, residual = getattr(self.post_attention_layernorm, _ADD_NORM)(hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _signature(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(inspect.unwrap(fn)).parameters.values()]


#: The stock layer's attribute names the fused forward relies on.
_LAYER_PARTS = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}


def _layer_refusal(layer: nn.Module, rewritten_norms: set[int]) -> str | None:
    """Why ``layer`` (whose forward is Llama's) cannot take the fused forward, or None."""
    forward = inspect.unwrap(type(layer).forward)
    if _signature(forward) != _signature(_fused_layer_forward):
        return f"its forward's signature {inspect.signature(forward)} is not the one the fused forward mirrors"
    if not _LAYER_PARTS <= set(forward.__code__.co_names):
        return "its forward does not call input_layernorm, self_attn, post_attention_layernorm and mlp"
    post = getattr(layer, "post_attention_layernorm", None)
    if post is None or id(post) not in rewritten_norms:
        return "its post_attention_layernorm was not rewritten"
    if _has_hooks(post):
        return "its post_attention_layernorm has hooks (the fused op would bypass them)"
    return None


# --- the public functions ---------------------------------------------------------------------


def _bind(module: nn.Module, name: str, fn: Callable[..., Any], state: _State) -> None:
    """Set ``module.<name>`` to ``fn`` bound to this instance; `undo` removes it."""
    module.__dict__[name] = types.MethodType(fn, module)
    state.attributes.append((module, name))


def _set(module: nn.Module, name: str, value: Any, state: _State) -> None:
    module.__dict__[name] = value
    state.attributes.append((module, name))


def kernelize(model: nn.Module, *, fuse_residual: bool = True) -> Report:
    """Rewrite ``model`` (a loaded transformers model) in place to call vllm-ir ops; return what changed.

    Per instance only; a second call returns the first call's report and changes nothing
    (whatever its options: `undo` first to change them); `undo` restores the stock model.
    ``fuse_residual=False`` keeps the decoder layers' own residual adds: then, on the native
    provider, the rewritten model is bit-identical to stock in every dtype.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"vllm_ir.integrations.transformers.kernelize: expected a torch.nn.Module, not {type(model)}")
    existing = model.__dict__.get(_STATE)
    if existing is not None:
        return existing.report
    state = _State(Report())
    report = state.report
    modules = dict(model.named_modules())
    rewritten_norms: set[int] = set()
    consumed: set[str] = set()  # parts of rewritten modules (an MLP's activation)
    refs = _references()

    for path, module in modules.items():
        form = _norm_form(module)
        if form == "llama":
            _bind(module, "forward", _llama_norm_forward, state)
            _bind(module, _ADD_NORM, _llama_add_norm, state)
            report.rewritten[path] = "rms_norm"
        elif form == "gemma":
            _set(module, _ONE_PLUS_WEIGHT, (None, None), state)
            _bind(module, "forward", _gemma_norm_forward, state)
            _bind(module, _ADD_NORM, _gemma_add_norm, state)
            report.rewritten[path] = "rms_norm (float32, weight 1 + w)"
        if form is not None:
            rewritten_norms.add(id(module))
            continue

        forward = _stock_forward(module)
        key = None if forward is None or forward is nn.Module.forward else _code_key(forward)
        if key is not None and key == refs["mlp"]:
            act = getattr(module, "act_fn", None)
            chosen = _gated_op(act) if isinstance(act, nn.Module) else "it has no act_fn module"
            refusal = chosen if isinstance(chosen, str) else _merge_refusal(module.gate_proj, module.up_proj)
            if refusal is not None:
                report.skipped[path] = f"gated MLP kept stock: {refusal}"
                continue
            op, op_name = chosen
            _merge_gate_up(module)
            state.merged.append(module)
            _set(module, _GATED_OP, op, state)
            _bind(module, "forward", _mlp_forward, state)
            report.rewritten[path] = f"merged gate_up projection + {op_name}"
            consumed.add(f"{path}.act_fn" if path else "act_fn")
        elif (
            key is not None
            and key == refs["sparse_mlp"]
            and _code_key(type(module)._gaussian_topk) == refs["gaussian_topk"]
        ):
            act = getattr(module, "act_fn", None)
            chosen = _gated_op(act) if isinstance(act, nn.Module) else "it has no act_fn module"
            if not isinstance(chosen, str) and not chosen[1].startswith("gelu_and_mul"):
                chosen = f"its activation {type(act).__name__} is not a GELU (gelu_and_mul_sparse's)"
            refusal = chosen if isinstance(chosen, str) else _merge_refusal(module.gate_proj, module.up_proj)
            if refusal is not None:
                report.skipped[path] = f"gated MLP kept stock: {refusal}"
                continue
            op, op_name = chosen
            _merge_gate_up(module)
            state.merged.append(module)
            _set(module, _GATED_OP, op, state)
            if module.activation_sparsity > 0.0:  # Gemma 3n's _gaussian_topk runs only then
                approximate = op_name.removeprefix("gelu_and_mul(").removesuffix(")")
                _set(module, _SPARSE_GATE, (_sparse_mlp_quantile(module), approximate, {}), state)
                _bind(module, "forward", _sparse_mlp_forward, state)
                report.rewritten[path] = f"merged gate_up projection + gelu_and_mul_sparse({approximate})"
            else:
                _bind(module, "forward", _mlp_forward, state)
                report.rewritten[path] = f"merged gate_up projection + {op_name}"
            consumed.add(f"{path}.act_fn" if path else "act_fn")
        elif "inv_freq" in module._buffers:
            report.skipped[path] = (
                "rotary embedding not rewritten: transformers applies cos/sin inside each attention forward "
                "through a module-level function; vllm_ir.ops.rotary_embedding would need a copy of the whole "
                "attention forward or a global patch"
            )

    # Decoder layers last: their fused forward needs their norms rewritten.
    for path, module in modules.items():
        forward = _stock_forward(module)
        if forward is None or forward is nn.Module.forward or _code_key(forward) != refs["layer"]:
            continue
        refusal = "fuse_residual=False" if not fuse_residual else _layer_refusal(module, rewritten_norms)
        if refusal is not None:
            report.skipped[path] = f"decoder layer keeps its residual add: {refusal}"
            continue
        _bind(module, "forward", _fused_layer_forward, state)
        report.rewritten[path] = "residual add + post_attention_layernorm as fused_add_rms_norm"

    touched = [*report.rewritten, *report.skipped]
    for path, module in modules.items():
        if path in report.rewritten or path in report.skipped or path in consumed or isinstance(module, _PLAIN):
            continue
        if path == "" or any(p.startswith(path + ".") for p in touched):
            continue  # a container of rewritten or recognised parts
        report.unrecognised[path] = type(module).__qualname__
    model.__dict__[_STATE] = state
    return report


def undo(model: nn.Module) -> bool:
    """Restore the stock forwards and separate gate/up weights; False if ``model`` was not kernelized."""
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return False
    for mlp in state.merged:
        mlp.__dict__.pop(_GATE_UP, None)
        for t in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.gate_proj.bias, mlp.up_proj.bias):
            if t is not None:
                t.data = t.data.clone()  # own storage again
    for module, name in state.attributes:
        module.__dict__.pop(name, None)
    return True
