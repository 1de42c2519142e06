"""A 4-layer Llama (random weights, hidden 512, bf16), kernelized, generating 8 tokens."""

import torch
import transformers

from vllm_ir.integrations import transformers as hf

config = transformers.LlamaConfig(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)
hf.kernelize(model)
prompt = torch.randint(0, 1024, (1, 32))
with torch.no_grad():
    model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
