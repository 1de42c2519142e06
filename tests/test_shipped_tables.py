"""The tuning tables providers ship: every one parses and names only registered ops and
providers; where one was measured on this machine's facts, a fresh process with nothing
configured dispatches by it (vllm_c for the six fused norm/activation + FP8 quant ops).

Nothing is measured here: the tables are `vllm-ir tune` output checked into the providers.
"""

from __future__ import annotations

import json
import os

import pytest

import vllm_ir
from tests.python_child import run_python
from vllm_ir.ir import tuning
from vllm_ir.ir.declarations.fused_quant import FUSED_QUANT_OPS

FUSED_QUANT = tuple(op.name for op in FUSED_QUANT_OPS)

#: What an installed process sees (the tests' own processes load no plugin): the shipped tables
#: and every op's implementations.
_INSTALLED = """
import json, vllm_ir
from vllm_ir.plugins import discovery as plugins
vllm_ir.load_providers()
print(json.dumps({"shipped": plugins.tuning_facts().shipped,
                  "impls": {op.name: sorted(op.impls) for op in vllm_ir.ops}}))
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_")}


def _installed() -> dict:
    done = run_python(["-c", _INSTALLED], env=_clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


INSTALLED = _installed()
SHIPPED = [tuple(s) for s in INSTALLED["shipped"]]


def test_providers_ship_tables():
    assert any(origin.startswith("provider vllm_c") for origin, _path in SHIPPED), SHIPPED


@pytest.mark.parametrize(("origin", "path"), SHIPPED, ids=[os.path.basename(p) for _o, p in SHIPPED])
def test_every_shipped_table_parses_and_names_registered_ops_and_providers(origin, path):
    table, findings = tuning.read_table(path, origin)
    assert table is not None and not findings, [f.message for f in findings]
    assert table.entries, f"{path}: no entries"
    with open(path, encoding="utf-8") as f:
        assert len(json.load(f)["entries"]) == len(table.entries)  # none dropped as overlapping
    for e in table.entries:
        unknown = [p for p in e.providers if p not in INSTALLED["impls"].get(e.op, ())]
        assert not unknown, f"{path}: {e.op} orders {unknown}, which implement nothing for it"
        assert e.providers[-1] == "native", f"{path}: {e.op} {e.range_text()} does not close with native"
        us = {m.provider: m.us for m in e.measured}
        assert set(us) >= set(e.providers), f"{path}: {e.op}: a provider it orders was not measured"
        assert us[e.providers[0]] < 1.5 * min(us.values()), f"{path}: {e.op} {e.range_text()}: first is slow {us}"


def _applicable() -> list[str]:
    here = tuning.machine_facts(vllm_ir.current_platform().name)
    return [p for o, p in SHIPPED if (t := tuning.read_table(p, o)[0]) and not tuning.machine_mismatch(t.machine, here)]


def test_a_fresh_process_dispatches_the_fused_quant_ops_to_vllm_c_by_the_shipped_table():
    if "vllm_c" not in INSTALLED["impls"]["rms_norm_static_fp8_quant"]:
        pytest.skip("vllm_c is not installed")
    applicable = _applicable()
    if not applicable:
        pytest.skip(f"no shipped table was measured on this machine's facts ({tuning.machine_facts('cpu')})")
    script = f"""
import json, torch, vllm_ir
out = {{}}
for name in {FUSED_QUANT!r}:
    op = getattr(vllm_ir.ops, name)
    for dtype in (torch.float32, torch.bfloat16):
        for t in (1, 16, 256):
            args = op.generate_inputs((t, 4096), dtype)
            first = op.explain(*args).verdicts[0]
            out[f"{{name}} {{dtype}} T={{t}}"] = [op.dispatch(*args).provider, first.layer.name]
print(json.dumps(out))
"""
    result = run_python(["-c", script], env=_clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    chosen = json.loads(result.stdout.splitlines()[-1])
    wrong = {case: got for case, got in chosen.items() if got[0] != "vllm_c"}
    assert not wrong, f"tables {applicable}: {wrong}"
    # The table decides (a range tune could not measure quietly has no entry: the defaults decide there).
    for name in FUSED_QUANT:
        layers = [layer for case, (_p, layer) in chosen.items() if case.startswith(f"{name} ")]
        assert layers.count("TUNING") >= len(layers) // 2, f"{name}: {layers}"
