"""Layer 4, reading and writing: a document read into a compressed cache, then an answer or a summary
written from it (``ask``, ``summarize``), with the prompts, the recap of the passages a question pointed
at, and summaries in sections for documents longer than one.
"""
