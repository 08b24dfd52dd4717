"""``python -m kvcli.integrations.lm_eval ARGS``: lm-eval's command line with the model ``kvcli`` registered.

A module of its own so that the model class is registered from ``kvcli.integrations.lm_eval``, once, and never a second
time as ``__main__``.
"""

from kvcli.integrations.lm_eval import main

main()
