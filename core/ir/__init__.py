"""The op model: what an op is (`register_op`, `IrOp`) and how an implementation is chosen."""
