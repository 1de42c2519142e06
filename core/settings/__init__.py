"""Settings: environment variables (`env`), the config file (`config`) and logging (`log`).

Every part of vllm-ir reads its settings through here; nothing in this folder imports the IR
core, the plugin layer or the tools.
"""
