"""The Guard inside the frameworks' own training loops (one module per framework; each
imports its framework, so import the one you use: ``orchestrator.integrations.hf``)."""
