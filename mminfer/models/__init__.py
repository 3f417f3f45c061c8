"""Model adapters: Qwen2.5-VL, LongVILA and the embedded default model."""
