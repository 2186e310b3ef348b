"""Training tools: the demo tokenizer + target trainer and draft distillation."""
