"""The Guard inside the frameworks' own training loops (issue 32).

One module per framework, imported by name (each imports its framework, an optional
dependency): ``orchestrator.integrations.accelerate`` (Hugging Face Accelerate),
``orchestrator.integrations.hf`` (``transformers.Trainer``),
``orchestrator.integrations.lightning`` (Lightning). docs/integrations.md lists them.
"""
