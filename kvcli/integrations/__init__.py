"""Layer 6, other tools driving kvcli: lm-evaluation-harness's model ``kvcli``. Beside the CLI, at the top:
it may use every layer, and nothing in kvcli imports it.
"""
