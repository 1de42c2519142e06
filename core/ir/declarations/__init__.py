"""The ops vllm-ir declares itself, one module per op family; importing this package registers them.

Every module in this package is imported (in name order), so adding an op family is adding
a file: its function(s), tolerances, input generator and input variants live there.
"""

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
