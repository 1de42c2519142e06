"""What users run around the library: the ``vllm-ir`` CLI (`cli`), ``bench``, ``bench --model``
(`model_bench`), ``tune``, the trace (`tracing`) and paired timing (`timing`)."""
