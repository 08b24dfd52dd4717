"""Layer 2, models: loading (a Hugging Face folder or a GGUF, offline), the model cache that converts a GGUF
once and trusts it by its SHA-256, and the presets (a model's or a method's settings in a TOML file).
"""
