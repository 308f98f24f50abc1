"""What pdctl knows about vLLM: its PD protocol, flags, model facts, logs, metrics and wire formats."""
