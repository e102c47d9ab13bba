"""Token-only engine side of the stack: launching real vLLM engines and the protocol-exact simulator."""
