"""The ops vllm-ir declares itself, one module per op family; importing this package registers them.

Every module in this package is imported (in name order, `vllm_ir.ir.families`), so adding an
op family is adding a file: its function(s), tolerances, input generator and input variants live
there.
"""

from vllm_ir.ir.families import import_families

#: The op family modules, in the order they were imported.
FAMILIES = import_families(__name__, __path__)
