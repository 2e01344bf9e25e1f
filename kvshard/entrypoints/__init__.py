"""How users reach the engine: the Python API (`LLM`), the CLI, the OpenAI-compatible server."""
